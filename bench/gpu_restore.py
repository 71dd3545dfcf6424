"""GPU benchmark (issue 9): cold prefill vs disk-only restore after a full restart.

Reuses the restart gate (``tests/gpu/gate.py``: tiny model configs, LMCache server start
and kill, L2 inventory; ``tests/gpu/engine_proc.py``: one vLLM engine per process). Weights
are vLLM's ``load_format="dummy"`` weights (timing only: the gate checks correctness).

Steps (one record each in the results JSON, keyed by id ``kind:model:backend:arm:P``):

- ``pinned``  pinned-host H2D / D2H cudaMemcpy bandwidth (torch, 256 MiB, several reps);
- ``disk``    sequential write and read bandwidth of the L2 folder's filesystem (O_DIRECT
              read where the filesystem allows it; buffered reads after dropping the file
              from the page cache with posix_fadvise, and warm);
- ``restore`` server 1 + store engine (its first request is the cold prefill, LMCache on,
              nothing cached) -> server 1 SIGKILLed, L2 files dropped from the page cache
              -> server 2 (L1 empty) + a fresh engine: the same request restored from disk.
              TTFT = max_tokens=1 request (RequestOutput.metrics when vLLM gives them);
              L2 read rate from the server's "Prefetch request completed" line x L2 object
              size; H2D retrieve rate bounded from below by the rest of the TTFT
              (``restore_breakdown``: the "Stored/Retrieved N tokens" lines time only the
              enqueue of asynchronous copies), and measured by LMCache's own stream-timed
              copy statistics (``SERVER_STATS_ARGS``, ``parse_copy_stats``);
- ``cold``    optional (--plain-cold): the same request on an engine without LMCache;
- ``bytes``   pristine arm: store only, L2 object size per chunk.

Usage on any CUDA box::

    python3 bench/gpu_restore.py --arm patched --lmcache-dir /tmp/lmc-patched \\
        --results results/bench-gpu-DATE.json

Without a GPU: ``--report FILE`` and ``--plot-from FILE`` (needs matplotlib).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import mmap
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "gpu"))
import gate  # noqa: E402  (stdlib only; the gate's helpers)

GB = 1e9
GIB = 1 << 30
SCHEMA = "hybridfa-bench-gpu/1"

# Qwen3.5-9B-like text model (hidden 4096, 32 layers, 3 GDN : 1 FA, 16 q / 4 kv heads of
# 256, GDN 16 key / 32 value heads of 128, fp32 temporal state). Vocab is the gate's 8192
# (prompts use it), so weights are ~7.0 B parameters instead of 9 B.
QWEN35_9B = gate.ModelSpec(
    "qwen35-9b",
    "qwen3_5",
    num_kv_heads=4,
    head_dim=256,
    num_attention_heads=16,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    ssm_dtype="float32",
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=32,
)
MODELS: dict[str, gate.ModelSpec] = {
    "qwen35-r17": gate.MODELS["qwen35-r17"],
    "qwen35-9b": QWEN35_9B,
}
BIG_MODEL = "qwen35-9b"
LENGTHS = (8192, 26624, 65536, 131072)  # 8k, 26k, 64k, 128k
FA_LENGTHS = (26624, 131072)
BACKENDS = ("FLASHINFER", "FLASH_ATTN")
MAX_POSITIONS = 262144
GPU_MEMORY_UTILIZATION = {"qwen35-r17": 0.30, "qwen35-9b": 0.45}
TARGETS = {
    "ttft_speedup_26k": 10.0,
    "ttft_speedup_128k": 20.0,
    "retrieve_vs_flash_attn": 0.8,
    "retrieve_vs_pinned_h2d": 0.5,
}

# ---------------------------------------------------------------------------------------
# Geometry and byte accounting (pure)
# ---------------------------------------------------------------------------------------


def layer_counts(m: gate.ModelSpec) -> tuple[int, int]:
    """(GDN layers, FA layers) of the 3:1 pattern the gate's configs use."""
    kinds = gate._layer_types(m)
    fa = sum(k == "full_attention" for k in kinds)
    return len(kinds) - fa, fa


def backend_geometry(m: gate.ModelSpec, backend: str, tp: int = 1) -> gate.Geometry:
    """FLASHINFER: the gate's (N, page, r). FLASH_ATTN supports MultipleOf(16): same N
    (vLLM aligns to 16 either way), one kernel page per block, no subpaging."""
    g = gate.expected_geometry(m, tp)
    if backend == "FLASHINFER":
        return g
    if backend == "FLASH_ATTN":
        return gate.Geometry(g.block_size, g.block_size, 1)
    raise ValueError(f"unknown backend {backend}")


def chunk_bytes(
    m: gate.ModelSpec, chunk: int, arm: str, backend: str = "FLASHINFER", tp: int = 1
) -> dict[str, int]:
    """Bytes of one stored chunk object per rank, split FA / GDN.

    Every layer stores a full page per block (GDN pages padded to N x attention bytes per
    token); pristine 0.5.3 copies only the first kernel page of each FA block (1/r).
    """
    g = backend_geometry(m, backend, tp)
    if chunk % g.block_size:
        raise ValueError(f"chunk {chunk} is not a multiple of N={g.block_size}")
    per_tok = gate.attn_bytes_per_token(m, tp)
    n_gdn, n_fa = layer_counts(m)
    fa = n_fa * chunk * per_tok
    if arm == "pristine":
        fa //= g.ratio
    elif arm != "patched":
        raise ValueError(f"unknown arm {arm}")
    gdn = n_gdn * chunk * per_tok
    return {"fa": fa, "gdn": gdn, "total": fa + gdn}


def max_model_len(prompt_tokens: int, block: int) -> int:
    return prompt_tokens + 4 * block


def l1_size_gb(total_bytes: int) -> int:
    """LMCache L1 big enough for every chunk of the step (prefetch lands in L1)."""
    return max(4, math.ceil(1.25 * total_bytes / GB) + 2)


# ---------------------------------------------------------------------------------------
# Log parsing and throughput (pure)
# ---------------------------------------------------------------------------------------

