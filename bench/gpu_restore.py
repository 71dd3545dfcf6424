"""GPU benchmark: restore TTFT after a restart, against the cold prefill of an engine without a
connector and against a floor, both measured in the same piece (bench/README.md). One piece
per model, length, group and mode, run in one command or split at the restart into a store and
a restore stage on the same machine; pieces merge into one report per revision, software set
and GPU model. Run from the checkout: ``python -m bench.gpu_restore piece ...`` and
``python -m bench.gpu_restore merge ...``."""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import shutil
import subprocess
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import floor, machine, miss_path
from bench.bench_engine import mode_of
from bench.restore_report import (
    GB,
    l2_read_bytes,
    object_group_means,
    offloading_transfer_config,
    parse_server_log,
    write_merged,
)
from hybridfa_gate import l2 as l2_tiers
from hybridfa_gate.judge import compare_kv_hashes, connector_hit
from hybridfa_gate.models import MODELS as GATE_MODELS
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
    compile_cache_env,
    free_port,
    install_cleanup_handler,
    kill_group,
    spawn,
    start_server,
    tail,
)
from hybridfa_gate.prompts import make_prompt, required_hit
from hybridfa_gate.run import collect_environment
from hybridfa_gate.specs import WEIGHT_STD, base_spec

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
ENGINE = {"qwen35-9b": (0.6, None), "qwen35-r17": (0.30, WEIGHT_STD)}
LENGTHS = {"8k": 8192, "26k": 26624, "64k": 65536, "128k": 131072}
# group: (arms it measures, the kinds of a round in its restore engine)
GROUPS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "warmup": ((), ()),
    "warmup-hnd": ((), ()),
    "lmcache": (("default", "pagecache"), ("cold", "disk", "pagecache", "fixed")),
    "offloading": (("offloading",), ("cold", "disk", "fixed")),
    "lmcache056": (("lmcache056",), ("cold", "disk", "fixed")),
}
KIND_ARM = {"lmcache": {"disk": "default", "pagecache": "pagecache"}}
NEW_TOKENS, MAX_POSITIONS, WARM_BLOCKS = 8, 262144, 16
DISK_MARGIN = 2 * GIB  # left free on the L2 filesystem
CEILING_BYTES = 4 * GIB
# Command budget: an engine is not started with less than ENGINE_START_S left before its
# deadline (room for its start and one timed unit), and is killed ENGINE_TEARDOWN_S after it;
# the restore engine's deadline leaves CEILING_RESERVE_S for the ceiling probe after it.
ENGINE_START_S, ENGINE_TEARDOWN_S, CEILING_RESERVE_S = 90.0, 30.0, 75.0
# A disk restore must have read at least this share of the bytes of its hit's objects.
READ_SHARE = 0.9
PAGECACHE_READ_SHARE = 0.05  # a page-cache restore reads at most this share from the disk


class Skipped(RuntimeError):
    """An environment limit (disk, /dev/shm, no install): the piece measures nothing."""


def block(m: ModelSpec) -> int:
    return expected_geometry(m).block_size


def max_model_len(m: ModelSpec) -> int:
    """One for every piece of a model: vLLM's compile cache key holds it."""
    return max(LENGTHS.values()) + 4 * block(m)


