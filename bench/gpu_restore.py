"""GPU benchmark: restore TTFT after a restart, against cold prefills timed in turn in the same
engine and against a floor measured in the same run (bench/README.md). One piece per command
(one model, length, group and mode), merged into one report afterwards. Run from the checkout:
``python -m bench.gpu_restore piece ...`` and ``python -m bench.gpu_restore merge ...``."""

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

from bench import floor
from bench.restore_report import (
    GB,
    l2_read_bytes,
    merge_pieces,
    object_group_means,
    offloading_transfer_config,
    parse_server_log,
    write_results,
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
    "cold": (("cold",), ("cold",)),
    "lmcache": (("default", "pagecache"), ("cold", "disk", "pagecache")),
    "offloading": (("offloading",), ("cold", "disk")),
    "lmcache056": (("lmcache056",), ("cold", "disk")),
}
KIND_ARM = {"lmcache": {"disk": "default", "pagecache": "pagecache"}}
NEW_TOKENS, MAX_POSITIONS, WARM_BLOCKS = 8, 262144, 16
DISK_MARGIN = 2 * GIB  # left free on the L2 filesystem
CEILING_BYTES = 4 * GIB


class Skipped(RuntimeError):
    """An environment limit (disk, /dev/shm, no install): the piece measures nothing."""


def block(m: ModelSpec) -> int:
    return expected_geometry(m).block_size


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


def judge_restore(
    r: dict[str, Any], stored: dict[str, Any], m: ModelSpec, p: int, ctx: dict[str, Any]
) -> dict[str, Any]:
    """One timed restore's evidence: hit, KV bytes and tokens against the storing engine, the
    server's prefetch (L1/L2 objects, their bytes), and whether its source is proven."""
    n = block(m)
    hit = connector_hit(r)[0]
    kv = compare_kv_hashes(stored.get("kv_hashes"), r.get("kv_hashes"), hit)
    out = {
        k: r.get(k)
        for k in ("round", "kind", "ttft_s", "io_read_bytes", "resident_bytes", "bytes", "fixed_s")
    }
    out.update(
        hit_tokens=hit,
        hit_ok=hit >= required_hit(p, n),
        kv_match=kv["match"],
        kv_mismatches=kv["mismatches"][:4],
        tokens_match=r.get("tokens") == stored.get("tokens"),
        l2_quiet=r.get("l2_quiet"),
        l1_cleared=r.get("l1_cleared"),
        timeline=r.get("timeline"),
    )
    a, b = r.get("span") or (None, None)
    inside = [x for x in ctx.get("prefetch") or [] if a and b and a <= x["t"] <= b]
    if ctx.get("groups") is not None:
        out["l1_objects"] = sum(x["l1"] for x in inside)
        out["l2_objects"] = sum(x["l2"] for x in inside)
        out["object_bytes"] = l2_read_bytes(out["l2_objects"], hit, n, ctx["groups"], ctx["fa"])
    out["correct"] = bool(out["hit_ok"] and kv["match"] and out["tokens_match"])
    out["proven"] = proven(out)
    return out


def proven(r: dict[str, Any]) -> bool:
    """A disk restore read the disk with its files out of the page cache and nothing from L1;
    a page-cache restore read (almost) nothing from the disk and nothing from L1."""
    if r.get("l1_objects") or not r.get("l2_quiet"):
        return False
    io, objs = r.get("io_read_bytes"), r.get("object_bytes")
    if r["kind"] == "pagecache":
        return io is not None and objs is not None and io <= 0.05 * objs
    resident, total = r.get("resident_bytes") or 0, r.get("bytes") or 0
    return bool(io) and resident <= 0.01 * max(total, 1)


