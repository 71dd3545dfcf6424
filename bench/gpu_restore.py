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
import shutil
import subprocess
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import fs_l2_read  # stdlib only at import: its page-cache functions
from bench.restore_report import (
    ARMS,
    GB,
    l2_read_bytes,
    markdown_report,
    new_results,
    object_group_means,
    offloading_transfer_config,
    parse_server_log,
    row_key,
    timed_h2d,
    write_results,
)
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
from hybridfa_gate.run import arm_problem, collect_environment
from hybridfa_gate.specs import WEIGHT_STD, base_spec

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30
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
