"""The restore bench's results: the LMCache server log it reads the restores' L2 bytes and
copy rates from, the disk bound, the report (JSON, markdown, plots)."""

from __future__ import annotations

import datetime as _dt
import math
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridfa_gate.report import fmt, md_table, write_json_md

GB = 1e9
SCHEMA = "hybridfa-bench-gpu/2"
MAIN_MODEL = "qwen35-9b"  # drawn with solid lines
ARMS = ("cold", "default", "pagecache", "offloading", "lmcache056")


def offloading_transfer_config(root: Path, cpu_bytes: int, engine_id: str) -> dict[str, Any]:
    """vLLM 0.26.0's OffloadingConnector: a CPU tier and a file-system tier under ``root``.
    ``engine_id`` names its /dev/shm region, which an engine that is killed leaves behind."""
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": int(cpu_bytes),
        "secondary_tiers": [{"type": "fs", "root_dir": str(root)}],
    }
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_connector_extra_config": extra,
    }


_TS = r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]"
_WINDOW = re.compile(
    _TS + r"[^\n]*?L0<->L1 stats \[[^\]]+\] last ([0-9.]+)s: store [^|\n]*\| retrieve "
    r"ops=(\d+) tokens=(\d+) size=([0-9.]+)GB avg_copy=(?:([0-9.]+)GB/s|n/a)"
)
_PREFETCH = re.compile(
    _TS + r"[^\n]*?Prefetch request completed[^:\n]*: \d+/\d+ retained keys \((\d+) L1, (\d+) L2\)"
)