_STORED = re.compile(r"Stored (\d+) tokens in ([0-9.]+) seconds")
_RETRIEVED = re.compile(r"Retrieved (\d+) tokens in ([0-9.]+) seconds")
_PREFETCH = re.compile(
    r"Prefetch request completed[^:]*: (\d+)/(\d+) retained keys "
    r"\((\d+) L1, (\d+) L2\) in ([0-9.]+) ms"
)


# LMCache's own copy timing (--enable-extra-logging, ExtraStatsLoggingSubscriber): bytes over
# the time between MP_*_START and MP_*_END, both published on the transfer's CUDA stream, so
# the copies themselves are timed, not their enqueue.
SERVER_STATS_ARGS = ("--enable-extra-logging", "--extra-logging-interval", "1")
_SIDE = r"ops=(\d+) tokens=(\d+) size=([0-9.]+)GB avg_copy=(?:([0-9.]+)GB/s|n/a)"
_COPY_STATS = re.compile(
    r"L0<->L1 stats \[([^\]]+)\] cumulative: store " + _SIDE + r" \| retrieve " + _SIDE
)


def parse_copy_stats(text: str) -> dict[str, Any] | None:
    """The last cumulative "L0<->L1 stats" line of a server log: per side, ops, tokens,
    GB moved and the stream-timed copy rate (GB/s; None when nothing was timed)."""
    found = _COPY_STATS.findall(text)
    if not found:
        return None
    device, *v = found[-1]

    def side(ops: str, tokens: str, size: str, rate: str) -> dict[str, Any]:
        return {
            "ops": int(ops),
            "tokens": int(tokens),
            "gb": float(size),
            "copy_gbps": float(rate) if rate else None,
        }

    return {"device": device, "store": side(*v[:4]), "retrieve": side(*v[4:])}


def timed_copy_gbps(stats: dict[str, Any] | None, side: str, tokens: int | None) -> float | None:
    """The stream-timed copy rate of one side ("retrieve" or "store"), or None unless
    the copies it timed cover at least ``tokens``: a cumulative line logged before the
    measured transfer covers only the warm-up, and says nothing about the measurement."""
    got = (stats or {}).get(side) or {}
    if not tokens or (got.get("tokens") or 0) < tokens:
        return None
    return got.get("copy_gbps")


def parse_server_log(text: str) -> dict[str, list[tuple[float, ...]]]:
    """stored/retrieved: (tokens, seconds); prefetch: (retained, asked, l1, l2, seconds)."""
    return {
        "stored": [(int(a), float(b)) for a, b in _STORED.findall(text)],
        "retrieved": [(int(a), float(b)) for a, b in _RETRIEVED.findall(text)],
        "prefetch": [
            (int(a), int(b), int(c), int(d), float(e) / 1e3)
            for a, b, c, d, e in _PREFETCH.findall(text)
        ],
    }


def gbps(nbytes: float, seconds: float) -> float | None:
    return nbytes / seconds / GB if seconds > 0 else None


def transfer_rate(lines: Sequence[tuple[float, ...]], bytes_per_token: float) -> dict[str, Any]:
    """Sum of (tokens, seconds) "Stored/Retrieved" log lines -> bytes and GB/s. The seconds
    are the enqueue of asynchronous copies, so the rate is an enqueue rate, not a transfer
    rate (kept for the record; reports use ``restore_breakdown``)."""
    tokens = sum(int(t[0]) for t in lines)
    secs = sum(float(t[1]) for t in lines)
    nbytes = tokens * bytes_per_token
    return {
        "lines": len(lines),
        "tokens": tokens,
        "seconds": round(secs, 6),
        "bytes": int(nbytes),
        "gbps": gbps(nbytes, secs),
    }


def prefetch_rate(lines: Sequence[tuple[float, ...]], object_bytes: float) -> dict[str, Any]:
    """L2 -> L1 (disk read) rate: objects read from L2 x object size / prefetch time."""
    objs = sum(int(t[3]) for t in lines)
    secs = sum(float(t[4]) for t in lines)
    return {
        "lines": len(lines),
        "l2_objects": objs,
        "seconds": round(secs, 6),
        "bytes": int(objs * object_bytes),
        "gbps": gbps(objs * object_bytes, secs),
    }


def _group_object_bytes(rec: dict[str, Any]) -> dict[str, float]:
    """Mean L2 object size per object group (the GDN-last-chunk prototype writes FA and
    GDN objects apart); empty when the record has no per-group inventory."""
    return gate.object_group_means(rec.get("l2") or {})


def chunk_object_bytes(rec: dict[str, Any]) -> float | None:
    """L2 bytes of one chunk: its one object, or the sum over its object groups."""
    sizes = _group_object_bytes(rec)
    if len(sizes) > 1:
        return sum(sizes.values())
    return (rec.get("l2") or {}).get("bytes_per_object")


def restored_bytes(rec: dict[str, Any], l2_reads: int | None) -> float | None:
    """Bytes a restore of ``hit_tokens`` reads from L2 and copies to the GPU.

    One object group: every hit chunk's object. Several (FA apart from GDN): the FA
    group's object (the size nearest the expected FA bytes) of every hit chunk, and the
    restored request's other L2 reads (``l2_reads``, from its prefetch line) at the other
    groups' mean size: GDN state for the last hit chunk only.
    """
    n, hit = rec.get("chunk"), rec.get("hit_tokens")
    if not (n and hit):
        return None
    objects = hit // n
    sizes = _group_object_bytes(rec)
    if len(sizes) <= 1:
        bpo = (rec.get("l2") or {}).get("bytes_per_object")
        return objects * bpo if bpo else None
    fa_expected = (rec.get("expected_chunk_bytes") or {}).get("fa", 0)
    fa = min(sizes, key=lambda og: abs(sizes[og] - fa_expected))
    others = [v for og, v in sizes.items() if og != fa]
    if l2_reads is None or l2_reads < objects:
        return None
    return objects * sizes[fa] + (l2_reads - objects) * sum(others) / len(others)


