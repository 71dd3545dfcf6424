"""GPU benchmark: restore TTFT after a restart, every arm side by side on one machine:
cold, default, pagecache, offloading, lmcache056 (bench/README.md). Engines are the restart
gate's (hybridfa_gate.engine_proc processes started by hybridfa_gate.procs); the results (JSON,
markdown) are rewritten after every measured step. Run from the checkout root:
``python -m bench.gpu_restore --lmcache-dir ...``."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import mmap
import os
import re
import shutil
import subprocess
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import fs_l2_read  # stdlib only at import: its page-cache functions
from hybridfa_gate import l2 as l2_tiers
from hybridfa_gate.judge import compare_kv_hashes, connector_hit
from hybridfa_gate.models import (
    MODELS as GATE_MODELS,
)
from hybridfa_gate.models import (
    ModelSpec,
    atomic_write,
    attn_bytes_per_token,
    expected_chunk_bytes,
    expected_geometry,
    layer_types,
    write_model_dir,
)
from hybridfa_gate.procs import (
    ServerError,
    child_env,
    free_port,
    install_cleanup_handler,
    kill_group,
    run_engine,
    start_server,
    wait_l2_stable,
)
from hybridfa_gate.prompts import make_prompt, median, required_hit
from hybridfa_gate.report import fmt, md_table, write_json_md
from hybridfa_gate.run import arm_problem, collect_environment
from hybridfa_gate.specs import WEIGHT_STD, base_spec

REPO = Path(__file__).resolve().parent.parent
GB, GIB = 1e9, 1 << 30
SCHEMA = "hybridfa-bench-gpu/2"
# Qwen3.5-9B-like text model: hidden 4096, 32 layers (24 GDN + 8 FA), 16 q / 4 kv heads of 256,
# GDN 16 key / 32 value heads of 128, fp32 state; the gate's vocab (8192), so ~7.0 B params.
QWEN35_9B = ModelSpec(
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
MODELS = {"qwen35-9b": QWEN35_9B, "qwen35-r17": GATE_MODELS["qwen35-r17"]}
# gpu_memory_utilization, weight_std (None: vLLM's dummy weights, timing only) per model
ENGINE = {"qwen35-9b": (0.45, None), "qwen35-r17": (0.30, WEIGHT_STD)}
LENGTHS = {"8k": 8192, "26k": 26624, "64k": 65536, "128k": 131072}
DEFAULT_CASES = "qwen35-9b:8k,qwen35-9b:26k,qwen35-9b:64k,qwen35-9b:128k,qwen35-r17:26k"
ARMS = ("cold", "default", "pagecache", "offloading", "lmcache056")
MAIN_MODEL = "qwen35-9b"  # drawn with solid lines
RESTORES, NEW_TOKENS, MAX_POSITIONS, WARM_BLOCKS = 3, 8, 262144, 16
SERVER_STATS_ARGS = ("--enable-extra-logging", "--extra-logging-interval", "0.25")
MIN_ENGINE_S = 90.0  # no engine is started with less of --time-limit-s left
DISK_MARGIN = 1.15


class StepError(RuntimeError):
    pass


class Skipped(StepError):
    """An environment limit (--time-limit-s, disk, /dev/shm, no install): no result."""


def block(m: ModelSpec) -> int:
    return expected_geometry(m).block_size


def prompt_bytes(m: ModelSpec, p: int) -> int:
    """What storing a prompt writes (chunk N, either connector): every layer of every block."""
    return (p // block(m)) * expected_chunk_bytes(m, block(m))


def prompt(p: int, tag: str) -> list[int]:
    """One prompt per (tag, length); no two share a prefix."""
    return make_prompt(p, seed=zlib.crc32(f"{tag}:{p}".encode()))


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


def engine_spec(
    m: ModelSpec, p: int, role: str, model_dir: Path, conn: Any = None, cold: str = ""
) -> dict[str, Any]:
    """base_spec; ``conn``: {"lmcache": port} or {"kv_transfer_config": ...}. store: A
    (KV hashed), W (short), B, D. restore: warm-up (cold prefill if ``cold``, W), A (KV hashed),
    B, D, each then followed by a cold prefill of a ``cold`` prompt if ``cold``."""
    n, a, (util, std), conn = block(m), prompt(p, "A"), ENGINE[m.name], conn or {}
    w = prompt(min(p, WARM_BLOCKS * n + n // 2), "W")
    spec = base_spec(m, n, role, model_dir, a, conn.get("lmcache"))
    spec.update(
        gpu_memory_utilization=util,
        weight_std=std,
        new_tokens=NEW_TOKENS,
        top_k=None,
        kv_hashes=role != "cold",
        log_stats=True,
    )
    if "kv_transfer_config" in conn:
        spec["kv_transfer_config"] = conn["kv_transfer_config"]
    if role == "store":
        spec["also_store"] = [w, prompt(p, "B"), prompt(p, "D")]
    elif role == "restore":
        colds = [{"cold": prompt(p, f"{cold}-{i}")} if cold else {} for i in range(RESTORES + 1)]
        spec["warm_first"] = {**colds[0], "restore": w}
        spec["cold_reference"] = colds[1].get("cold")
        pairs = ((2, "B"), (3, "D"))
        spec["timed_pairs"] = [{"restore": prompt(p, t), **colds[i]} for i, t in pairs]
    return spec


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


def engine_summary(r: dict[str, Any] | None) -> dict[str, Any] | None:
    keep = ("ok", "error", "engine_up_s", "process_s", "cache_block_size", "rc", "idle")
    return {k: str(r[k])[-1500:] if k == "error" else r[k] for k in keep if k in r} if r else None


def finding(row: dict[str, Any], what: str) -> None:
    row["findings"].append({k: row[k] for k in ("model", "prompt_tokens", "arm")} | {"what": what})


def failed(row: dict[str, Any], why: str, blame: bool = True) -> None:
    """An error; for a peer (not this wheel) that failed, also the finding that it did not run."""
    row["errors"].append(why[-1500:])
    if blame and row["arm"] in ("offloading", "lmcache056"):
        finding(row, f"did not run: {why[-600:]}")


def fill_restore_row(row: dict[str, Any], m: ModelSpec, store: Any, res: Any, ctx: Any) -> Any:
    """A restore engine's timed restores and colds (its measured request, cold_reference and
    timed_pairs), KV bytes and tokens against the store engine's, findings. ``ctx``: the server
    log's windows and prefetch lines, the L2 groups' sizes (LMCache); {}: /proc/self/io."""
    n, p = block(m), row["prompt_tokens"]
    row["engines"] = {"store": engine_summary(store), "restore": engine_summary(res)}
    if not res.get("ok"):
        return failed(row, f"restore engine: {res.get('error')}")
    reqs = [("restore", res), ("cold", res.get("cold_reference"))]
    reqs += [(k, v) for pair in res.get("timed_pairs") or [] for k, v in pair.items()]
    restores = [s for k, s in reqs if k == "restore"]
    warm = [w] if (w := (res.get("warm_first") or {}).get("restore")) else []
    spans = [tuple(s.get("probe") or ({}, {})) for s in warm + restores]
    hits = [connector_hit(s)[0] for s in warm + restores]
    rates = [None] * len(restores)  # the OffloadingConnector's timed loads reach no log of ours
    if ctx:
        epochs = [(a["epoch"], b["epoch"]) if a else None for a, b in spans]
        rates = timed_h2d(ctx["windows"], list(zip(epochs, hits, strict=True)))[len(warm) :]
    fa = layer_types(m).count("full_attention") * n * attn_bytes_per_token(m)
    row["restores"], hits = [], hits[len(warm) :]
    for s, hit, h2d, (a, b) in zip(restores, hits, rates, spans[len(warm) :], strict=True):
        got: dict[str, Any] = {"ttft_s": s.get("ttft_s"), "hit_tokens": hit, "h2d_gbps": h2d}
        if ctx:
            inside = [x["l2"] for x in ctx["prefetch"] if a and a["epoch"] <= x["t"] <= b["epoch"]]
            got["l2_objects"] = sum(inside)
            got["read_bytes"] = l2_read_bytes(sum(inside), hit, n, ctx["groups"], fa)
        elif a.get("read_bytes") is not None and b.get("read_bytes") is not None:
            got["read_bytes"] = b["read_bytes"] - a["read_bytes"]  # the engine's /proc/self/io
        row["restores"].append(got)
    colds = [s["ttft_s"] for k, s in reqs if k == "cold" and s and not s.get("num_cached_tokens")]
    row.update(
        restore_ttft_s=median([r["ttft_s"] for r in row["restores"] if r["hit_tokens"]]),
        read_bytes=median([r.get("read_bytes") for r in row["restores"]]),
        h2d_gbps=median(rates),
        h2d_timed=sum(r is not None for r in rates),
        cold_in_engine_ttfts_s=colds,
        cold_in_engine_s=median(colds),
        hit_tokens=hits[0],
        required_hit=required_hit(p, n),
    )
    kv = compare_kv_hashes(store.get("kv_hashes"), res.get("kv_hashes"), hits[0])
    row["kv"] = {**kv, "mismatches": kv["mismatches"][:4]}
    row["tokens_match"] = store.get("tokens") == res.get("tokens")
    before = len(row["findings"])
    if not all(hits):
        finding(row, f"restored nothing after the restart (the timed restores' hits: {hits})")
    elif hits[0] < row["required_hit"]:
        finding(row, f"restored {hits[0]} of {p} tokens, less than {row['required_hit']}")
    if not kv["match"]:
        finding(row, f"KV bytes differ from the storing engine's: {row['kv']}")
    if not row["tokens_match"]:
        finding(row, f"greedy tokens {res.get('tokens')} vs stored {store.get('tokens')}")
    row["correct"] = len(row["findings"]) == before


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


_PINNED_PROBE = r"""
import json, torch
n, out = 256 << 20, []
h = torch.empty(n, dtype=torch.uint8).pin_memory()
d = torch.empty(n, dtype=torch.uint8, device="cuda")
for i in range(13):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); d.copy_(h, non_blocking=True); e.record(); e.synchronize()
    out.append(s.elapsed_time(e) / 1e3)
