"""One case (three engines, two LMCache servers, one L2 tier), many cases, the run's report.

    python -m hybridfa_gate --arm patched --lmcache-dir /tmp/lmc-patched --cases quick

The lmcache under test is the one in ``--lmcache-dir`` (first on every child's PYTHONPATH);
the run checks that the engines import it and that it is of the arm named (``arm_problem``).
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hybridfa_gate import l2 as l2_tiers
from hybridfa_gate import lora
from hybridfa_gate.cases import DEFAULT_BASE, REFUSING_BASES, Case, release
from hybridfa_gate.forge import forge, forged_payload_kept
from hybridfa_gate.judge import add_errors, cudagraph_mode, evaluate_case, run_errors
from hybridfa_gate.l2 import wait_l2_stable
from hybridfa_gate.models import expected_chunk_bytes, write_model_dir
from hybridfa_gate.procs import (
    ServerError,
    child_env,
    extra_server_args,
    free_port,
    kill_group,
    run_engine,
    server_log_facts,
    start_server,
)
from hybridfa_gate.report import write_report
from hybridfa_gate.specs import (
    RunConfig,
    cold_key,
    engine_spec,
    restart_spec,
    restore_spec,
    store_spec,
)

# patched: this series' wheel; pristine: the base's lmcache release (0.5.3, or 0.5.6 for vLLM
# 0.29+); control: pristine 0.5.3 with the few patches that let it store at all where it cannot
# (hybridfa_gate.control).
ARMS = ("patched", "pristine", "control")
# The vLLM releases each lmcache base serves, [first, last] by (major, minor).
SERVED_VLLM = {"0.5.3": ((0, 26), (0, 28)), "0.5.6": ((0, 29), (0, 34))}


class ColdRuns:
    """Cold (no connector) results by ``specs.cold_key``: a cold run does not depend on the
    chunk, so cases that share a key run one cold engine. A second asker of a key waits
    for the run in progress instead of starting its own engine; a failed run is not kept."""

    def __init__(self) -> None:
        self.results: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._locks: dict[tuple[Any, ...], threading.Lock] = {}
        self._lock = threading.Lock()

    def get_or_run(self, key: tuple[Any, ...], run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        with self._lock:
            key_lock = self._locks.setdefault(key, threading.Lock())
        with key_lock:
            if key not in self.results:
                result = run()
                if not result.get("ok"):
                    return result
                self.results[key] = result
            return self.results[key]


def case_record(
    case: Case, arm: str, base: str = DEFAULT_BASE, kernels: bool = True
) -> dict[str, Any]:
    """A case's settings, as its report record starts."""
    rec: dict[str, Any] = {"case": case.case_id, "model": case.model, "family": case.spec.family}
    rec.update(geometry=asdict(case.geometry), layout=case.layout, chunk=case.chunk)
    rec.update(prompt_tokens=case.prompt_tokens, tp=case.tp, chunk_blocks=case.chunk_blocks)
    rec.update(attention_backend=case.backend, max_num_batched_tokens=case.max_num_batched_tokens)
    rec.update(spec_tokens=case.spec_tokens, turn=case.turn, l2_adapter=case.l2)
    dtype = case.kv_dtype
    if case.restore_kv_dtype is not None:
        dtype += f" -> {case.restore_kv_dtype}"
    mode = case.mode(arm, base, kernels)
    rec.update(kv_cache_dtype=dtype, lora=case.lora, forged=case.forged, mode=mode)
    rec.update(server_args=list(case.server_args), expect_refusal=mode == "refused")
    rec["enforce_eager"] = not case.graphs  # what was asked; ``cudagraph_mode``: what ran
    rec["expected_chunk_bytes"] = expected_chunk_bytes(
        case.spec, case.chunk, case.tp, case.kv_dtype
    )
    return rec