def restore_breakdown(rec: dict[str, Any]) -> dict[str, Any] | None:
    """Split the restore TTFT into the L2 read and what follows it.

    The server's "Retrieved/Stored N tokens in X s" lines time the enqueue of asynchronous
    copies on a CUDA stream, not the copies, so they give no throughput. The prefetch (disk
    -> L1) completes before the engine is told the hit, so the H2D retrieve happens inside
    ``restore TTFT - prefetch``: hit bytes over that window is a lower bound on the
    retrieve rate. Prefetch time is the restored request's own log line; records without
    the lines split the summed prefetch time by objects (``prefetch_exact`` false).
    """
    ttft, n, hit = rec.get("restore_ttft_s"), rec.get("chunk"), rec.get("hit_tokens")
    if not (ttft and n and hit):
        return None
    objects = hit // n
    lines = rec.get("prefetch_lines")
    if lines:
        line = max(lines, key=lambda t: (t[3], t[4]))
        prefetch_s, exact, l2_reads = float(line[4]), True, int(line[3])
    else:
        pl = rec.get("prefetch_log") or {}
        if not pl.get("l2_objects"):
            return None
        prefetch_s, exact, l2_reads = pl["seconds"] * objects / pl["l2_objects"], False, None
    hit_bytes = restored_bytes(rec, l2_reads)
    if hit_bytes is None:
        return None
    after = ttft - prefetch_s
    return {
        "hit_bytes": int(hit_bytes),
        "prefetch_s": round(prefetch_s, 4),
        "prefetch_exact": exact,
        "prefetch_gbps": gbps(hit_bytes, prefetch_s),
        "prefetch_share_of_ttft": round(prefetch_s / ttft, 4),
        "after_prefetch_s": round(after, 4),
        "retrieve_gbps_lower_bound": gbps(hit_bytes, after) if after > 0 else None,
    }


def ttft_of(engine: dict[str, Any] | None) -> float | None:
    """First-token latency from RequestOutput.metrics, else the request's wall time."""
    if not engine or not engine.get("ok"):
        return None
    met = engine.get("metrics") or {}
    v = met.get("first_token_latency")
    if isinstance(v, (int, float)) and v > 0:
        return float(v)
    return engine.get("gen_s")


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    kind: str  # pinned | disk | restore | cold | bytes
    model: str = "-"
    backend: str = "-"
    arm: str = "-"
    prompt_tokens: int = 0

    @property
    def id(self) -> str:
        if self.kind in ("pinned", "disk"):
            return self.kind
        return f"{self.kind}:{self.model}:{self.backend}:{self.arm}:{self.prompt_tokens}"

    @property
    def spec(self) -> gate.ModelSpec:
        return MODELS[self.model]


def parse_step_id(sid: str) -> Step:
    if sid in ("pinned", "disk"):
        return Step(sid)
    kind, model, backend, arm, p = sid.split(":")
    if kind not in ("restore", "cold", "bytes") or model not in MODELS or backend not in BACKENDS:
        raise ValueError(f"bad step id {sid!r}")
    return Step(kind, model, backend, arm, int(p))


def default_steps(arm: str, plain_cold: bool = False) -> list[Step]:
    if arm == "pristine":
        return [Step("bytes", m, "FLASHINFER", arm, LENGTHS[0]) for m in MODELS]
    out = [Step("pinned"), Step("disk")]
    for m in MODELS:
        out += [Step("restore", m, "FLASHINFER", arm, p) for p in LENGTHS]
    out += [Step("restore", BIG_MODEL, "FLASH_ATTN", arm, p) for p in FA_LENGTHS]
    if plain_cold:
        out += [Step("cold", m, "FLASHINFER", arm, p) for m in MODELS for p in LENGTHS]
    return out


def step_pool(arm: str) -> list[Step]:
    out = [Step("pinned"), Step("disk")]
    for kind in ("restore", "cold", "bytes"):
        out += [Step(kind, m, b, arm, p) for m in MODELS for b in BACKENDS for p in LENGTHS]
    return out


def select_steps(selector: str, arm: str, plain_cold: bool = False) -> list[Step]:
    """default | comma-separated step ids or regexes over ids (for this arm)."""
    if selector == "default":
        return default_steps(arm, plain_cold)
    pool = step_pool(arm)
    out: list[Step] = []
    for part in (p.strip() for p in selector.split(",") if p.strip()):
        hits = [s for s in pool if s.id == part] or [s for s in pool if re.fullmatch(part, s.id)]
        if not hits:
            hits = [parse_step_id(part)]
        out += [s for s in hits if s not in out]
    return out


# ---------------------------------------------------------------------------------------
# Targets and reporting (pure)
# ---------------------------------------------------------------------------------------


def _rec(results: dict[str, Any], sid: str) -> dict[str, Any] | None:
    r = results.get("records", {}).get(sid)
    return r if r and r.get("ok") else None


def _retrieve_gbps(r: dict[str, Any] | None) -> tuple[float | None, str]:
    if not r:
        return None, "-"
    timed = timed_copy_gbps(r.get("copy_stats"), "retrieve", r.get("hit_tokens"))
    if timed:
        return timed, "LMCache's stream-timed H2D copy"
    b = restore_breakdown(r)
    if b and b["retrieve_gbps_lower_bound"]:
        return b["retrieve_gbps_lower_bound"], "lower bound: hit bytes / (restore TTFT - prefetch)"
    return r.get("restore_effective_gbps"), "lower bound: hit bytes / restore TTFT"


def page_cache_state(rec: dict[str, Any]) -> str:
    """Whether the restore read its L2 files from disk ("dropped") or the page cache ("kept")."""
    pc = rec.get("page_cache")
    if not pc:
        return "-"
    return "dropped" if pc.get("dropped") else "kept"