class Piece:
    """One piece: a model, a length, a group of arms, a mode (CUDA graphs or eager)."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.py = a, sys.executable
        model, _, length = a.case.partition(":")
        if model not in MODELS:
            raise SystemExit(f"bench: unknown model {model!r}; one of {', '.join(MODELS)}")
        self.m, self.p = MODELS[model], LENGTHS.get(length) or int(length)
        self.mode = "eager" if a.eager else "graphs"
        self.name = f"{self.m.name}-{self.p}-{a.group}-{self.mode}" + (
            f"-{a.part}" if a.part else ""
        )
        self.rows: dict[str, dict[str, Any]] = {}
        self.info: dict[str, Any] = {}

    def row(self, arm: str) -> dict[str, Any]:
        r = {
            "model": self.m.name,
            "prompt_tokens": self.p,
            "arm": arm,
            "mode": self.mode,
            "errors": [],
            "findings": [],
            "restores": [],
            "colds_in_engine": [],
        }
        return self.rows.setdefault(f"{self.m.name}:{self.p}:{arm}:{self.mode}", r)

    def save(self) -> None:
        data = {"piece": self.name, "run": self.info, "rows": self.rows}
        self.a.out.mkdir(parents=True, exist_ok=True)
        atomic_write(self.a.out / f"{self.name}.json", json.dumps(data, indent=1) + "\n")

    def setup(self, lmc: Path | None, layout: str) -> tuple[Path, Path, dict[str, str]]:
        shutil.rmtree(wd := self.a.work / self.name, ignore_errors=True)
        wd.mkdir(parents=True)
        md = write_model_dir(self.m, self.a.work / "models")
        cfg = json.loads((md / "config.json").read_text())
        cfg.get("text_config", cfg)["max_position_embeddings"] = MAX_POSITIONS
        atomic_write(md / "config.json", json.dumps(cfg) + "\n")
        env = child_env(lmc, layout)
        env["PYTHONHASHSEED"] = "0"  # vLLM's block hashes name the OffloadingConnector's files
        return wd, md, env

    def run(self) -> None:
        a = self.a
        lmc = {"lmcache": a.lmcache_dir, "lmcache056": a.l056_dir}.get(a.group)
        self.info = {
            "started": _dt.datetime.now().isoformat(timespec="seconds"),
            "argv": sys.argv[1:],
            **collect_environment(self.py, a.lmcache_dir),
            "rounds": a.rounds,
        }
        for arm in GROUPS[a.group][0]:
            self.row(arm)
        try:
            if a.group in ("warmup", "cold"):
                self.cold_engine()
            else:
                self.info["ceiling"] = floor.ceiling_probe(
                    a.work / "ceiling", fa_object_bytes(self.m), CEILING_BYTES
                )
                self.save()
                self.restore_group(lmc)
        except (Skipped, RuntimeError, ServerError, OSError) as e:
            for r in self.rows.values():
                r["errors"].append(f"{type(e).__name__}: {e}"[-1500:])
        for r in self.rows.values():
            r["ok"] = not r["errors"]
        self.save()

    def cold_engine(self) -> None:
        """warmup: one prefill per length up to this one; cold: ``rounds`` colds, no connector."""
        wd, md, env = self.setup(None, "NHD")
        spec = engine_spec(self.m, self.p, self.a.group, md, self.a.eager)
        if self.a.group == "warmup":
            spec["warm_prompts"] = [prompt(q, "W") for q in LENGTHS.values() if q <= self.p]
        spec["cold_prompts"] = [prompt(self.p, f"cold-{i}") for i in range(self.a.rounds)]
        res = run_engine(self.py, env, spec, wd, self.a.group, self.a.engine_timeout)
        self.info["engine"] = {k: res.get(k) for k in ("ok", "engine_up_s", "process_s")}
        if not res.get("ok"):
            raise RuntimeError(f"{self.a.group} engine: {str(res.get('error'))[-1500:]}")
        if self.a.group == "cold":
            self.row("cold")["colds_in_engine"] = [c["ttft_s"] for c in res["requests"]]

    def restore_group(self, lmc: Path | None) -> None:
        """Store, kill engine and server, start new ones, restore in rounds (bench_engine)."""
        a, m, p, pb = self.a, self.m, self.p, prompt_bytes(self.m, self.p)
        offload = a.group == "offloading"
        if lmc and not (Path(lmc) / "lmcache").is_dir():
            raise Skipped(f"no lmcache installed in {lmc}")
        wd, md, env = self.setup(lmc, "HND" if offload else "NHD")
        tier, procs = wd / "tier", []
        tier.mkdir()
        k = disk_plan(pb, shutil.disk_usage(tier).free, a.rounds)
        shm = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
        cpu = int(min(max(4 * GIB, 2 * pb), 0.8 * shm))  # the OffloadingConnector's CPU tier
        if offload and cpu < pb:
            raise Skipped(f"/dev/shm has no room for a {pb / GB:.1f} GB CPU tier")
        self.info["disk_plan"] = {"prompt_bytes": pb, "stored_prompts": k, "cpu_tier": cpu}
        stored = [prompt(p, f"S{i}") for i in range(k)]

        def connector(role: str) -> dict[str, Any]:
            if offload:
                eid = f"hybridfa-bench-{os.getpid()}-{role}"
                return {"kv_transfer_config": offloading_transfer_config(tier, cpu, eid)}
            port, l1 = free_port(), max(4, math.ceil(2.5 * pb / GB) + 2)
            log = wd / f"server-{role}.log"
            procs.append(start_server(self.py, env, port, block(m), tier, log, l1_size_gb=l1))
            return {"lmcache": port}

        try:
            spec = engine_spec(m, p, "store", md, a.eager, connector("store"))
            spec.update(stored=stored, tier=str(tier))
            store = run_engine(self.py, env, spec, wd, "store", a.engine_timeout)
            if procs:
                kill_group(procs.pop())
            if not store.get("ok") or not store["l2"]["quiet"]:
                raise RuntimeError(f"store engine: {str(store.get('error'))[-1500:]}")
            self.info["store"] = {k: store.get(k) for k in ("engine_up_s", "process_s", "l2")}
            inv = {} if offload else l2_tiers.folder_inventory(tier)
            spec = engine_spec(m, p, "restore", md, a.eager, connector("restore"))
            spec.update(stored=stored, tier=str(tier), rounds=a.rounds)
            spec.update(kinds=list(GROUPS[a.group][1]))
            spec["cold_prompts"] = [prompt(p, f"cold-{i}") for i in range(a.rounds)]
            if procs:
                spec.update(io_pid=procs[-1].pid, clear_url=self.clear_url(procs[-1]))
            res = run_engine(self.py, env, spec, wd, "restore", a.engine_timeout)
            ctx: dict[str, Any] = {}
            if procs:
                kill_group(procs.pop())
                ctx = parse_server_log((wd / "server-restore.log").read_text(errors="replace"))
                ctx.update(groups=object_group_means(inv), fa=fa_object_bytes(m))
            self.info["restore_engine"] = {k: res.get(k) for k in ("engine_up_s", "process_s")}
            if not res.get("ok"):
                raise RuntimeError(f"restore engine: {str(res.get('error'))[-1500:]}")
            self.fill(res, store["stored"], ctx)
        finally:
            for proc in procs:
                kill_group(proc)
            for leftover in Path("/dev/shm").glob("vllm_offload_hybridfa-bench-*"):
                leftover.unlink(missing_ok=True)
            shutil.rmtree(tier, ignore_errors=True)

    @staticmethod
    def clear_url(proc: Any) -> str | None:
        port = http_port(proc)
        return f"http://127.0.0.1:{port}/cache/clear" if port else None

    def fill(self, res: dict[str, Any], stored: list[dict[str, Any]], ctx: dict[str, Any]) -> None:
        arms = KIND_ARM.get(self.a.group) or {"disk": self.a.group}
        colds = [r["ttft_s"] for r in res["requests"] if r["kind"] == "cold"]
        for r in res["requests"]:
            if r["kind"] == "cold":
                continue
            row = self.row(arms[r["kind"]])
            got = judge_restore(r, stored[r["stored_index"]], self.m, self.p, ctx)
            row["restores"].append(got)
            what = f"round {got['round']}"
            if not got["correct"]:
                kv = "equal" if got["kv_match"] else f"differ {got['kv_mismatches']}"
                finding(
                    row,
                    f"{what}: hit {got['hit_tokens']}, KV bytes {kv}, tokens equal: "
                    f"{got['tokens_match']}",
                )
            if not got["proven"]:
                finding(
                    row,
                    f"{what}: source not proven {r['kind']} (resident "
                    f"{got['resident_bytes']}, read {got['io_read_bytes']}, L1 objects "
                    f"{got.get('l1_objects')}, quiet {got['l2_quiet']})",
                )
        for arm in set(arms.values()):
            self.row(arm)["colds_in_engine"] = colds


def main(argv: Sequence[str] | None = None) -> int | str:
    ap = argparse.ArgumentParser(description=__doc__.split(":")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pc = sub.add_parser("piece", help="measure one model:length, one group, one mode")
    pc.add_argument("--case", required=True, help="model:length, e.g. qwen35-9b:26k")
    pc.add_argument("--group", required=True, choices=list(GROUPS))
    pc.add_argument("--eager", action="store_true", help="the labelled eager arm")
    pc.add_argument("--rounds", type=int, default=5, help="colds and restores per arm")
    pc.add_argument(
        "--part", default="", help="a label: pieces of one row with other labels add up"
    )
    pc.add_argument("--lmcache-dir", type=Path, required=True, help="this wheel (pip --target)")
    pc.add_argument("--l056-dir", type=Path, default=Path("/tmp/lmc-056"), help="lmcache 0.5.6")
    pc.add_argument("--out", type=Path, default=Path("results/pieces"), help="pieces' folder")
    pc.add_argument("--work", type=Path, default=Path("/tmp/hybridfa-bench"), help="L2, logs")
    pc.add_argument("--engine-timeout", type=float, default=480.0)
    mg = sub.add_parser("merge", help="merge pieces into one JSON, markdown and plots")
    mg.add_argument("pieces", type=Path, nargs="+", help="piece files or folders")
    mg.add_argument("--results", type=Path, default=Path("results/bench-gpu.json"))
    a = ap.parse_args(argv)
    if a.cmd == "merge":
        files = [f for x in a.pieces for f in (sorted(x.glob("*.json")) if x.is_dir() else [x])]
        results = merge_pieces([json.loads(f.read_text()) for f in files])
        write_results(results, a.results)
        print(a.results.with_suffix(".md").read_text())
        return 0
    a.lmcache_dir = a.lmcache_dir.resolve()
    install_cleanup_handler()
    a.work.mkdir(parents=True, exist_ok=True)
    piece = Piece(a)
    piece.run()
    bad = [e for r in piece.rows.values() for e in r["errors"]]
    return f"bench: {piece.name}: {bad[0][:600]}" if bad else 0


if __name__ == "__main__":
    sys.exit(main())