def run_case(case: Case, rc: RunConfig, cold_runs: ColdRuns) -> dict[str, Any]:
    t0 = time.monotonic()
    wd = rc.work / rc.arm / case.case_id
    shutil.rmtree(wd, ignore_errors=True)
    wd.mkdir(parents=True)
    l2 = wd / "l2"
    l2.mkdir()
    model_dir = write_model_dir(case.spec, rc.work / "models", mtp=case.spec_tokens > 0)
    adapters = {}
    if case.lora:
        adapters = {
            n: str(lora.write_adapter(case.spec, n, rc.work / "adapters", model_dir))
            for n in lora.SEEDS
        }
    env = child_env(rc.lmcache_dir, case.layout)
    rec = case_record(case, rc.arm, rc.base, rc.kernels)
    cold_spec = engine_spec(case, "cold", model_dir, rc, None, None, adapters=adapters)
    run_cold = functools.partial(run_engine, rc.python, env, cold_spec, wd, "cold")
    cold = cold_runs.get_or_run(cold_key(case), lambda: run_cold(rc.engine_timeout))
    store = restore = restart = None
    servers: list[subprocess.Popen[Any]] = []
    redis: l2_tiers.RedisServer | None = None
    try:
        tier: Path | str = l2
        if case.l2 == "resp":
            # The shared tier outlives both LMCache servers, as a Redis of its own would.
            redis = l2_tiers.RedisServer(workdir=wd / "redis").start()
            tier = l2_tiers.redis_url(redis.port)
            adapter = l2_tiers.adapter_json("resp", port=redis.port)
        else:
            adapter = l2_tiers.adapter_json(case.l2, folder=l2)
        server = functools.partial(start_server, rc.python, env, extra_args=case.server_args)
        port, log = free_port(), wd / "server1.log"
        srv = server(port, case.chunk, adapter, log)
        servers.append(srv)
        sspec = store_spec(case, model_dir, rc, port, tier, log, adapters)
        store = run_engine(rc.python, env, sspec, wd, "store", rc.engine_timeout)
        rec["l2_after_store"] = wait_l2_stable(tier, sspec["l2_min_objects"], server_log=log)
        kill_group(srv)
        rec["server1"] = server_log_facts(log.read_text(errors="replace"))
        inv = rec["l2_after_kill"] = l2_tiers.tier_inventory(tier)
        if inv["objects"]:
            rec["l2_bytes_per_object"] = inv["bytes"] / inv["objects"]
        if case.forged and store.get("ok") and not rec["expect_refusal"]:
            try:
                rec["forged_object"] = forge(
                    l2, store.get("l2_snapshot") or {}, case.fa_object_bytes
                )
            except (OSError, ValueError, ImportError) as e:
                rec["forge_error"] = f"the object could not be forged: {type(e).__name__}: {e}"
        if store.get("ok") and case.turn == 2 and store.get("tokens") != cold.get("tokens"):
            rec["server_error"] = (
                "turn 1's answer in the store engine differs from the reference engine's: "
                "turn 2 would not be the chat that was stored"
            )
        elif store.get("ok") and not rec.get("forge_error"):
            port = free_port()
            srv = server(port, case.chunk, adapter, wd / "server2.log")
            servers.append(srv)
            answer = store.get("tokens") or ()
            rspec = restore_spec(case, model_dir, rc, port, answer, adapters, tier)
            restore = run_engine(rc.python, env, rspec, wd, "restore", rc.engine_timeout)
            kill_group(srv)
            rec["server2"] = server_log_facts((wd / "server2.log").read_text(errors="replace"))
            if rec.get("forged_object") and restore.get("ok"):
                # What the first restore left in the forged object's file, then another
                # restart of server and engine on that tier.
                kept = forged_payload_kept(l2, rec["forged_object"])
                rec["forged_after_restore"] = {"kept": kept}
                port, log = free_port(), wd / "server3.log"
                srv = server(port, case.chunk, adapter, log)
                servers.append(srv)
                xspec = restart_spec(case, model_dir, rc, port, adapters)
                restart = run_engine(rc.python, env, xspec, wd, "restart", rc.engine_timeout)
                kill_group(srv)
                rec["server3"] = server_log_facts(log.read_text(errors="replace"))
    except (ServerError, FileNotFoundError, RuntimeError) as e:
        rec["server_error"] = str(e)[-3000:]
    finally:
        for s in servers:
            kill_group(s)
        if redis is not None:
            redis.close()
    kept = (rec.get("forged_after_restore") or {}).get("kept", True)
    ev = evaluate_case(case, cold, store, restore, rc.arm, rc.base, rc.kernels, restart, kept)
    rec["eval"] = add_errors(ev, run_errors(rec))
    engines = {"cold": cold, "store": store, "restore": restore}
    if restart is not None:
        engines["restart"] = restart
    rec["cudagraph_mode"] = {role: cudagraph_mode(r) for role, r in engines.items() if r}
    rec["engines"] = {role: slim(r) for role, r in engines.items()}
    rec["case_s"] = round(time.monotonic() - t0, 1)
    if not rc.keep_l2:
        shutil.rmtree(l2, ignore_errors=True)
    return rec