def evaluate_targets(results: dict[str, Any], arm: str = "patched") -> list[dict[str, Any]]:
    """The four issue-9 targets; value None (not measured) counts as missed."""
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, need: float, detail: str) -> None:
        out.append(
            {
                "target": name,
                "value": value,
                "threshold": need,
                "met": value is not None and value >= need,
                "detail": detail,
            }
        )

    for label, p in (("26k", 26624), ("128k", 131072)):
        r = _rec(results, f"restore:{BIG_MODEL}:FLASHINFER:{arm}:{p}")
        kept = bool(r) and page_cache_state(r) == "kept"
        add(
            f"ttft_speedup_{label}",
            r.get("speedup_ttft") if r else None,
            TARGETS[f"ttft_speedup_{label}"],
            f"{BIG_MODEL} FlashInfer, P={p}: cold TTFT / restore TTFT"
            + (
                ", L2 files left in the page cache (a same-host restart, not a disk read)"
                if kept
                else ""
            ),
        )
    fi_len = [
        p
        for p in LENGTHS
        if _rec(results, f"restore:{BIG_MODEL}:FLASHINFER:{arm}:{p}")
        and _rec(results, f"restore:{BIG_MODEL}:FLASH_ATTN:{arm}:{p}")
    ]
    if fi_len:
        p = max(fi_len)
        a, src = _retrieve_gbps(_rec(results, f"restore:{BIG_MODEL}:FLASHINFER:{arm}:{p}"))
        b, _ = _retrieve_gbps(_rec(results, f"restore:{BIG_MODEL}:FLASH_ATTN:{arm}:{p}"))
        add(
            "retrieve_vs_flash_attn",
            ratio(a, b),
            TARGETS["retrieve_vs_flash_attn"],
            f"P={p}, FlashInfer (subpaged) / FLASH_ATTN retrieve GB/s ({src})",
        )
    else:
        add(
            "retrieve_vs_flash_attn",
            None,
            TARGETS["retrieve_vs_flash_attn"],
            "needs FLASHINFER and FLASH_ATTN restore at one length",
        )
    fi = [p for p in LENGTHS if _rec(results, f"restore:{BIG_MODEL}:FLASHINFER:{arm}:{p}")]
    pinned = _rec(results, "pinned")
    h2d = pinned.get("h2d_gbps") if pinned else None
    if fi:
        p = max(fi)
        a, src = _retrieve_gbps(_rec(results, f"restore:{BIG_MODEL}:FLASHINFER:{arm}:{p}"))
        add(
            "retrieve_vs_pinned_h2d",
            ratio(a, h2d),
            TARGETS["retrieve_vs_pinned_h2d"],
            f"P={p}, retrieve GB/s ({src}) / pinned H2D {h2d and round(h2d, 1)} GB/s",
        )
    else:
        add(
            "retrieve_vs_pinned_h2d",
            None,
            TARGETS["retrieve_vs_pinned_h2d"],
            "needs a FLASHINFER restore of the 9B-class model",
        )
    return out


_f = gate.fmt