print("BENCH-PINNED " + json.dumps({"bytes": n, "h2d_s": out[3:]}))
"""


def pinned_probe(py: str) -> dict[str, Any]:
    """Pinned host -> GPU copy rate: 256 MiB, median of 10 after 3 warm-ups."""
    cp = subprocess.run([py, "-c", _PINNED_PROBE], capture_output=True, text=True, timeout=300)
    for line in cp.stdout.splitlines():
        if line.startswith("BENCH-PINNED "):
            d = json.loads(line.split(" ", 1)[1])
            return {**d, "h2d_gbps": d["bytes"] / median(d["h2d_s"]) / GB}
    return {"error": (cp.stderr or cp.stdout)[-1500:]}


def disk_probe(folder: Path, gib: float = 4.0, chunk: int = 64 << 20) -> dict[str, Any]:
    """Write ``gib`` (fsync), read it with O_DIRECT, buffered after DONTNEED, then cached."""
    folder.mkdir(parents=True, exist_ok=True)
    path, count = folder / "bench-disk-probe.bin", max(1, int(gib * GIB) // chunk)
    res: dict[str, Any] = {"bytes": count * chunk}
    buf, t0 = mmap.mmap(-1, chunk), time.perf_counter()  # page aligned, as O_DIRECT needs
    try:
        with open(path, "wb", buffering=0) as f:
            for _ in range(count):
                f.write(bytes(range(256)) * (chunk // 256))
            os.fsync(f.fileno())
        res["write_gbps"] = count * chunk / (time.perf_counter() - t0) / GB
        for label, flags in (("direct_read", os.O_DIRECT), ("cold_read", 0), ("warm_read", 0)):
            if label != "warm_read":
                fs_l2_read.drop_cache([path])
            try:
                with open(os.open(path, os.O_RDONLY | flags), "rb", buffering=0) as f:
                    t0, n = time.perf_counter(), 0
                    while k := f.readinto(buf):
                        n += k
                res[label] = n / (time.perf_counter() - t0) / GB
            except OSError as e:
                res[label], res[f"{label}_error"] = None, f"{type(e).__name__}: {e}"
    finally:
        path.unlink(missing_ok=True)
    return res


def resident(paths: Sequence[Path]) -> float | None:
    """Share of the files' bytes in the page cache (util-linux fincore; None without it)."""
    if not (exe := shutil.which("fincore")) or not paths:
        return None
    out = subprocess.run([exe, "-bnr", "-o", "RES,SIZE", *map(str, paths)], capture_output=True)
    got = [line.split() for line in out.stdout.decode().splitlines()]
    size = sum(int(s) for _, s in got)
    return sum(int(r) for r, _ in got) / size if size else None