def slim(r: dict[str, Any] | None) -> dict[str, Any] | None:
    """Engine result without the bulky per-block hashes (those stay in the case folder)."""
    if r is None:
        return None
    out = {k: v for k, v in r.items() if k not in ("kv_hashes", "l2_snapshot")}
    if isinstance(out.get("second"), dict):
        out["second"] = {k: v for k, v in out["second"].items() if k != "kv_hashes"}
    return out


ENV_PROBE = r"""
import importlib, importlib.metadata as md, importlib.util, json
out = {}
for mod in ("vllm", "torch", "flashinfer", "lmcache"):
    try:
        m = importlib.import_module(mod)
        out[mod] = getattr(m, "__version__", None)
        if mod == "lmcache":
            try:
                out["lmcache_dist"] = md.version("lmcache")
            except md.PackageNotFoundError:
                out["lmcache_dist"] = None
            out["lmcache_path"] = m.__path__[0]
            # Whether a CUDA server would copy with the compiled kernels (0.5.6:
            # lmcache.device_ops; 0.5.3: lmcache.c_ops); None without a GPU.
            ops = getattr(m, "device_ops", None) or importlib.import_module("lmcache.c_ops")
            native = hasattr(ops, "execute_object_group_transfer")
            cuda = importlib.import_module("torch").cuda.is_available()
            out["lmcache_compiled_kernels"] = native if cuda else None
        if mod == "torch":
            out["cuda"] = m.version.cuda
    except Exception as e:  # noqa: BLE001
        out[mod] = f"import failed: {type(e).__name__}: {e}"
spec = importlib.util.find_spec("lmcache._hybridfa")
out["lmcache_hybridfa"] = spec is not None
if spec is not None:
    h = importlib.import_module("lmcache._hybridfa")
    out["hybridfa_version"] = getattr(h, "VERSION", None)
    out["hybridfa_patches"] = list(getattr(h, "PATCHES", ()))
    out["hybridfa_kernels"] = getattr(h, "KERNELS", None)  # what --kernels built against
print("GATE-ENV " + json.dumps(out))
"""


def collect_environment(py: str, lmcache_dir: Path | None) -> dict[str, Any]:
    """Versions as the engines see them (a child with their environment), and the GPUs."""
    env = child_env(lmcache_dir, None)
    versions: dict[str, Any] = {}
    try:
        cp = subprocess.run(
            [py, "-c", ENV_PROBE],
            env=env,
            cwd=tempfile.gettempdir(),  # not the checkout: its lmcache/ tree is not the build
            capture_output=True,
            text=True,
            timeout=300,
        )
        for line in cp.stdout.splitlines():
            if line.startswith("GATE-ENV "):
                versions = json.loads(line[len("GATE-ENV ") :])
        if not versions:
            versions = {"probe_error": (cp.stderr or cp.stdout)[-1500:]}
    except (OSError, subprocess.TimeoutExpired) as e:
        versions = {"probe_error": str(e)}
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    gpus: list[str] | str
    try:
        cp = subprocess.run(query, capture_output=True, text=True, timeout=60)
        gpus = [ln.strip() for ln in cp.stdout.splitlines() if ln.strip()]
    except (OSError, subprocess.TimeoutExpired) as e:
        gpus = f"nvidia-smi failed: {e}"
    return {"versions": versions, "hardware": {"gpus": gpus}, "server_args": extra_server_args()}


def lmcache_base(versions: dict[str, Any]) -> str:
    """The lmcache release the engines' build is based on ("0.5.3", "0.5.6"), from its
    distribution version; the default base where none is reported."""
    found = release(versions.get("lmcache_dist") or versions.get("lmcache"))
    return ".".join(map(str, found)) if found else DEFAULT_BASE