def markdown_report(results: dict[str, Any]) -> str:
    recs = results.get("records", {})
    runs = results.get("runs", [])
    last = runs[-1] if runs else {}
    lines = [
        f"# GPU restore benchmark ({results.get('created', '?')})",
        "",
        f"- hardware: {last.get('hardware')}",
        f"- versions: {last.get('versions')}",
        f"- extra server args: {last.get('server_args') or 'none'}",
        f"- L2 filesystem: {last.get('l2_fs')}",
        f"- invocations: {len(runs)}; records: {len(recs)} "
        f"({sum(1 for r in recs.values() if not r.get('ok'))} failed)",
        "",
    ]
    pin, disk = recs.get("pinned") or {}, recs.get("disk") or {}
    lines += [
        "## Physical limits",
        "",
        "| pinned H2D GB/s | pinned D2H GB/s | disk write GB/s | disk read GB/s (O_DIRECT) "
        "| disk read GB/s (after fadvise) | page-cache read GB/s |",
        "|---|---|---|---|---|---|",
        f"| {_f(pin.get('h2d_gbps'))} | {_f(pin.get('d2h_gbps'))} | {_f(disk.get('write_gbps'))} "
        f"| {_f((disk.get('direct_read') or {}).get('gbps'))} "
        f"| {_f((disk.get('cold_read') or {}).get('gbps'))} "
        f"| {_f((disk.get('warm_read') or {}).get('gbps'))} |",
        "",
        "## TTFT: cold prefill vs disk-only restore after a full restart",
        "",
        "| model | backend | N/page/r | prompt | hit % | cold TTFT s | restore TTFT s | speedup "
        "| cold request s | restore request s | restart-to-first-token s | L2 page cache |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [r for r in recs.values() if r.get("kind") == "restore"]
    rows.sort(key=lambda r: (r["model"], r["backend"], r["prompt_tokens"]))
    for r in rows:
        g = r.get("geometry", {})
        lines.append(
            f"| {r['model']} | {r['backend']} | {g.get('block_size')}/{g.get('kernel_page')}/"
            f"{g.get('ratio')} | {r['prompt_tokens']} | {_f(r.get('hit_pct'))} "
            f"| {_f(r.get('cold_ttft_s'))} | {_f(r.get('restore_ttft_s'))} "
            f"| {_f(r.get('speedup_ttft'))} | {_f(r.get('cold_request_s'))} "
            f"| {_f(r.get('restore_request_s'))} | {_f(r.get('restart_to_first_token_s'))} "
            f"| {page_cache_state(r)} |"
            + ("" if r.get("ok") else f" ERROR: {'; '.join(r.get('errors', []))[:200]}")
        )
    colds = [r for r in recs.values() if r.get("kind") == "cold" and r.get("ok")]
    if colds:
        lines += ["", "Plain cold (engine without LMCache):", ""]
        lines += [
            f"- {r['model']} {r['backend']} P={r['prompt_tokens']}: "
            f"TTFT {_f(r.get('cold_ttft_s'))} s"
            for r in sorted(colds, key=lambda r: (r["model"], r["prompt_tokens"]))
        ]
    lines += [
        "",
        "## Where the restore time goes (GB/s = 1e9 B/s)",
        "",
        'The server\'s "Retrieved N tokens" lines time the enqueue of the asynchronous copies,',
        "not the copies, so the H2D retrieve rate is bounded from below: hit bytes / (restore",
        "TTFT - L2 prefetch). Runs since 2026-11-30 also record LMCache's own stream-timed copy",
        "rate (--enable-extra-logging: bytes between MP_RETRIEVE_START and _END on the CUDA",
        "stream; D2H for the store), over all of the server's requests.",
        "",
        "| model | backend | prompt | bytes/chunk | FA share | hit GB | L2->L1 prefetch s "
        "| prefetch GB/s | prefetch share of TTFT | after prefetch s | retrieve GB/s (lower bound) "
        "| restore effective GB/s | H2D copy GB/s (stream-timed) | D2H copy GB/s (store) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.get("ok"):
            continue
        e = r.get("expected_chunk_bytes", {})
        share = e.get("fa", 0) / e["total"] if e.get("total") else None
        b = restore_breakdown(r) or {}
        approx = "" if b.get("prefetch_exact", True) else " (split)"
        lines.append(
            f"| {r['model']} | {r['backend']} | {r['prompt_tokens']} "
            f"| {_f(chunk_object_bytes(r), 6)} | {_f(share, 2)} "
            f"| {_f(b.get('hit_bytes', 0) / GB if b else None)} "
            f"| {_f(b.get('prefetch_s'))}{approx} | {_f(b.get('prefetch_gbps'))} "
            f"| {_f(b.get('prefetch_share_of_ttft'))} | {_f(b.get('after_prefetch_s'))} "
            f"| {_f(b.get('retrieve_gbps_lower_bound'))} "
            f"| {_f(gbps(b['hit_bytes'], r['restore_ttft_s']) if b else None)} "
            f"| {_f(timed_copy_gbps(r.get('copy_stats'), 'retrieve', r.get('hit_tokens')))} "
            f"| {_f(timed_copy_gbps(r.get('store_copy_stats'), 'store', r.get('hit_tokens')))} |"
        )
    lines += [
        "",
        "## Bytes per chunk object (chunk = N), patched vs pristine",
        "",
        "| model | r | patched expected | patched L2 | pristine expected | pristine L2 "
        "| FA bytes patched | FA bytes pristine |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in MODELS.items():
        g = gate.expected_geometry(m)
        pa, pr = chunk_bytes(m, g.block_size, "patched"), chunk_bytes(m, g.block_size, "pristine")
        obs = {"patched": None, "pristine": None}
        for r in recs.values():
            if r.get("model") == name and r.get("backend") == "FLASHINFER" and r.get("ok"):
                bpo = chunk_object_bytes(r)
                if bpo and r.get("arm") in obs:
                    obs[r["arm"]] = bpo
        lines.append(
            f"| {name} | {g.ratio} | {pa['total']} | {_f(obs['patched'], 12)} | {pr['total']} "
            f"| {_f(obs['pristine'], 12)} | {pa['fa']} | {pr['fa']} |"
        )
    lines += ["", "## Targets", ""]
    for t in evaluate_targets(results):
        lines.append(
            f"- {t['target']}: {_f(t['value'])} vs >= {t['threshold']}: "
            f"{'met' if t['met'] else 'MISSED'} ({t['detail']})"
        )
    return "\n".join(lines) + "\n"


def load_results(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        data = {}
    if data.get("schema") != SCHEMA:
        data = {
            "schema": SCHEMA,
            "created": _dt.date.today().isoformat(),
            "runs": [],
            "records": {},
        }
    return data


def write_results(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    path.with_suffix(".md").write_text(markdown_report(results))


# ---------------------------------------------------------------------------------------
# Node side: probes
# ---------------------------------------------------------------------------------------

_PINNED_PROBE = r"""
import json, statistics, torch
n, reps = %d, %d
h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
d = torch.empty(n, dtype=torch.uint8, device="cuda")
def run(fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize()
        out.append(s.elapsed_time(e) / 1e3)
    return out
h2d = run(lambda: d.copy_(h, non_blocking=True))
d2h = run(lambda: h.copy_(d, non_blocking=True))
print("BENCH-PINNED " + json.dumps({"bytes": n, "reps": reps, "h2d_s": h2d, "d2h_s": d2h,
      "device": torch.cuda.get_device_name(0)}))
"""


def pinned_probe(py: str, nbytes: int = 256 << 20, reps: int = 10) -> dict[str, Any]:
    cp = subprocess.run(
        [py, "-c", _PINNED_PROBE % (nbytes, reps)], capture_output=True, text=True, timeout=300
    )
    for line in cp.stdout.splitlines():
        if line.startswith("BENCH-PINNED "):
            d = json.loads(line[len("BENCH-PINNED ") :])
            d["h2d_gbps"] = gbps(d["bytes"], statistics.median(d["h2d_s"]))
            d["d2h_gbps"] = gbps(d["bytes"], statistics.median(d["d2h_s"]))
            d["h2d_gbps_max"] = gbps(d["bytes"], min(d["h2d_s"]))
            d["d2h_gbps_max"] = gbps(d["bytes"], min(d["d2h_s"]))
            d["ok"] = True
            return d
    return {"ok": False, "errors": [(cp.stderr or cp.stdout)[-1500:]]}


def drop_from_page_cache(paths: Iterable[Path]) -> dict[str, Any]:
    """fsync + POSIX_FADV_DONTNEED per file (no root needed; no effect on tmpfs)."""
    done = failed = 0
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            failed += 1
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            done += 1
        except OSError:
            failed += 1
        finally:
            os.close(fd)
    return {"files": done, "failed": failed}


def fincore_sample(paths: Sequence[Path], n: int = 3) -> str | None:
    """Resident pages of a few files (util-linux fincore), to show the drop worked."""
    exe = shutil.which("fincore")
    if not exe or not paths:
        return None
    try:
        cp = subprocess.run([exe, *map(str, paths[:n])], capture_output=True, text=True, timeout=30)
        return (cp.stdout or cp.stderr)[-800:]
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"fincore failed: {e}"


def _read_all(fd: int, buf: mmap.mmap) -> int:
    total = 0
    while True:
        n = os.readv(fd, [buf])
        if n <= 0:
            return total
        total += n


def disk_probe(folder: Path, gib: float = 4.0, block: int = 64 << 20) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "bench-disk-probe.bin"
    count = max(1, int(gib * GIB) // block)
    data = bytes(range(256)) * (block // 256)
    res: dict[str, Any] = {"path": str(path), "bytes": count * block, "ok": True}
    try:
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            for _ in range(count):
                f.write(data)
            os.fsync(f.fileno())
        res["write_gbps"] = gbps(count * block, time.perf_counter() - t0)
        del data
        buf = mmap.mmap(-1, block)  # page aligned, as O_DIRECT needs
        drop_from_page_cache([path])
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                t0 = time.perf_counter()
                n = _read_all(fd, buf)
                res["direct_read"] = {"bytes": n, "gbps": gbps(n, time.perf_counter() - t0)}
            finally:
                os.close(fd)
        except (OSError, AttributeError) as e:
            res["direct_read"] = {"error": f"{type(e).__name__}: {e}"}
        for label, drop in (("cold_read", True), ("warm_read", False)):
            if drop:
                drop_from_page_cache([path])
            fd = os.open(path, os.O_RDONLY)
            try:
                t0 = time.perf_counter()
                n = _read_all(fd, buf)
                res[label] = {"bytes": n, "gbps": gbps(n, time.perf_counter() - t0)}
            finally:
                os.close(fd)
        buf.close()
    except OSError as e:
        res.update(ok=False, errors=[f"{type(e).__name__}: {e}"])
    finally:
        path.unlink(missing_ok=True)
    res["fs"] = filesystem_of(folder)
    return res


def filesystem_of(path: Path) -> dict[str, Any]:
    """Mount point, fs type and device of ``path`` from /proc/mounts (longest prefix)."""
    best: dict[str, Any] = {}
    p = str(Path(path).resolve())
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(
                best.get("mount", "")
            ):
                best = {"mount": mnt, "type": fstype, "device": dev}
        st = os.statvfs(p)
        best["free_gb"] = round(st.f_bavail * st.f_frsize / GB, 1)
    except OSError as e:
        best["error"] = str(e)
    return best


# ---------------------------------------------------------------------------------------
# Node side: engine steps (through the gate's server and engine_proc)
# ---------------------------------------------------------------------------------------


@dataclass
class Node:
    arm: str
    lmcache_dir: Path
    work: Path
    python: str = sys.executable
    engine_timeout: float = 560.0
    keep_page_cache: bool = False
    profile: bool = False  # torch.profiler around each restore request


def write_bench_model(m: gate.ModelSpec, root: Path) -> Path:
    """The gate's config with max_position_embeddings raised for 128k prompts."""
    cfg = gate.model_config_dict(m)
    target = cfg.get("text_config", cfg)
    target["max_position_embeddings"] = MAX_POSITIONS
    d = Path(root) / m.name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return d


def bench_engine_spec(
    step: Step, role: str, model_dir: Path, port: int | None, l2_dir: Path | None
) -> dict[str, Any]:
    m = step.spec
    g = backend_geometry(m, step.backend)
    n = g.block_size
    p = step.prompt_tokens
    prompt = gate.make_prompt(p, seed=1)
    spec: dict[str, Any] = {
        "role": role,
        "model_dir": str(model_dir),
        "language_model_only": m.family == "qwen3_5",
        "tensor_parallel_size": 1,
        "gpu_memory_utilization": GPU_MEMORY_UTILIZATION[step.model],
        "max_num_batched_tokens": 2 * n - 1,  # LMCache 0.5.3: N <= batched < 2N
        "max_model_len": max_model_len(p, n),
        "prompt": prompt,
        "warmup": gate.make_prompt(2 * n + 3, seed=2),
        "health": gate.make_prompt(3 * n + 17, seed=3),
        "prompt_key": gate.prompt_key(prompt),
        "new_tokens": 1,  # TTFT
        "top_k": None,
        "weight_seed": gate.WEIGHT_SEED,
        "weight_std": None,  # dummy weights
        "kv_hashes": False,
        "log_stats": True,
        "attention_backend": step.backend,
        "layout": "NHD",
    }
    if port is not None:
        spec["lmcache"] = {
            "module_path": gate.CONNECTOR_MODULE,
            "extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": port},
        }
    if role == "store" and l2_dir is not None:
        spec["l2"] = str(l2_dir)
        spec["l2_min_objects"] = p // n
    return spec


def _engine_summary(r: dict[str, Any] | None) -> dict[str, Any] | None:
    if r is None:
        return None
    keep = (
        "ok",
        "error",
        "engine_up_s",
        "process_s",
        "gen_s",
        "num_cached_tokens",
        "metrics",
        "cache_block_size",
        "mamba_page_size_padded",
        "l2_wait",
        "ttft_s",
        "timeline",
        "profile",
        "health",
        "rc",
        "log_facts",
    )
    return {k: r.get(k) for k in keep if k in r}


def run_cold_step(step: Step, node: Node) -> dict[str, Any]:
    wd = node.work / step.id.replace(":", "_")
    shutil.rmtree(wd, ignore_errors=True)
    wd.mkdir(parents=True)
    model_dir = write_bench_model(step.spec, node.work / "models")
    env = gate.child_env(node.lmcache_dir, "NHD")
    res = gate.run_engine(
        node.python,
        env,
        bench_engine_spec(step, "cold", model_dir, None, None),
        wd,
        "cold",
        node.engine_timeout,
    )
    return {
        "ok": bool(res.get("ok")),
        "errors": [] if res.get("ok") else [str(res.get("error"))[-1500:]],
        "cold_ttft_s": ttft_of(res),
        "cold_request_s": res.get("gen_s"),
        "engine": _engine_summary(res),
    }


def run_store_restore_step(step: Step, node: Node) -> dict[str, Any]:
    """restore: store + restart + restore. bytes: store only (L2 object size)."""
    m = step.spec
    g = backend_geometry(m, step.backend)
    n = g.block_size
    wd = node.work / step.id.replace(":", "_")
    shutil.rmtree(wd, ignore_errors=True)
    l2 = wd / "l2"
    l2.mkdir(parents=True)
    model_dir = write_bench_model(m, node.work / "models")
    env = gate.child_env(node.lmcache_dir, "NHD")
    expect = chunk_bytes(m, n, "patched" if step.arm != "pristine" else "pristine", step.backend)
    total = (step.prompt_tokens // n + 2) * expect["total"]
    l1 = l1_size_gb(total)
    rec: dict[str, Any] = {
        "geometry": asdict(g),
        "chunk": n,
        "l1_size_gb": l1,
        "expected_chunk_bytes": expect,
        "expected_pristine_chunk_bytes": chunk_bytes(m, n, "pristine", step.backend),
        "errors": [],
    }
    store = restore = None
    procs: list[subprocess.Popen[Any]] = []
    try:
        port = gate.free_port()
        srv = gate.start_server(
            node.python,
            env,
            port,
            n,
            l2,
            wd / "server1.log",
            l1_size_gb=l1,
            extra_args=SERVER_STATS_ARGS,
        )
        procs.append(srv)
        store = gate.run_engine(
            node.python,
            env,
            bench_engine_spec(step, "store", model_dir, port, l2),
            wd,
            "store",
            node.engine_timeout,
        )
        rec["l2_after_store"] = gate.wait_l2_stable(
            l2, step.prompt_tokens // n, timeout=60 + total / GB / 0.5
        )
        gate.kill_group(srv)
        log1 = (wd / "server1.log").read_text(errors="replace")
        inv = gate.l2_inventory(l2)
        bpo = inv["bytes"] / inv["objects"] if inv["objects"] else 0.0
        rec["l2"] = {**inv, "bytes_per_object": bpo}
        rec["store_log"] = transfer_rate(parse_server_log(log1)["stored"], bpo / n)
        rec["store_copy_stats"] = parse_copy_stats(log1)
        rec["cold_ttft_s"] = ttft_of(store)
        rec["cold_request_s"] = (store or {}).get("gen_s")
        if not store or not store.get("ok"):
            rec["errors"].append(f"store: {(store or {}).get('error')}"[-1500:])
        if step.kind == "restore" and store and store.get("ok"):
            files = sorted(l2.rglob("*.data"))
            if node.keep_page_cache:
                rec["page_cache"] = {"dropped": False}
            else:
                t0 = time.perf_counter()
                rec["page_cache"] = {
                    "dropped": True,
                    **drop_from_page_cache(files),
                    "drop_s": round(time.perf_counter() - t0, 2),
                    "fincore": fincore_sample(files),
                }
            t_restart = time.perf_counter()
            port = gate.free_port()
            srv = gate.start_server(
                node.python,
                env,
                port,
                n,
                l2,
                wd / "server2.log",
                l1_size_gb=l1,
                extra_args=SERVER_STATS_ARGS,
            )
            procs.append(srv)
            rec["server2_start_s"] = round(time.perf_counter() - t_restart, 2)
            restore = gate.run_engine(
                node.python,
                env,
                {
                    **bench_engine_spec(step, "restore", model_dir, port, None),
                    **({"profile_dir": str(wd / "profile")} if node.profile else {}),
                },
                wd,
                "restore",
                node.engine_timeout,
            )
            gate.kill_group(srv)
            log2 = (wd / "server2.log").read_text(errors="replace")
            parsed = parse_server_log(log2)
            rec["retrieve_log"] = transfer_rate(parsed["retrieved"], bpo / n)
            rec["prefetch_log"] = prefetch_rate(parsed["prefetch"], bpo)
            rec["prefetch_lines"] = parsed["prefetch"]
            rec["copy_stats"] = parse_copy_stats(log2)
            if not restore.get("ok"):
                rec["errors"].append(f"restore: {restore.get('error')}"[-1500:])
            hit = int(restore.get("num_cached_tokens") or 0)
            rt = ttft_of(restore)
            rec.update(
                hit_tokens=hit,
                hit_pct=round(100.0 * hit / step.prompt_tokens, 2),
                max_promisable_hit=gate.max_promisable_hit(step.prompt_tokens, n),
                restore_ttft_s=rt,
                restore_request_s=restore.get("gen_s"),
                speedup_ttft=ratio(rec["cold_ttft_s"], rt),
                speedup_request=ratio(rec["cold_request_s"], restore.get("gen_s")),
                restart_to_first_token_s=(
                    rec["server2_start_s"] + restore["engine_up_s"] + rt
                    if rt and restore.get("engine_up_s") is not None
                    else None
                ),
            )
            rec["breakdown"] = restore_breakdown(rec)
            restored = rec["breakdown"]["hit_bytes"] if rec["breakdown"] else hit * bpo / n
            rec["restore_effective_gbps"] = gbps(restored, rt) if rt else None
            rec["engine_timeline"] = restore.get("timeline")  # the engine's side of it
            if hit == 0:
                rec["errors"].append("restore: no external hit")
    except gate.ServerError as e:
        rec["errors"].append(f"server: {str(e)[-1500:]}")
    finally:
        for p in procs:
            gate.kill_group(p)
        shutil.rmtree(l2, ignore_errors=True)
    rec["engines"] = {"store": _engine_summary(store), "restore": _engine_summary(restore)}
    observed = (store or {}).get("cache_block_size")
    if observed is not None and observed != n:
        rec["errors"].append(f"vLLM chose N={observed}, expected {n}")
    rec["ok"] = not rec["errors"]
    return rec


def run_step(step: Step, node: Node, disk_gib: float) -> dict[str, Any]:
    if step.kind == "pinned":
        return pinned_probe(node.python)
    if step.kind == "disk":
        return disk_probe(node.work / "l2-fs-probe", disk_gib)
    if step.kind == "cold":
        return run_cold_step(step, node)
    return run_store_restore_step(step, node)


def run_steps(
    steps: Sequence[Step], node: Node, results_path: Path, disk_gib: float = 4.0
) -> dict[str, Any]:
    """Run every step in order and add its record to ``results_path`` (read if present, so
    that the patched and the pristine arm share one file); the file and a .md beside it are
    rewritten after each step."""
    t0 = time.monotonic()
    node.work.mkdir(parents=True, exist_ok=True)
    results = load_results(results_path)
    envinfo = gate.collect_environment(node.python, node.lmcache_dir)
    run: dict[str, Any] = {
        "started": _dt.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "arm": node.arm,
        "lmcache_dir": str(node.lmcache_dir),
        **envinfo,
        "l2_fs": filesystem_of(node.work),
        "done": [],
    }
    results["runs"].append(run)
    problem = gate.arm_problem(node.arm, envinfo["versions"], node.lmcache_dir)
    if problem:
        run["error"] = problem
        write_results(results, results_path)
        return results
    for s in steps:
        print(f"[bench] {s.id}: starting", flush=True)
        ts = time.monotonic()
        rec = run_step(s, node, disk_gib)
        took = time.monotonic() - ts
        rec.update(
            id=s.id,
            kind=s.kind,
            model=s.model,
            backend=s.backend,
            arm=s.arm,
            prompt_tokens=s.prompt_tokens,
            step_s=round(took, 1),
            finished=_dt.datetime.now().isoformat(timespec="seconds"),
        )
        results["records"][s.id] = rec
        run["done"].append(s.id)
        run["elapsed_s"] = round(time.monotonic() - t0, 1)
        write_results(results, results_path)
        keys = ("ok", "speedup_ttft", "cold_ttft_s", "restore_ttft_s", "h2d_gbps", "write_gbps")
        brief = {k: rec[k] for k in keys if rec.get(k) is not None}
        print(f"[bench] {s.id}: {took:.0f} s {brief} {rec.get('errors') or ''}", flush=True)
    return results


# ---------------------------------------------------------------------------------------
# Plots (CPU machine)
# ---------------------------------------------------------------------------------------


def plot_from(path: Path, out_dir: Path | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = load_results(path)
    recs = [r for r in results["records"].values() if r.get("ok")]
    out_dir = out_dir or path.parent
    stem = path.stem
    written: list[Path] = []
    restores = [r for r in recs if r["kind"] == "restore" and r["backend"] == "FLASHINFER"]
    models = sorted({r["model"] for r in restores})
    if models:
        fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
        for ax, name in zip(axes[0], models, strict=True):
            rows = sorted(
                (r for r in restores if r["model"] == name), key=lambda r: r["prompt_tokens"]
            )
            x = [r["prompt_tokens"] / 1024 for r in rows]
            ax.plot(x, [r.get("cold_ttft_s") for r in rows], "o-", label="cold prefill")
            ax.plot(x, [r.get("restore_ttft_s") for r in rows], "s-", label="restore from disk")
            for xi, r in zip(x, rows, strict=True):
                if r.get("speedup_ttft"):
                    ax.annotate(
                        f"{r['speedup_ttft']:.1f}x",
                        (xi, r["restore_ttft_s"]),
                        textcoords="offset points",
                        xytext=(0, -14),
                        ha="center",
                    )
            ax.set(
                xscale="log",
                yscale="log",
                xlabel="prompt tokens (k)",
                ylabel="TTFT (s)",
                title=f"{name} (FlashInfer)",
            )
            ax.minorticks_off()
            ax.set_xticks(x, [f"{v:g}" for v in x])
            ax.legend()
        fig.tight_layout()
        p = out_dir / f"{stem}-ttft.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        written.append(p)
    rows = sorted(
        (r for r in recs if r["kind"] == "restore"),
        key=lambda r: (r["model"], r["backend"], r["prompt_tokens"]),
    )
    if rows:
        fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(rows)), 5))
        series = (
            ("L2->L1 prefetch", "prefetch_gbps"),
            ("retrieve (lower bound)", "retrieve_gbps_lower_bound"),
        )
        w = 0.8 / len(series)
        for k, (label, key) in enumerate(series):
            vals = [(restore_breakdown(r) or {}).get(key) or math.nan for r in rows]
            ax.bar([i + k * w for i in range(len(rows))], vals, w, label=label)
        limits = results["records"]
        for label, v, style, va in (
            ("pinned H2D", (limits.get("pinned") or {}).get("h2d_gbps"), "--", "top"),
            ("pinned D2H", (limits.get("pinned") or {}).get("d2h_gbps"), ":", "bottom"),
            (
                "disk read",
                ((limits.get("disk") or {}).get("direct_read") or {}).get("gbps")
                or ((limits.get("disk") or {}).get("cold_read") or {}).get("gbps"),
                "-.",
                "bottom",
            ),
        ):
            if v:
                ax.axhline(v, linestyle=style, color="k", linewidth=1)
                ax.annotate(f"{label} {v:.1f}", (len(rows) - 0.5, v), ha="right", va=va)
        ax.set_xticks(
            [i + w for i in range(len(rows))],
            [f"{r['model']}\n{r['backend']}\n{r['prompt_tokens'] // 1024}k" for r in rows],
            fontsize=7,
        )
        ax.set(yscale="log", ylabel="GB/s", title="FA+GDN bytes moved vs physical limits")
        ax.legend()
        fig.tight_layout()
        p = out_dir / f"{stem}-throughput.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        written.append(p)
    return written


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", choices=("patched", "pristine"), default="patched")
    ap.add_argument("--lmcache-dir", type=Path, help="lmcache under test (first on PYTHONPATH)")
    ap.add_argument(
        "--results",
        type=Path,
        default=REPO / "results" / f"bench-gpu-{_dt.date.today().isoformat()}.json",
        help="results JSON, read if present and updated after every step (a .md beside it)",
    )
    ap.add_argument("--steps", default="default", help="default | comma-separated ids/regexes")
    ap.add_argument("--plain-cold", action="store_true", help="add cold runs without LMCache")
    ap.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/hybridfa-bench"),
        help="models, logs and the L2 folder (its filesystem is the one measured)",
    )
    ap.add_argument("--disk-probe-gib", type=float, default=4.0)
    ap.add_argument(
        "--keep-page-cache",
        action="store_true",
        help="do not drop the L2 files from the page cache before the restore",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="torch.profiler around each restore request (trace and op tables in the step folder)",
    )
    ap.add_argument("--report", type=Path, help="print the markdown report and targets of FILE")
    ap.add_argument("--plot-from", type=Path, help="write PNG plots for FILE (needs matplotlib)")
    a = ap.parse_args(argv)
    if a.report:
        res = load_results(a.report)
        print(markdown_report(res))
        return 0 if all(t["met"] for t in evaluate_targets(res)) else 1
    if a.plot_from:
        for p in plot_from(a.plot_from):
            print(p)
        return 0
    if a.lmcache_dir is None:
        ap.error("--lmcache-dir is required to run steps")
    steps = select_steps(a.steps, a.arm, a.plain_cold)
    node = Node(
        arm=a.arm,
        lmcache_dir=a.lmcache_dir.resolve(),
        work=a.work,
        keep_page_cache=a.keep_page_cache,
        profile=a.profile,
    )
    gate.install_cleanup_handler()
    res = run_steps(steps, node, a.results, a.disk_probe_gib)
    run = res["runs"][-1]
    if run.get("error"):
        print(f"bench: {run['error']}", file=sys.stderr)
        return 2
    print(markdown_report(res))
    for t in evaluate_targets(res):
        print(
            f"TARGET {t['target']}: {_f(t['value'])} >= {t['threshold']}: "
            f"{'met' if t['met'] else 'missed'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