class Bench:
    """One invocation's phases; each row it measures is written at once."""

    def __init__(self, a: argparse.Namespace, results: dict[str, Any]) -> None:
        self.a, self.results, self.py, self.rates = a, results, sys.executable, {}
        self.end = time.monotonic() + a.time_limit_s if a.time_limit_s else math.inf

    def save(self) -> None:
        write_results(self.results, self.a.results)

    def row(self, m: ModelSpec, p: int, arm: str) -> dict[str, Any]:
        r = {
            "model": m.name,
            "prompt_tokens": p,
            "arm": arm,
            "rates": self.rates,
            "errors": [],
            "findings": [],
            "geometry": vars(expected_geometry(m)),
        }
        self.results["rows"][row_key(m.name, p, arm)] = r
        return r

    def setup(self, name: str, m: ModelSpec, lmc: Path | None, layout: str) -> Any:
        """A fresh work folder, the model folder (positions raised for 128k), the engines' env."""
        shutil.rmtree(wd := self.a.work / name, ignore_errors=True)
        wd.mkdir(parents=True)
        md = write_model_dir(m, self.a.work / "models")
        cfg = json.loads((md / "config.json").read_text())
        cfg.get("text_config", cfg)["max_position_embeddings"] = MAX_POSITIONS
        atomic_write(md / "config.json", json.dumps(cfg) + "\n")
        env = child_env(lmc, layout)
        env["PYTHONHASHSEED"] = "0"  # vLLM's block hashes name the OffloadingConnector's files
        return wd, md, env

    def engine(self, env: dict[str, str], spec: dict[str, Any], wd: Path, role: str) -> Any:
        left = self.end - time.monotonic()
        if left < MIN_ENGINE_S:
            raise Skipped(f"not run: {max(left, 0):.0f} s of --time-limit-s left for {role}")
        print(f"[bench] {wd.name}: {role} engine", flush=True)
        return run_engine(self.py, env, spec, wd, role, min(self.a.engine_timeout, left))

    def colds_fit(self, m: ModelSpec, p: int, engines: int) -> bool:
        """Whether restore engines also time (so store) colds: where L2 has room for them."""
        stored = 3 * prompt_bytes(m, p) + prompt_bytes(m, min(p, WARM_BLOCKS * block(m)))
        if (free := shutil.disk_usage(self.a.work).free) < DISK_MARGIN * stored:
            raise Skipped(f"L2 needs {DISK_MARGIN * stored / GB:.0f} GB, {free / GB:.0f} free")
        return free >= DISK_MARGIN * (stored + engines * (RESTORES + 1) * prompt_bytes(m, p))

    def cold_phase(self, m: ModelSpec, lengths: Sequence[int]) -> None:
        """One engine, no connector, all lengths: per length a warm-up c0, RESTORES timed."""
        rows = {p: self.row(m, p, "cold") for p in lengths}
        try:
            wd, md, env = self.setup(f"{m.name}-cold", m, None, "NHD")
            spec = {**engine_spec(m, max(lengths), "cold", md), "prompt": prompt(999, "cold")}
            spec["timed_pairs"] = [
                {f"c{i}": prompt(p, f"cold-{i}") for i in range(RESTORES + 1)} for p in lengths
            ]
            res = self.engine(env, spec, wd, "cold")
            if not res.get("ok"):
                raise StepError(f"cold engine: {str(res.get('error'))[-1500:]}")
            for p, pair in zip(lengths, res.get("timed_pairs") or [], strict=False):
                colds = [pair[f"c{i}"] for i in range(1, RESTORES + 1)]
                ttfts = [c["ttft_s"] for c in colds if not c.get("num_cached_tokens")]
                rows[p].update(cold_ttfts_s=ttfts, cold_ttft_s=median(ttfts))
        except StepError as e:
            for r in rows.values():
                r["errors"].append(str(e))
        for r in rows.values():
            r["ok"] = not r["errors"] and len(r.get("cold_ttfts_s") or []) == RESTORES
        self.save()

    def restore_phase(self, m: ModelSpec, p: int, arms: Sequence[str], lmc: Any = None) -> Any:
        """Store once, then per arm restart and restore: LMCache server and engine (pagecache
        first, the files still cached); the OffloadingConnector (arms == ["offloading"]) engine."""
        rows, procs, offload = {a: self.row(m, p, a) for a in arms}, [], arms == ["offloading"]
        name, pb = f"{m.name}-{p}-{'-'.join(arms)}", prompt_bytes(m, p)
        wd, md, env = self.setup(name, m, lmc, "HND" if offload else "NHD")
        tier, ids = wd / "tier", [f"hybridfa-bench-{os.getpid()}-{name}-{r}" for r in ("s", *arms)]
        shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
        cpu = int(min(max(4 * GIB, 2 * pb), 0.8 * shm))  # the OffloadingConnector's CPU tier

        def connector(eid: str, log: Path) -> dict[str, Any]:
            if offload:
                return {"kv_transfer_config": offloading_transfer_config(tier, cpu, eid)}
            port, l1 = free_port(), max(4, math.ceil(2.5 * pb / GB) + 2)
            args = (self.py, env, port, block(m), tier, log)
            procs.append(start_server(*args, l1_size_gb=l1, extra_args=SERVER_STATS_ARGS))
            return {"lmcache": port}

        try:
            if offload and cpu < pb:
                raise Skipped(f"/dev/shm has no room for a {pb / GB:.1f} GB CPU tier")
            if lmc and not (Path(lmc) / "lmcache").is_dir():
                raise Skipped(f"no lmcache installed in {lmc}")
            tier.mkdir()
            with_colds, log = self.colds_fit(m, p, len(arms)), wd / "server-store.log"
            spec = engine_spec(m, p, "store", md, connector(ids[0], log))
            lmc_store = {"l2": str(tier), "l2_min_objects": p // block(m), "server_log": str(log)}
            spec.update({"step_until_idle_s": 600} if offload else lmc_store)
            store = self.engine(env, spec, wd, "store")
            if not offload:
                wait_l2_stable(tier, 3 * (p // block(m)), timeout=60 + 8 * pb / GB)
                kill_group(procs.pop())
            if not store.get("ok") or (offload and not store.get("idle")):
                tail = str(store.get("error"))[-1500:]
                raise StepError(f"store engine (idle: {store.get('idle')}): {tail}")
            files = sorted(tier.rglob("*.bin" if offload else "*.data"))
            inv = {"files": len(files), "bytes": sum(f.stat().st_size for f in files)}
            if not offload:
                inv = l2_tiers.folder_inventory(tier)
            for arm, eid in zip(arms, ids[1:], strict=True):
                if arm != "pagecache":
                    fs_l2_read.drop_cache(files)
                cache = {"dropped": arm != "pagecache", "resident_fraction": resident(files)}
                rows[arm].update(tier_after_store=inv, colds_in_engine=with_colds, page_cache=cache)
                if offload:  # "cannot store chunks": its CPU tier had no room for a store
                    full = (wd / "store.log").read_text(errors="replace").count("cannot store")
                    rows[arm].update(cpu_bytes_to_use=cpu, store_allocation_failures=full)
                conn = connector(eid, log := wd / f"server-{arm}.log")
                spec = engine_spec(m, p, "restore", md, conn, f"cold-{arm}" if with_colds else "")
                res, ctx = self.engine(env, spec, wd, f"restore-{arm}"), {}
                if not offload:
                    kill_group(procs.pop())
                    ctx = parse_server_log(log.read_text(errors="replace"))
                    ctx["groups"] = object_group_means(inv)
                fill_restore_row(rows[arm], m, store, res, ctx)
                rows[arm]["ok"] = not rows[arm]["errors"]
                self.save()
        except (StepError, ServerError, OSError) as e:
            for row in (r for r in rows.values() if "ok" not in r):
                failed(row, str(e), not isinstance(e, (Skipped, OSError)))
        finally:
            for proc in procs:
                kill_group(proc)
            for leftover in (f for i in ids for f in Path("/dev/shm").glob(f"vllm_offload_{i}*")):
                leftover.unlink(missing_ok=True)
            shutil.rmtree(tier, ignore_errors=True)
        for row in rows.values():
            row["ok"] = not row["errors"]
        self.save()


def run(a: argparse.Namespace) -> int | str:
    results, arms = new_results(), a.arms.split(",")
    if a.resume and a.results.exists():
        results = json.loads(a.results.read_text())
    done = {k for k, r in results["rows"].items() if r.get("ok")}  # --resume keeps these
    parts = (c.strip().partition(":") for c in a.cases.split(",") if c.strip())
    cases = list(dict.fromkeys((m, LENGTHS.get(x) or int(x)) for m, _, x in parts))  # in order
    if unknown := {model for model, _ in cases} - set(MODELS):
        return f"bench: unknown model {unknown}; one of {', '.join(MODELS)}"
    bench = Bench(a, results)  # --time-limit-s counts from here
    install_cleanup_handler()
    a.work.mkdir(parents=True, exist_ok=True)
    envinfo = collect_environment(sys.executable, a.lmcache_dir)
    info = {
        "started": _dt.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        **envinfo,
        "PYTHONHASHSEED": "0",
        "l2_fs": fs_l2_read.machine(a.work.resolve()),
        "dev_shm_gb": os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free / GB,
    }
    results["runs"].append(info)
    problem = arm_problem("patched", envinfo["versions"], a.lmcache_dir)
    if problem and {"default", "pagecache"} & set(arms):
        info["error"] = problem
        bench.save()
        return f"bench: {problem}"
    disk, pinned = disk_probe(a.work / "disk-probe"), pinned_probe(bench.py)
    info["probes"] = {"pinned": pinned, "disk": disk}
    cold = [v for v in (disk.get("direct_read"), disk.get("cold_read")) if v]
    bench.rates = info["rates"] = {
        "disk_read_gbps": max(cold, default=None),
        "page_cache_read_gbps": disk.get("warm_read"),
        "pinned_h2d_gbps": pinned.get("h2d_gbps"),
    }
    bench.save()
    for i, (model, p) in enumerate(cases):
        m = MODELS[model]
        colds = sorted(q for k, q in cases if k == model and row_key(k, q, "cold") not in done)
        if "cold" in arms and colds and model not in {k for k, _ in cases[:i]}:  # one engine
            bench.cold_phase(m, colds)
        for group, lmc in (  # pagecache and default share a store, pagecache first
            (("pagecache", "default"), a.lmcache_dir),
            (("offloading",), None),
            (("lmcache056",), a.l056_dir),
        ):
            if todo := [x for x in group if x in arms and row_key(model, p, x) not in done]:
                bench.restore_phase(m, p, todo, lmc)
    print(markdown_report(results))
    return 0


def main(argv: Sequence[str] | None = None) -> int | str:
    ap = argparse.ArgumentParser(description=__doc__.split(":")[0])
    ap.add_argument("--lmcache-dir", type=Path, required=True, help="this wheel (pip --target)")
    ap.add_argument("--l056-dir", type=Path, default=Path("/tmp/lmc-056"), help="lmcache 0.5.6")
    ap.add_argument("--cases", default=DEFAULT_CASES, help="model:length,... (%(default)s)")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated (%(default)s)")
    ap.add_argument("--results", type=Path, default=REPO / "results" / "bench-gpu.json")
    ap.add_argument("--work", type=Path, default=Path("/tmp/hybridfa-bench"), help="L2 tiers, logs")
    ap.add_argument("--time-limit-s", type=float, default=0, help="end the run after this many s")
    ap.add_argument(
        "--resume", action="store_true", help="add to --results: rows it holds that are ok stay"
    )
    ap.add_argument("--engine-timeout", type=float, default=900.0)
    a = ap.parse_args(argv)
    a.lmcache_dir = a.lmcache_dir.resolve()
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