def arm_problem(arm: str, versions: dict[str, Any], lmcache_dir: Path) -> str | None:
    """The lmcache the engines import must be the one under test, of the right arm, of a base
    that serves the engines' vLLM."""
    path = versions.get("lmcache_path")
    if not path:
        return f"lmcache not importable from {lmcache_dir}: {versions}"
    if Path(path).resolve().parent != Path(lmcache_dir).resolve():
        return f"engines import lmcache from {path}, not from {lmcache_dir}"
    if bool(versions.get("lmcache_hybridfa")) != (arm == "patched"):
        return f"--arm {arm} but lmcache at {path} has _hybridfa={versions.get('lmcache_hybridfa')}"
    base = lmcache_base(versions)
    if base not in SERVED_VLLM:
        return f"lmcache at {path} is based on {base}; the gate knows {', '.join(SERVED_VLLM)}"
    if arm == "control" and base != DEFAULT_BASE:
        return f"--arm control is pristine {DEFAULT_BASE} with patches; {path} is {base}"
    vllm = release(versions.get("vllm"))
    first, last = SERVED_VLLM[base]
    if vllm is not None and not first <= vllm[:2] <= last:
        served = f"{'.'.join(map(str, first))}-{'.'.join(map(str, last))}"
        return f"lmcache {base} serves vLLM {served}, the engines import vLLM {versions['vllm']}"
    return None


def kernels_problem(
    arm: str, base: str, versions: dict[str, Any], expect_refusals: bool
) -> str | None:
    """A patched server whose compiled copy kernels do not load refuses every layout, so no
    case would restore: the run must say it expects that (``expect_refusals``), and a run that
    says so must have such a server."""
    if arm != "patched" or base not in REFUSING_BASES:
        return None
    kernels = versions.get("lmcache_compiled_kernels") is not False
    if not kernels and not expect_refusals:
        return (
            f"LMCache's compiled copy kernels do not load with the engines' torch "
            f"{versions.get('torch')}: the patched server would refuse every case and restore "
            "nothing. Build the wheel with --kernels against this torch, or pass "
            "--expect-refusals (HYBRIDFA_GATE_EXPECT_REFUSALS=1) to judge the refusals"
        )
    if kernels and expect_refusals:
        return "--expect-refusals, but LMCache's compiled copy kernels load: nothing is refused"
    return None


def start_report(
    kind: str, arm: str, python: str, lmcache_dir: Path, out: Path
) -> tuple[Path, dict[str, Any], str | None]:
    """A run's results stem (``<out>/<kind>-<date>-<arm>``), its report header (date,
    hardware, versions) and why the arm cannot run with ``lmcache_dir``, if it cannot."""
    out.mkdir(parents=True, exist_ok=True)
    date = _dt.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    envinfo = collect_environment(python, lmcache_dir)
    report: dict[str, Any] = {"arm": arm, "date": date, "lmcache_dir": str(lmcache_dir), **envinfo}
    problem = arm_problem(arm, envinfo["versions"], lmcache_dir)
    return out / f"{kind}-{date}-{arm}", report, problem


def run_matrix(
    cases: Iterable[Case], rc: RunConfig, on_progress: Callable[[dict], None] | None = None
) -> dict[str, Any]:
    """Run cases, ``rc.jobs`` at a time, rewriting the report after every case."""
    t0 = time.monotonic()
    cases = list(cases)
    stem, report, problem = start_report("gpu-gate", rc.arm, rc.python, rc.lmcache_dir, rc.out)
    report["cases"] = []

    def flush() -> None:
        report["elapsed_s"] = round(time.monotonic() - t0, 1)
        write_report(report, stem)

    if problem:
        report["error"] = problem
        flush()
        return report
    rc.base = report["base"] = lmcache_base(report["versions"])
    rc.kernels = report["versions"].get("lmcache_compiled_kernels") is not False
    report["expect_refusals"] = rc.expect_refusals
    if problem := kernels_problem(rc.arm, rc.base, report["versions"], rc.expect_refusals):
        report["error"] = problem
        flush()
        return report
    cold_runs = ColdRuns()
    lock = threading.Lock()
    order = {c.case_id: i for i, c in enumerate(cases)}

    def one(case: Case) -> None:
        rec = run_case(case, rc, cold_runs)
        rec["vllm"] = report["versions"].get("vllm")
        with lock:
            report["cases"].append(rec)
            report["cases"].sort(key=lambda r: order[r["case"]])
            flush()
            if on_progress:
                on_progress(rec)

    if rc.jobs <= 1:
        for case in cases:
            one(case)
    else:
        with ThreadPoolExecutor(max_workers=rc.jobs) as pool:
            for fut in [pool.submit(one, c) for c in cases]:
                fut.result()
    return {**report, "json_path": f"{stem}.json", "md_path": f"{stem}.md"}