def prompt_bytes(m: ModelSpec, p: int) -> int:
    """What storing a prompt writes (chunk N, either connector): every layer of every block."""
    return (p // block(m)) * expected_chunk_bytes(m, block(m))


def fa_object_bytes(m: ModelSpec) -> int:
    """One chunk's FA object (this wheel's layout): the files the ceiling probe imitates."""
    return layer_types(m).count("full_attention") * block(m) * attn_bytes_per_token(m)


def prompt(p: int, tag: str) -> list[int]:
    """One prompt per (tag, length); no two share a prefix."""
    return make_prompt(p, seed=zlib.crc32(f"{tag}:{p}".encode()))


def disk_plan(pb: int, free: int, rounds: int) -> int:
    """How many prompts an arm stores: one per round where the disk holds them next to one
    cold's files (removed after each cold) and the margin; at least one, else Skipped."""
    k = (free - DISK_MARGIN - pb) // pb if pb else rounds
    if k < 1:
        raise Skipped(f"L2 needs {(2 * pb + DISK_MARGIN) / GB:.0f} GB, {free / GB:.0f} free")
    return int(min(rounds, k))


def engine_spec(
    m: ModelSpec, p: int, role: str, md: Path, eager: bool, conn: dict[str, Any] | None = None
) -> dict[str, Any]:
    n, (util, std), conn = block(m), ENGINE[m.name], conn or {}
    spec = base_spec(m, n, role, md, prompt(p, "S0"), conn.get("lmcache"))
    spec.update(
        gpu_memory_utilization=util,
        weight_std=std,
        new_tokens=NEW_TOKENS,
        top_k=None,
        enforce_eager=eager,
        log_stats=True,
        max_model_len=max_model_len(m),
        prompt_bytes=prompt_bytes(m, p),
        block_tokens=n,
        warm_prompts=[prompt(min(p, WARM_BLOCKS * n + n // 2), "W")],
    )
    if "kv_transfer_config" in conn:
        spec.update(kv_transfer_config=conn["kv_transfer_config"], connector="offloading")
        spec["suffix"] = ".bin"
    return spec


def run_engine(
    py: str, env: dict[str, str], spec: dict[str, Any], wd: Path, role: str, timeout: float
) -> dict[str, Any]:
    """``python -m bench.bench_engine`` with ``spec``; its result (``ok``, ``error``)."""
    spec_path, out, log = wd / f"{role}.spec.json", wd / f"{role}.json", wd / f"{role}.log"
    spec_path.write_text(json.dumps(spec))
    print(f"[bench] {wd.name}: {role} engine", flush=True)
    t0 = time.monotonic()
    with open(log, "w") as fh:
        proc = spawn([py, "-m", "bench.bench_engine", str(spec_path), str(out)], fh, env, wd)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)
        kill_group(proc)
    res: dict[str, Any] = {"ok": False}
    with contextlib.suppress(OSError, ValueError):
        res = json.loads(out.read_text())
    if not res.get("ok"):
        res.setdefault("error", f"rc={proc.returncode}; log tail:\n{tail(log)}")
    res["process_s"] = round(time.monotonic() - t0, 2)
    return res


def http_port(proc: Any) -> int | None:
    """The LMCache server's --http-port (procs.start_server picks it)."""
    args = [str(a) for a in getattr(proc, "args", [])]
    return int(args[args.index("--http-port") + 1]) if "--http-port" in args else None


def finding(row: dict[str, Any], what: str) -> None:
    keys = ("model", "prompt_tokens", "arm", "mode")
    row["findings"].append({k: row[k] for k in keys} | {"what": what})


def restored_only(hashes: Any, hit_blocks: int) -> Any:
    """KV hashes with the FA blocks past the hit left out: the engine computes those after
    the restore, so they say nothing of what was restored."""
    out = []
    for h in hashes or []:
        fa = {la: {j: v for j, v in b.items() if int(j) < hit_blocks} for la, b in h["fa"].items()}
        out.append({**h, "fa": fa})
    return out


def needed_bytes(
    stored: dict[str, Any], hit: int, n: int, ctx: dict[str, Any], l1: int | None, l2: int | None
) -> float | None:
    """Bytes of the objects the hit needs. This wheel (``ctx["needed_from"]`` server_log):
    the objects its server retained for the hit (its log's L1 and L2 keys) at the tier's
    object sizes. The peers, which read every hit block's objects: the stored prompt's files."""
    if ctx.get("needed_from") == "server_log":
        return l2_read_bytes((l1 or 0) + (l2 or 0), hit, n, ctx.get("groups") or {}, ctx["fa"])
    files = stored.get("files") or {}
    return float(sum(files.values())) if files else None


def judge_restore(
    r: dict[str, Any], stored: dict[str, Any], m: ModelSpec, p: int, ctx: dict[str, Any]
) -> dict[str, Any]:
    """One timed restore's evidence: hit, restored KV bytes (and tokens where the weights are
    not vLLM's dummy ones) against the storing engine, the server's prefetch (L1/L2 objects),
    the bytes its hit needs, and whether its source is proven."""
    n = block(m)
    hit, local = connector_hit(r)
    hb = hit // n
    kv = compare_kv_hashes(
        restored_only(stored.get("kv_hashes"), hb), restored_only(r.get("kv_hashes"), hb), hit
    )
    keys = ("round", "kind", "ttft_s", "io_read_bytes", "hit_files", "span", "timeline")
    out = {k: r.get(k) for k in keys}
    out.update(
        hit_tokens=hit,
        local_hit_tokens=local,
        hit_ok=hit >= required_hit(p, n),
        kv_match=kv["match"],
        kv_mismatches=kv["mismatches"][:4],
        tokens_match=r.get("tokens") == stored.get("tokens"),
        l2_quiet=r.get("l2_quiet"),
        prefix_reset=r.get("prefix_reset"),
        l1_cleared=r.get("l1_cleared"),
    )
    a, b = r.get("span") or (None, None)
    inside = [x for x in ctx.get("prefetch") or [] if a and b and a <= x["t"] <= b]
    if ctx.get("groups") is not None:
        out["l1_objects"] = sum(x["l1"] for x in inside)
        out["l2_objects"] = sum(x["l2"] for x in inside)
    out["needed_bytes"] = needed_bytes(
        stored, hit, n, ctx, out.get("l1_objects"), out.get("l2_objects")
    )
    tokens_ok = out["tokens_match"] or not ctx.get("tokens_count")
    out["correct"] = bool(out["hit_ok"] and kv["match"] and tokens_ok)
    out["unproven"] = proof_problems(out)
    out["proven"] = not out["unproven"]
    return out


def proof_problems(r: dict[str, Any]) -> list[str]:
    """Why a restore's source is not proven (none: proven). Every restore: vLLM's prefix cache
    reset and the connector's CPU copies cleared before it, nothing from either, a quiet
    folder, a hit. A disk restore: none of the hit's files had a page in the page cache, and
    the server read at least READ_SHARE of the bytes the hit needs. A page-cache restore: it
    read at most PAGECACHE_READ_SHARE of them from the disk."""
    bad = [k for k in ("prefix_reset", "l1_cleared", "l2_quiet") if r.get(k) is not True]
    if r.get("local_hit_tokens"):
        bad.append(f"vLLM's prefix cache served {r['local_hit_tokens']} tokens")
    if r.get("l1_objects"):
        bad.append(f"{r['l1_objects']} L1 objects")
    if not r.get("hit_tokens"):
        bad.append("no hit")
    io, need = r.get("io_read_bytes"), r.get("needed_bytes")
    if io is None or not need:
        return [*bad, f"read {io}, needed {need}"]
    if r["kind"] == "pagecache":
        if io > PAGECACHE_READ_SHARE * need:
            bad.append(f"read {io} of {need:.0f} bytes from the disk")
        return bad
    files = r.get("hit_files") or {}
    if not files.get("files") or files.get("resident_files") or files.get("missing_files"):
        bad.append(f"hit files {files}")
    if io < READ_SHARE * need:
        bad.append(f"read {io} of {need:.0f} bytes")
    return bad


def miss_record(c: dict[str, Any], stores: list[dict[str, Any]], end: float | None) -> dict:
    """A cold with the connector storing, for the miss path: TTFT, prefill steps, the
    connector's calls, the server's store lines until the next request, the L2 writes."""
    start = (c.get("span") or [None])[0]
    out = {k: c.get(k) for k in ("round", "ttft_s", "steps_s", "connector")}
    out["writes"] = (c.get("settle") or {}).get("writes")
    if start is not None:
        out["server"] = miss_path.server_stores(stores, start, end or math.inf)
    return out


class Piece:
    """One piece: a model, a length, a group of arms, a mode (CUDA graphs or eager), run in
    one command (stage ``all``) or two (``store``, then ``restore``, on the same machine)."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.py = a, sys.executable
        model, _, length = a.case.partition(":")
        if model not in MODELS:
            raise SystemExit(f"bench: unknown model {model!r}; one of {', '.join(MODELS)}")
        self.m, self.p = MODELS[model], LENGTHS.get(length) or int(length)
        self.mode = "eager" if a.eager else "graphs"
        self.name = f"{self.m.name}-{self.p}-{a.group}-{self.mode}"
        self.wd = a.work / self.name
        self.t0 = time.time()
        self.deadline = self.t0 + a.budget_s
        self.rows: dict[str, dict[str, Any]] = {}
        self.info: dict[str, Any] = {}
        self.handoff: dict[str, Any] = {}
        self.complete = False

    def row(self, arm: str) -> dict[str, Any]:
        r = {
            "model": self.m.name,
            "prompt_tokens": self.p,
            "arm": arm,
            "mode": self.mode,
            "errors": [],
            "findings": [],
            "restores": [],
            "baseline_colds": [],
            "colds_in_engine": [],
            "fixed_probes": [],
        }
        return self.rows.setdefault(f"{self.m.name}:{self.p}:{arm}:{self.mode}", r)

    def save(self) -> None:
        data = {"piece": self.name, "complete": self.complete, "run": self.info, "rows": self.rows}
        self.a.out.mkdir(parents=True, exist_ok=True)
        atomic_write(self.a.out / f"{self.name}.json", json.dumps(data, indent=1) + "\n")

    def env(self, lmc: Path | None, layout: str) -> dict[str, str]:
        env = child_env(lmc, layout)
        env["PYTHONHASHSEED"] = "0"  # vLLM's block hashes name the OffloadingConnector's files
        env.update(compile_cache_env(self.a.compile_cache))
        return env

    def model_dir(self) -> Path:
        md = write_model_dir(self.m, self.a.work / "models")
        cfg = json.loads((md / "config.json").read_text())
        cfg.get("text_config", cfg)["max_position_embeddings"] = MAX_POSITIONS
        atomic_write(md / "config.json", json.dumps(cfg) + "\n")
        return md

    def engine(self, env: dict[str, str], spec: dict[str, Any], role: str) -> dict[str, Any]:
        """One engine under this command's deadline; its read-back mode checked."""
        deadline = self.deadline - (CEILING_RESERVE_S if role == "restore" else 0.0)
        if (left := deadline - time.time()) < ENGINE_START_S:
            raise RuntimeError(f"{role} engine: {left:.0f} s left of --budget-s, not started")
        spec["deadline"] = deadline
        timeout = min(self.a.engine_timeout, deadline + ENGINE_TEARDOWN_S - time.time())
        res = run_engine(self.py, env, spec, self.wd, role, timeout)
        read = res.get("engine_mode")
        self.info.setdefault("engines", {})[role] = {
            k: res.get(k) for k in ("ok", "engine_up_s", "process_s", "cut_by_deadline")
        } | {"engine_mode": read, "read_back": mode_of(read) if read else None}
        if not res.get("ok"):
            raise RuntimeError(f"{role} engine: {str(res.get('error'))[-1500:]}")
        if mode_of(read) != self.mode:
            raise RuntimeError(f"{role} engine runs {mode_of(read)} ({read}), not {self.mode}")
        return res

    def describe(self, stage: str) -> None:
        a = self.a
        versions = collect_environment(self.py, a.lmcache_dir)["versions"]
        run = {
            "versions": versions,
            "software": machine.software(versions),
            "revision": machine.wheel_revision(a.lmcache_dir),
            "gpus": machine.gpus(),
            "host": machine.host(a.work),
            "code": machine.code_digest(),
        }
        run["identity"] = machine.identity(run)
        if a.group == "lmcache056":  # the peer's version, checked at the merge
            run["peers"] = {"lmcache056": machine.dist_version(a.l056_dir, "lmcache")}
        stamp = {
            "started": _dt.datetime.now().isoformat(timespec="seconds"),
            "argv": sys.argv[1:],
            "compile_cache": {
                "folder": str(a.compile_cache.resolve()),
                "before": machine.folder_summary(a.compile_cache),
            },
        }
        if stage == "restore":
            same = ("identity", "code")
            ids = ("host_id", "boot_id")
            if any(self.info.get(k) != run[k] for k in same) or any(
                self.info["host"].get(k) != run["host"].get(k) for k in ids
            ):
                raise RuntimeError(
                    "the store stage ran on another machine, boot, software or code: "
                    f"{[self.info.get(k) for k in same]} vs {[run[k] for k in same]}"
                )
        self.info.update(run)
        self.info.setdefault("stages", {})[stage] = stamp
        self.info.update(model=self.m.name, prompt_tokens=self.p, group=a.group, mode=self.mode)
        self.info.update(rounds=a.rounds, max_model_len=max_model_len(self.m))
        self.info["budget_s"] = a.budget_s

    def run(self) -> None:
        a = self.a
        stage = "all" if a.group.startswith("warmup") else a.stage
        for arm in GROUPS[a.group][0]:
            self.row(arm)
        if stage == "restore":
            try:
                self.load_handoff()
            except RuntimeError as e:  # the store stage's piece file stays as it is
                self.info["error"] = str(e)
                return
        else:
            shutil.rmtree(self.wd, ignore_errors=True)
            self.wd.mkdir(parents=True)
        try:
            self.describe(stage)
            self.save()
            if a.group.startswith("warmup"):
                self.warmup()
            else:
                self.restore_group(stage)
        except (Skipped, RuntimeError, ServerError, OSError) as e:
            for r in self.rows.values():
                r["errors"].append(f"{stage}: {type(e).__name__}: {e}"[-1500:])
            self.info["error"] = f"{stage}: {type(e).__name__}: {e}"[-1500:]
        finally:
            for leftover in Path("/dev/shm").glob("vllm_offload_hybridfa-bench-*"):
                leftover.unlink(missing_ok=True)
        cache = self.info.get("stages", {}).get(stage, {}).get("compile_cache")
        if cache is not None:
            cache["after"] = machine.folder_summary(a.compile_cache)
        self.info.setdefault("stages", {}).setdefault(stage, {})["ended_s"] = round(
            time.time() - self.t0, 1
        )
        for r in self.rows.values():
            r["ok"] = not r["errors"]
        self.save()
        if stage == "store" and self.handoff and "error" not in self.info:
            self.handoff.update(info=self.info, rows=self.rows)
            atomic_write(self.handoff_path(), json.dumps(self.handoff))

    def warmup(self) -> None:
        """One engine without a connector, a prefill of every length up to this one."""
        layout = "HND" if self.a.group == "warmup-hnd" else "NHD"
        spec = engine_spec(self.m, self.p, "warmup", self.model_dir(), self.a.eager)
        spec["warm_prompts"] = [prompt(q, "W") for q in LENGTHS.values() if q <= self.p]
        res = self.engine(self.env(None, layout), spec, "warmup")
        self.info["warm_ttft_s"] = [w.get("ttft_s") for w in res.get("warm") or []]
        self.complete = True

    def handoff_path(self) -> Path:
        return self.wd / "handoff.json"

    def load_handoff(self) -> None:
        """The store stage's state: its run, rows (the baseline colds), stored prompts."""
        try:
            h = json.loads(self.handoff_path().read_text())
        except (OSError, ValueError) as e:
            raise RuntimeError(f"no store stage of {self.name} in {self.wd}: {e}") from e
        self.info, self.rows, self.handoff = h["info"], h["rows"], h
        for i, files in enumerate(h["stored_files"]):
            for f, size in files.items():
                if not os.path.exists(f) or os.path.getsize(f) != size:
                    raise RuntimeError(f"stored prompt {i}'s file {f} changed since the store")

    def clear_other_tiers(self) -> list[str]:
        """Tiers other pieces' store stages left (a store stage whose restore never ran)."""
        gone = []
        for d in self.a.work.glob("*/tier"):
            if d.parent != self.wd:
                shutil.rmtree(d, ignore_errors=True)
                gone.append(d.parent.name)
        return gone

    def restore_group(self, stage: str) -> None:
        a = self.a
        lmc = {"lmcache": a.lmcache_dir, "lmcache056": a.l056_dir}.get(a.group)
        if lmc and not (Path(lmc) / "lmcache").is_dir():
            raise Skipped(f"no lmcache installed in {lmc}")
        if stage != "restore":
            self.store_part(lmc)
            if stage == "store":
                return
        self.restore_part(lmc)
        self.complete = True

    def connector(self, lmc: Path | None, role: str, tier: Path, procs: list[Any]) -> dict:
        """The engine's connector; an LMCache server of its own (into ``procs``)."""
        if self.a.group == "offloading":
            cpu = int(self.info["disk_plan"]["cpu_tier"])
            eid = f"hybridfa-bench-{os.getpid()}-{role}"
            return {"kv_transfer_config": offloading_transfer_config(tier, cpu, eid)}
        port, pb = free_port(), prompt_bytes(self.m, self.p)
        l1 = max(4, math.ceil(2.5 * pb / GB) + 2)
        log = self.wd / f"server-{role}.log"
        env = self.env(lmc, "NHD")
        procs.append(start_server(self.py, env, port, block(self.m), tier, log, l1_size_gb=l1))
        return {"lmcache": port}

    def store_part(self, lmc: Path | None) -> None:
        """The baseline (no connector), then the store engine; the state the restore needs
        goes to the handoff file."""
        a, m, p, pb = self.a, self.m, self.p, prompt_bytes(self.m, self.p)
        offload = a.group == "offloading"
        self.info["removed_leftover_tiers"] = self.clear_other_tiers()
        tier = self.wd / "tier"
        tier.mkdir()
        k = disk_plan(pb, shutil.disk_usage(tier).free, a.rounds)
        shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
        cpu = int(min(max(4 * GIB, 2 * pb), 0.8 * shm))  # the OffloadingConnector's CPU tier
        if offload and cpu < pb:
            raise Skipped(f"/dev/shm has no room for a {pb / GB:.1f} GB CPU tier")
        self.info["disk_plan"] = {"prompt_bytes": pb, "stored_prompts": k, "cpu_tier": cpu}
        md = self.model_dir()
        colds = [prompt(p, f"cold-{i}") for i in range(a.rounds)]

        spec = engine_spec(m, p, "cold", md, a.eager)
        spec["cold_prompts"] = colds
        base = self.engine(self.env(None, "NHD"), spec, "cold")["requests"]
        for r in self.rows.values():
            r["baseline_colds"] = [c["ttft_s"] for c in base]
        self.save()

        procs: list[Any] = []
        try:
            conn = self.connector(lmc, "store", tier, procs)
            spec = engine_spec(m, p, "store", md, a.eager, conn)
            spec.update(stored=[prompt(p, f"S{i}") for i in range(k)], tier=str(tier))
            store = self.engine(self.env(lmc, "HND" if offload else "NHD"), spec, "store")
        finally:
            for proc in procs:
                kill_group(proc)
        if not store["l2"]["quiet"] or not store["stored"]:
            raise RuntimeError(f"store engine: L2 {store['l2']}, {len(store['stored'])} stored")
        self.info["store"] = {"l2": store["l2"], "stored": len(store["stored"])}
        keep = ("tokens", "kv_hashes", "files")
        self.handoff = {
            "info": self.info,
            "rows": self.rows,
            "baseline": base,
            "stored": [{x: s.get(x) for x in keep} for s in store["stored"]],
            "stored_files": [s["files"] for s in store["stored"]],
            "inventory": {} if offload else l2_tiers.folder_inventory(tier),
        }

    def restore_part(self, lmc: Path | None) -> None:
        """The restore engine after the restart; then the tier removed, the ceiling probe."""
        a, m, p, h = self.a, self.m, self.p, self.handoff
        offload, tier, procs = a.group == "offloading", self.wd / "tier", []
        ctx: dict[str, Any] = {"tokens_count": ENGINE[m.name][1] is not None}
        ctx["needed_from"] = "server_log" if a.group == "lmcache" else "stored_files"
        try:
            conn = self.connector(lmc, "restore", tier, procs)
            spec = engine_spec(m, p, "restore", self.model_dir(), a.eager, conn)
            k = len(h["stored"])
            spec.update(stored=[prompt(p, f"S{i}") for i in range(k)], tier=str(tier))
            spec.update(stored_files=[list(f) for f in h["stored_files"]], rounds=a.rounds)
            spec.update(kinds=list(GROUPS[a.group][1]))
            spec["cold_prompts"] = [prompt(p, f"cold-{i}") for i in range(a.rounds)]
            if procs:
                spec.update(io_pid=procs[-1].pid, clear_url=self.clear_url(procs[-1]))
            try:
                res = self.engine(self.env(lmc, "HND" if offload else "NHD"), spec, "restore")
            finally:
                for proc in procs:
                    kill_group(proc)
            if procs:
                log = (self.wd / "server-restore.log").read_text(errors="replace")
                ctx.update(parse_server_log(log))
                ctx.update(groups=object_group_means(h["inventory"]), fa=fa_object_bytes(m))
            self.fill(res, h["stored"], h["baseline"], ctx)
        finally:
            shutil.rmtree(tier, ignore_errors=True)
        self.info["ceiling"] = floor.ceiling_probe(
            a.work / "ceiling", fa_object_bytes(m), CEILING_BYTES
        )

    @staticmethod
    def clear_url(proc: Any) -> str | None:
        port = http_port(proc)
        return f"http://127.0.0.1:{port}/cache/clear" if port else None

    def fill(
        self,
        res: dict[str, Any],
        stored: list[dict[str, Any]],
        baseline: list[dict[str, Any]],
        ctx: dict[str, Any],
    ) -> None:
        """The restore engine's rounds into the rows: each restore judged, the colds (the
        cost of a miss, with the miss path), the fixed-cost probes."""
        arms = KIND_ARM.get(self.a.group) or {"disk": self.a.group}
        first = self.row(arms["disk"])
        reqs = res["requests"]
        misses, fixed = [], []
        for i, r in enumerate(reqs):
            end = (reqs[i + 1].get("span") or [None])[0] if i + 1 < len(reqs) else None
            if r["kind"] == "cold":
                misses.append(miss_record(r, ctx.get("stores") or [], end))
                continue
            if r["kind"] == "fixed":
                local = r.get("local_cached_tokens") or 0
                ok = local >= required_hit(self.p, block(self.m))
                fixed.append(r["ttft_s"] if ok else None)
                if not ok:
                    finding(first, f"round {r['round']}: fixed probe hit {local} tokens, left out")
                continue
            row = self.row(arms[r["kind"]])
            got = judge_restore(r, stored[r["stored_index"]], self.m, self.p, ctx)
            row["restores"].append(got)
            what = f"round {got['round']} {r['kind']}"
            if not got["correct"]:
                kv = "equal" if got["kv_match"] else f"differ {got['kv_mismatches']}"
                finding(
                    row,
                    f"{what}: hit {got['hit_tokens']}, restored KV bytes {kv}, tokens equal: "
                    f"{got['tokens_match']}",
                )
            if not got["proven"]:
                finding(row, f"{what}: source not proven: {'; '.join(got['unproven'])}")
        for arm in set(arms.values()):
            self.row(arm)["colds_in_engine"] = [x["ttft_s"] for x in misses]
            self.row(arm)["fixed_probes"] = fixed
        base = [{k: c.get(k) for k in ("ttft_s", "steps_s")} for c in baseline]
        first["miss_path"] = {
            "colds": misses,
            "baseline": base,
            "summary": miss_path.summarize(misses, base),
        }
        self.info["restore"] = {
            "rounds_run": len({r.get("round") for r in reqs}),
            "warm_restore_ttft_s": (res.get("warm_restore") or {}).get("ttft_s"),
            "timed_methods": res.get("timed_methods"),
        }


def main(argv: Sequence[str] | None = None) -> int | str:
    ap = argparse.ArgumentParser(description=__doc__.split(":")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pc = sub.add_parser("piece", help="measure one model:length, one group, one mode")
    pc.add_argument("--case", required=True, help="model:length, e.g. qwen35-9b:26k")
    pc.add_argument("--group", required=True, choices=list(GROUPS))
    pc.add_argument("--eager", action="store_true", help="the labelled eager arm")
    pc.add_argument(
        "--stage",
        choices=("all", "store", "restore"),
        default="all",
        help="all: one command; store, then restore: the piece split at the restart",
    )
    pc.add_argument("--rounds", type=int, default=5, help="colds and restores per arm")
    pc.add_argument(
        "--budget-s", type=float, default=540.0, help="this command ends within it plus 30 s"
    )
    pc.add_argument("--lmcache-dir", type=Path, required=True, help="this wheel (pip --target)")
    pc.add_argument("--l056-dir", type=Path, default=Path("/tmp/lmc-056"), help="lmcache 0.5.6")
    pc.add_argument("--out", type=Path, default=Path("results/pieces"), help="pieces' folder")
    pc.add_argument("--work", type=Path, default=Path("/tmp/hybridfa-bench"), help="L2, logs")
    pc.add_argument(
        "--compile-cache",
        type=Path,
        default=Path("/tmp/hybridfa-bench-cache"),
        help="every engine's compile caches (vLLM, inductor, Triton, FlashInfer)",
    )
    pc.add_argument("--engine-timeout", type=float, default=600.0, help="at most, per engine")
    mg = sub.add_parser("merge", help="merge pieces into reports (JSON, markdown, plots)")
    mg.add_argument("pieces", type=Path, nargs="+", help="piece files or folders")
    mg.add_argument("--results", type=Path, default=Path("results/bench-gpu.json"))
    a = ap.parse_args(argv)
    if a.cmd == "merge":
        files = [f for x in a.pieces for f in (sorted(x.glob("*.json")) if x.is_dir() else [x])]
        for path, plots in write_merged([json.loads(f.read_text()) for f in files], a.results):
            print(f"[bench] wrote {path} and {path.with_suffix('.md')}; plots: {plots}")
        return 0
    a.lmcache_dir = a.lmcache_dir.resolve()
    install_cleanup_handler()
    a.work.mkdir(parents=True, exist_ok=True)
    piece = Piece(a)
    piece.run()
    bad = [e for r in piece.rows.values() for e in r["errors"]] or [piece.info.get("error")]
    return f"bench: {piece.name}: {bad[0][:600]}" if bad[0] else 0


if __name__ == "__main__":
    sys.exit(main())
