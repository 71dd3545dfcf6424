"""Where a cold prefill with a connector storing spends more than one without a connector,
measured from outside the product: the connector's methods timed on both sides of the engine
(scheduler and worker, wall time of each call, which holds any wait they do on the GPU or the
server), each engine step, the server's ``Stored N tokens in X seconds`` lines (its copies
out of the GPU), and the L2 files each cold wrote (when the first and the last landed)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

SCHEDULER_METHODS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
)
WORKER_METHODS = (
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "clear_connector_metadata",
)


class CallTimer:
    """Wraps methods of connector objects; each call's wall time adds up under its name."""

    def __init__(self) -> None:
        self.totals: dict[str, list[float]] = {}

    def _timed(self, label: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                slot = self.totals.setdefault(label, [0, 0.0])
                slot[0] += 1
                slot[1] += time.perf_counter() - t

        return timed

    def wrap(self, obj: Any, side: str, names: Sequence[str]) -> list[str]:
        """Time ``obj``'s methods ``names`` (those it has) as ``side.name``."""
        done = []
        for name in names:
            orig = getattr(obj, name, None)
            if callable(orig):
                setattr(obj, name, self._timed(f"{side}.{name}", orig))
                done.append(f"{side}.{name}")
        return done

    def take(self) -> dict[str, dict[str, float]]:
        """The calls since the last take: {side.method: {calls, s}}."""
        out = {k: {"calls": int(n), "s": round(s, 6)} for k, (n, s) in self.totals.items()}
        self.totals.clear()
        return out


def worker_connector() -> Any:
    """The engine's worker-side connector (the worker runs in this process), or None."""
    try:
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            get_kv_transfer_group,
            has_kv_transfer_group,
        )
    except ImportError:
        return None
    return get_kv_transfer_group() if has_kv_transfer_group() else None


def prefill_steps(steps: Sequence[dict[str, float]], ttft: float) -> list[float]:
    """Durations of the steps that started before the first token (``_generate_timed``'s
    steps: start ``t``, seconds ``s``; the first starts right after the request is added)."""
    if not steps:
        return []
    t0 = steps[0]["t"]
    return [round(st["s"], 5) for st in steps if st["t"] - t0 < ttft]


def write_window(files: dict[str, tuple[int, float]], start_epoch: float | None) -> dict:
    """The L2 files a cold wrote ({path: (size, mtime)}): how many, their bytes, and when the
    first and the last was last written, in seconds after the request began."""
    out: dict[str, Any] = {"files": len(files), "bytes": sum(s for s, _ in files.values())}
    if files and start_epoch is not None:
        mtimes = [m for _, m in files.values()]
        out.update(first_s=round(min(mtimes) - start_epoch, 3))
        out.update(last_s=round(max(mtimes) - start_epoch, 3))
    return out


def server_stores(stores: Iterable[dict[str, Any]], start: float, end: float) -> dict:
    """The server's store lines between ``start`` and ``end`` (epochs): count, tokens, seconds."""
    inside = [s for s in stores if start <= s["t"] < end]
    return {
        "count": len(inside),
        "tokens": sum(s["tokens"] for s in inside),
        "s": round(sum(s["s"] for s in inside), 4),
    }


def _med(values: Iterable[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def summarize(misses: Sequence[dict[str, Any]], baseline: Sequence[dict[str, Any]]) -> dict:
    """Medians over the colds with the connector (``misses``) against those without
    (``baseline``): TTFT, the extra, the connector's calls by method, the server's copies,
    the prefill steps' sum and median, the L2 writes' end."""
    if not misses or not baseline:
        return {}
    methods = sorted({m for x in misses for m in x.get("connector") or {}})
    out = {
        "baseline_ttft_s": _med(x.get("ttft_s") for x in baseline),
        "miss_ttft_s": _med(x.get("ttft_s") for x in misses),
        "baseline_step_s": _med(_med(x.get("steps_s") or []) for x in baseline),
        "miss_step_s": _med(_med(x.get("steps_s") or []) for x in misses),
        "connector_s": _med(
            sum(c["s"] for c in (x.get("connector") or {}).values()) for x in misses
        ),
        "by_method_s": {
            m: _med(((x.get("connector") or {}).get(m) or {}).get("s", 0.0) for x in misses)
            for m in methods
        },
        "server_store_s": _med((x.get("server") or {}).get("s") for x in misses),
        "writes_last_s": _med((x.get("writes") or {}).get("last_s") for x in misses),
    }
    if out["baseline_ttft_s"] and out["miss_ttft_s"]:
        out["extra_s"] = out["miss_ttft_s"] - out["baseline_ttft_s"]
        out["miss_over_baseline"] = out["miss_ttft_s"] / out["baseline_ttft_s"]
    return out