def parse_server_log(text: str) -> dict[str, list[dict[str, Any]]]:
    """windows: --enable-extra-logging's retrieve side (copies LMCache timed on the CUDA stream,
    ended in (t0, t1]); prefetch: each prefetch line's L1 / L2 objects. Times: epochs."""

    def epoch(day: str, ms: str) -> float:
        return time.mktime(time.strptime(day, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1e3

    windows = [
        {
            "t0": epoch(d, ms) - float(last),
            "t1": epoch(d, ms),
            "ops": int(ops),
            "bytes": float(gb) * GB,
            "tokens": int(tok),
            "gbps": float(rate) if rate else None,
        }
        for d, ms, last, ops, tok, gb, rate in _WINDOW.findall(text)
    ]
    found = _PREFETCH.findall(text)
    return {
        "windows": windows,
        "prefetch": [{"t": epoch(d, ms), "l1": int(a), "l2": int(b)} for d, ms, a, b in found],
    }


def timed_h2d(windows: Sequence[dict[str, Any]], restores: Sequence[tuple[Any, int]]) -> list[Any]:
    """Stream-timed H2D GB/s per restore ((span, hit tokens) in time order, warm-up included).
    A copy window goes to the earliest restore whose span it overlaps and whose hit it has not
    covered; a rate needs windows that cover the hit and hold no other restore's copies."""
    acc = [{"tokens": 0, "bytes": 0.0, "s": 0.0, "mixed": False} for _ in restores]
    for w in (w for w in windows if w["ops"]):
        need = [
            i
            for i, (sp, hit) in enumerate(restores)
            if sp and w["t0"] < sp[1] and w["t1"] >= sp[0] and acc[i]["tokens"] < hit
        ]
        if not need:
            continue
        a = acc[need[0]]
        if a["tokens"] + w["tokens"] > restores[need[0]][1]:  # holds the next restore's copies
            for b in acc[need[0] : need[0] + 2]:
                b["mixed"] = True
        a["tokens"] += w["tokens"]
        a["bytes"] += w["bytes"]
        a["s"] += w["bytes"] / (w["gbps"] * GB) if w["gbps"] else math.inf
    good = [
        h and not a["mixed"] and a["tokens"] >= h and 0 < a["s"] < math.inf
        for a, (_, h) in zip(acc, restores, strict=True)
    ]
    return [a["bytes"] / a["s"] / GB if ok else None for a, ok in zip(acc, good, strict=True)]


def l2_read_bytes(l2: int, hit: int, chunk: int, group_means: dict[str, float], fa: int) -> Any:
    """Bytes of ``l2`` objects a restore read: one object group, all at its size; several (FA
    apart from recurrent state), FA's (size nearest ``fa``) per hit chunk, the rest the others'."""
    if not l2 or not group_means:
        return None
    if len(group_means) == 1:
        return l2 * next(iter(group_means.values()))
    fa_group = min(group_means, key=lambda g: abs(group_means[g] - fa))
    others = [v for g, v in group_means.items() if g != fa_group]
    n_fa = min(hit // chunk, l2)
    return n_fa * group_means[fa_group] + (l2 - n_fa) * sum(others) / len(others)


def bound_of(row: dict[str, Any]) -> dict[str, Any] | None:
    """Read ``row``'s bytes at the disk's (pagecache: page cache's) rate, copy at pinned H2D."""
    rates, cached, nbytes = row.get("rates") or {}, row["arm"] == "pagecache", row.get("read_bytes")
    read = rates.get("page_cache_read_gbps" if cached else "disk_read_gbps")
    h2d, restore = rates.get("pinned_h2d_gbps"), row.get("restore_ttft_s")
    if not (nbytes and read and h2d and restore):
        return None
    bound = nbytes / (read * GB) + nbytes / (h2d * GB)
    return {
        "read_bytes": nbytes,
        "read_from": "page cache" if cached else "disk",
        "read_gbps": read,
        "pinned_h2d_gbps": h2d,
        "bound_s": bound,
        "restore_s": restore,
        "restore_over_bound": restore / bound,
        "bound_over_restore": bound / restore,
    }


def object_group_means(inventory: dict[str, Any]) -> dict[str, float]:
    """Mean object bytes per object group of an L2 inventory (``l2.tier_inventory``)."""
    groups = inventory.get("per_object_group") or {}
    return {og: g["bytes"] / g["objects"] for og, g in groups.items() if g.get("objects")}


def row_key(model: str, p: int, arm: str) -> str:
    return f"{model}:{p}:{arm}"


def sort_key(r: dict[str, Any]) -> tuple[str, int, int]:
    return r["model"], r["prompt_tokens"], ARMS.index(r["arm"])


def summarize(results: dict[str, Any]) -> None:
    """Rows' cold TTFT, speedup, disk bound; the top-level views and findings."""
    rows, ordered = results["rows"], sorted(results["rows"].values(), key=sort_key)
    for r in (r for r in ordered if r["arm"] != "cold"):
        cold = rows.get(row_key(r["model"], r["prompt_tokens"], "cold")) or {}
        r["cold_ttft_s"], ttft = cold.get("cold_ttft_s"), r.get("restore_ttft_s")
        r["speedup"] = r["cold_ttft_s"] / ttft if r["cold_ttft_s"] and ttft else None
        r["disk_bound"] = bound_of(r)
    keep = (
        "model",
        "prompt_tokens",
        "ok",
        "cold_ttft_s",
        "restore_ttft_s",
        "speedup",
        "hit_tokens",
        "read_bytes",
        "h2d_gbps",
        "correct",
        "errors",
    )
    results["default"] = [{k: r.get(k) for k in keep} for r in ordered if r["arm"] == "default"]
    results["offloadingconnector"] = {
        "kv_transfer_config": offloading_transfer_config(Path("ROOT_DIR"), 0, "ENGINE_ID"),
        "rows": [{k: r.get(k) for k in keep} for r in ordered if r["arm"] == "offloading"],
    }
    results["disk_bound"] = {
        "definition": "L2 bytes read / sequential read rate + the same bytes / pinned H2D rate",
        "rows": [
            {"arm": r["arm"], **{k: r[k] for k in keep[:2]}, **r["disk_bound"]}
            for r in ordered
            if r.get("disk_bound")
        ],
    }
    results["findings"] = [f for r in ordered for f in r.get("findings") or []]


_f = fmt
HEADER = (
    "model | prompt | arm | hit | cold | restore (n) | speedup | cold in engine | L2 GB read"
    " | H2D GB/s (timed) | bound s | bound/restore | page cache | KV bytes | tokens | errors"
)


def markdown_report(results: dict[str, Any]) -> str:
    runs = results.get("runs") or [{}]
    run = runs[-1]
    lines = [
        f"# GPU restore bench ({results.get('created')})",
        "",
        f"- runs: {', '.join(str(r.get('started')) for r in runs)} (the last one's machine below)",
        f"- hardware: {run.get('hardware')}",
        f"- versions: {run.get('versions')}",
        f"- L2 filesystem: {run.get('l2_fs')}; /dev/shm free GB: {run.get('dev_shm_gb')}",
        f"- probed rates (GB/s): {run.get('rates')}",
        "",
        "TTFT s, medians; cold in engine: the restore engine's colds, in turn.",
    ]
    rows = []
    for r in sorted(results["rows"].values(), key=sort_key):
        b, pc, gb = r.get("disk_bound") or {}, r.get("page_cache") or {}, r.get("read_bytes")
        cache = {True: "dropped", False: "kept"}.get(pc.get("dropped"), "-")
        cache += f" ({_f(pc.get('resident_fraction'), 2)} resident)" if pc else ""
        row = [
            r["model"],
            r["prompt_tokens"],
            r["arm"],
            r.get("hit_tokens"),
            r.get("cold_ttft_s"),
            f"{_f(r.get('restore_ttft_s'))} ({len(r.get('restores') or [])})",
            r.get("speedup"),
            r.get("cold_in_engine_s"),
            gb / GB if gb else None,
            f"{_f(r.get('h2d_gbps'))} ({r.get('h2d_timed', 0)})",
            b.get("bound_s"),
            b.get("bound_over_restore"),
            cache,
            (r.get("kv") or {}).get("match"),
            r.get("tokens_match"),
            "; ".join(r.get("errors") or [])[:200],
        ]
        rows.append(row)
    lines += ["", *md_table(HEADER.split(" | "), rows)]
    found = [
        f"- {f['model']} {f['prompt_tokens']} {f['arm']}: {f['what'][:600]}"
        for f in results.get("findings") or []
    ]
    return "\n".join(lines + ["", "## Findings", "", *(found or ["- none"])]) + "\n"


def new_results() -> dict[str, Any]:
    return {"schema": SCHEMA, "created": _dt.date.today().isoformat(), "runs": [], "rows": {}}


def write_results(results: dict[str, Any], path: Path) -> None:
    """<stem>.json, <stem>.md and, where matplotlib imports, <stem>-ttft.png and -gbps.png."""
    summarize(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_md(path.with_suffix(""), results, markdown_report(results))
    write_plots(results, path)


def write_plots(results: dict[str, Any], path: Path) -> None:
    """<stem>-ttft.png: TTFT per model and arm against prompt length; <stem>-gbps.png: each
    bounded row's bytes read per second of TTFT against its bound. Where matplotlib imports."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for model, arm in sorted({(r["model"], r["arm"]) for r in results["rows"].values()}):
        key, label = "cold_ttft_s" if arm == "cold" else "restore_ttft_s", f"{model} {arm}"
        pts = sorted(
            (r["prompt_tokens"] / 1024, r[key])
            for r in results["rows"].values()
            if (r["model"], r["arm"]) == (model, arm) and r.get(key)
        )
        if pts:
            ax.plot(*zip(*pts, strict=True), "o-" if model == MAIN_MODEL else "s:", label=label)
    ax.set(xscale="log", yscale="log", xlabel="prompt (k tokens)", ylabel="TTFT (s)")
    ax.legend(fontsize=7)
    fig.savefig(path.with_name(f"{path.stem}-ttft.png"), dpi=120, bbox_inches="tight")
    plt.close(fig)
    bounded = [r for r in sorted(results["rows"].values(), key=sort_key) if r.get("disk_bound")]
    if not bounded:
        return
    fig, ax = plt.subplots(figsize=(max(6, len(bounded)), 4.5))
    labels = [f"{r['arm']}\n{r['prompt_tokens'] // 1024}k" for r in bounded]
    got = [r["disk_bound"]["read_bytes"] / r["disk_bound"]["restore_s"] / GB for r in bounded]
    bound = [r["disk_bound"]["read_bytes"] / r["disk_bound"]["bound_s"] / GB for r in bounded]
    x = range(len(bounded))
    ax.bar([i - 0.2 for i in x], bound, 0.4, label="bound: bytes / (read + pinned H2D)")
    ax.bar([i + 0.2 for i in x], got, 0.4, label="restore: bytes read / TTFT")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set(ylabel="GB/s", title=f"{MAIN_MODEL}: L2 bytes per second of restore TTFT")
    ax.legend(fontsize=7)
    fig.savefig(path.with_name(f"{path.stem}-gbps.png"), dpi=120, bbox_inches="tight")
    plt.close(fig)
