"""GPU fault case: the LMCache server SIGKILLed while an engine stores.

1. cold     engine without LMCache: the long prompt's greedy tokens, top-k logprobs and
            wall time, then the health request's time (the latency baselines);
2. store    LMCache server 1 + engine (engine_proc role ``fault-store``, heartbeat
            ``--heartbeat-s``): the long prompt (many chunks). This script watches the
            L2 folder and SIGKILLs server 1 as soon as it holds ``--kill-fraction`` of
            the prompt's chunk objects (at least one, fewer than all). The engine must
            finish that request and a further one (the health request) each within its
            cold time + ``--beats`` heartbeats + ``--margin-s``, and stay healthy;
3. restore  LMCache server 2 on the same folder + a fresh engine: the same prompt. The
            hit must not exceed the complete objects' tokens; every restored block's FA
            and GDN bytes must equal the storing engine's (compare_kv_hashes);
            tokens and logprobs must equal the cold run's.

Patched (the scheduler adapter's heartbeat) gives up on a dead server about two heartbeats
after it went silent;
pristine 0.5.3 blocks the scheduler's lookup for ``lmcache.mp.mq_timeout`` (``--mq-timeout-s``
here), so its further request misses the bound.

Usage on a GPU node, from the checkout root::

    python -m hybridfa_gate.fault --arm patched --lmcache-dir /tmp/lmc-patched --out results/

Only the standard library is imported; the gate's helpers run the processes.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridfa_gate.cases import Case
from hybridfa_gate.judge import compare_kv_hashes, compare_logprobs
from hybridfa_gate.l2 import folder_inventory
from hybridfa_gate.models import write_model_dir
from hybridfa_gate.options import add_case_args, case_args, use_compile_cache
from hybridfa_gate.procs import (
    ENGINE_TIMEOUT_S,
    ServerError,
    child_env,
    free_port,
    install_cleanup_handler,
    kill_group,
    run_engine,
    server_log_facts,
    start_server,
)
from hybridfa_gate.prompts import make_prompt, prompt_key
from hybridfa_gate.report import fmt, write_json_md
from hybridfa_gate.run import ColdRuns, slim, start_report
from hybridfa_gate.specs import RunConfig, engine_spec

SCHEMA = "hybridfa-gpu-fault-kill-mid-store/1"
DEGRADED = "entering degraded mode"  # HeartbeatThread's log line (worker and scheduler)


# ---------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------


def default_prompt_tokens(
    block: int, chunk: int, min_chunks: int = 60, min_tokens: int = 16000
) -> int:
    """Enough whole chunks that the prefill (one block per step in align mode) lasts
    seconds, plus an offset inside a block like the gate's offset prompts."""
    m = max(min_chunks, math.ceil(min_tokens / chunk))
    r = block // 2 + 7
    return m * chunk + (r + 1 if r % block == 0 else r)


def kill_target(expected: int, fraction: float) -> int:
    """Objects in L2 at which to kill: ``fraction`` of the prompt's, at least one and at
    most all but one (the kill must land mid-store)."""
    if expected < 2:
        raise ValueError(f"a mid-store kill needs a prompt of >= 2 chunks, not {expected}")
    return min(max(1, math.floor(expected * fraction)), expected - 1)


def kill_decision(complete: int, expected: int, target: int) -> str:
    """ "wait" (too few objects), "kill" (target <= complete < expected) or "missed" (every
    object already landed: the store finished before the watcher saw a partial folder)."""
    if complete >= expected:
        return "missed"
    if complete >= target:
        return "kill"
    return "wait"


def watch_and_kill(
    expected: int,
    target: int,
    inventory: Callable[[], dict[str, Any]],
    alive: Callable[[], bool],
    kill: Callable[[], None],
    poll_s: float = 0.05,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Poll the L2 folder while the store engine runs; kill the server at the target."""
    seen = 0
    while True:
        inv = inventory()
        seen = inv["objects"]
        decision = kill_decision(seen, expected, target)
        if decision == "kill":
            t = clock()
            kill()
            return {"decision": "kill", "t_kill_epoch": t, "objects_seen": seen}
        if decision == "missed":
            return {"decision": "missed", "t_epoch": clock(), "objects_seen": seen}
        if not alive():
            return {"decision": "engine_ended", "t_epoch": clock(), "objects_seen": seen}
        sleep(poll_s)


def bounded_latency(
    latency: float | None,
    baseline: float | None,
    heartbeat_s: float,
    margin_s: float,
    beats: float = 3.0,
) -> dict[str, Any]:
    """The request's latency against its cold time + ``beats`` heartbeats + a margin."""
    if latency is None or baseline is None:
        return {"latency_s": latency, "bound_s": None, "ok": False}
    bound = baseline + beats * heartbeat_s + margin_s
    return {"latency_s": latency, "baseline_s": baseline, "bound_s": bound, "ok": latency <= bound}


def _health_s(r: dict[str, Any] | None) -> float | None:
    h = (r or {}).get("health") or {}
    return h.get("s") if h.get("ok") else None


def evaluate_fault(
    cold: dict[str, Any] | None,
    store: dict[str, Any] | None,
    restore: dict[str, Any] | None,
    kill: dict[str, Any],
    complete_objects: int,
    expected_objects: int,
    chunk: int,
    heartbeat_s: float,
    margin_s: float,
    beats: float = 3.0,
) -> dict[str, Any]:
    """Checks of the fault case from the three engines' results and the kill record."""
    out: dict[str, Any] = {"errors": [], "checks": {}}
    for role, r in (("cold", cold), ("fault-store", store), ("restore", restore)):
        if not r or not r.get("ok"):
            out["errors"].append(f"{role}: {(r or {}).get('error', 'no result')}"[:2000])
    checks: dict[str, bool] = out["checks"]
    killed = kill.get("decision") == "kill"
    if not killed:
        out["errors"].append(
            f"server 1 was not killed mid-store ({kill.get('decision')}, "
            f"{kill.get('objects_seen')} of {expected_objects} objects seen)"
        )
    checks["killed mid-store"] = killed and 1 <= complete_objects < expected_objects
    out["complete_objects"] = complete_objects
    out["expected_objects"] = expected_objects
    if out["errors"]:
        out["pass"] = False
        return out
    assert cold is not None and store is not None and restore is not None
    req = store.get("request_epoch") or [None, None]
    t_kill = kill.get("t_kill_epoch")
    during = None not in (req[0], req[1], t_kill) and req[0] <= t_kill <= req[1]
    checks["kill during the in-flight request"] = bool(during)
    out["inflight"] = bounded_latency(
        store.get("gen_s"), cold.get("gen_s"), heartbeat_s, margin_s, beats
    )
    out["further"] = bounded_latency(
        _health_s(store), _health_s(cold), heartbeat_s, margin_s, beats
    )
    checks["in-flight request bounded"] = out["inflight"]["ok"]
    checks["further request bounded"] = out["further"]["ok"]
    lp_store, d_store = compare_logprobs(cold["logprobs"], store["logprobs"])
    checks["store engine healthy, output = cold"] = (
        bool((store.get("health") or {}).get("ok"))
        and store["tokens"] == cold["tokens"]
        and lp_store
        and (store.get("health") or {}).get("tokens") == (cold.get("health") or {}).get("tokens")
    )
    hit = int(restore.get("num_cached_tokens") or 0)
    out["hit_tokens"] = hit
    out["hit_bound_tokens"] = complete_objects * chunk
    if hit == 0:
        out["errors"].append(
            "no external hit after the restart: nothing restored, (a) proves nothing"
        )
    checks["hit within complete objects"] = 0 < hit <= complete_objects * chunk
    kv = compare_kv_hashes(store.get("kv_hashes"), restore.get("kv_hashes"), hit)
    out["kv"] = kv
    checks["restored KV = stored KV"] = bool(kv["match"]) and hit > 0
    lp_restore, d_restore = compare_logprobs(cold["logprobs"], restore["logprobs"])
    out["logprob_max_diff"] = {"store": d_store, "restore": d_restore}
    checks["restore tokens/logprobs = cold"] = restore["tokens"] == cold["tokens"] and lp_restore
    checks["restore engine healthy"] = bool((restore.get("health") or {}).get("ok"))
    out["pass"] = not out["errors"] and all(checks.values())
    return out


def markdown_report(report: dict[str, Any]) -> str:
    ev = report.get("eval") or {}
    cfg = report.get("config") or {}
    lines = [
        f"# GPU fault: LMCache server SIGKILLed mid-store, arm {report['arm']} ({report['date']})",
        "",
        f"- hardware: {report.get('hardware')}",
        f"- versions: {report.get('versions')}",
        f"- {cfg.get('model')} {cfg.get('layout')} N={cfg.get('block_size')} chunk "
        f"{cfg.get('chunk')}, prompt {cfg.get('prompt_tokens')} tokens "
        f"({ev.get('expected_objects')} chunk objects), heartbeat {cfg.get('heartbeat_s')} s, "
        f"mq_timeout {cfg.get('mq_timeout_s')} s, bound = cold + {cfg.get('beats')} x "
        f"heartbeat + {cfg.get('margin_s')} s",
        f"- kill: {report.get('kill')}; L2 after the kill: {ev.get('complete_objects')} complete "
        f"objects, {report.get('tmp_files_after_kill')} .tmp files",
        f"- **{'PASS' if ev.get('pass') else 'FAIL'}** (elapsed {report.get('elapsed_s')} s)",
        "",
        "| check | result |",
        "|---|---|",
    ]
    for name, ok in (ev.get("checks") or {}).items():
        lines.append(f"| {name} | {'yes' if ok else 'NO'} |")
    for key, label in (("inflight", "in-flight request"), ("further", "further request")):
        b = ev.get(key)
        if b:
            lines.append(
                f"| {label} latency s (bound) | {fmt(b.get('latency_s'))} "
                f"({fmt(b.get('bound_s'))}) |"
            )
    if "hit_tokens" in ev:
        kv = ev.get("kv") or {}
        lines.append(f"| hit tokens (bound) | {ev['hit_tokens']} ({ev.get('hit_bound_tokens')}) |")
        lines.append(
            f"| KV blocks equal FA, GDN | {kv.get('fa_blocks', 0) - kv.get('fa_bad', 0)}/"
            f"{kv.get('fa_blocks')}, {kv.get('gdn_blocks', 0) - kv.get('gdn_bad', 0)}/"
            f"{kv.get('gdn_blocks')} |"
        )
    facts = report.get("store_log") or {}
    if facts:
        lines.append(f"| store engine log: degraded-mode lines | {facts.get('degraded')} |")
    if ev.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {e[:800]}" for e in ev["errors"]]
    return "\n".join(lines) + "\n"


def count_tmp(root: Path) -> int:
    return sum(1 for p in Path(root).rglob("*.tmp"))


# ---------------------------------------------------------------------------------------
# GPU side
# ---------------------------------------------------------------------------------------


@dataclass
class FaultConfig:
    arm: str
    lmcache_dir: Path
    out: Path
    model: str = "olmo-r5"
    layout: str = "NHD"
    chunk_blocks: int = 1
    prompt_tokens: int | None = None
    kill_fraction: float = 0.3
    heartbeat_s: float = 2.0
    mq_timeout_s: float = 60.0
    margin_s: float = 10.0
    beats: float = 3.0
    poll_s: float = 0.05
    kv_cache_gib: float | None = None
    gpu_memory_utilization: float = 0.25
    engine_timeout: float = ENGINE_TIMEOUT_S
    keep_l2: bool = False
    work: Path = field(default_factory=lambda: Path("/tmp/hybridfa-gate"))
    python: str = sys.executable

    @property
    def case(self) -> Case:
        return Case(self.model, self.layout, self.chunk_blocks, exact=False)

    @property
    def prompt_len(self) -> int:
        g = self.case.geometry
        return self.prompt_tokens or default_prompt_tokens(g.block_size, self.case.chunk)


def fault_spec(fc: FaultConfig, role: str, model_dir: Path, port: int | None) -> dict[str, Any]:
    """The gate's engine spec with the long prompt, a warmup shorter than one chunk (so
    that every L2 object belongs to the long prompt) and a short heartbeat."""
    case = fc.case
    n, p = case.geometry.block_size, fc.prompt_len
    rc = RunConfig(
        arm=fc.arm,
        lmcache_dir=fc.lmcache_dir,
        out=fc.out,
        python=fc.python,
        gpu_memory_utilization=fc.gpu_memory_utilization,
        kv_cache_memory_bytes=int(fc.kv_cache_gib * 2**30) if fc.kv_cache_gib else None,
        engine_timeout=fc.engine_timeout,
        work=fc.work,
    )
    spec = engine_spec(case, role, model_dir, rc, port, None)
    prompt = make_prompt(p, seed=1)
    spec.update(
        prompt=prompt,
        prompt_key=prompt_key(prompt),
        max_model_len=p + 4 * n,
        warmup=make_prompt(max(16, case.chunk // 2), seed=2),
    )
    if port is not None:
        spec["lmcache"]["extra_config"].update(
            {
                "lmcache.mp.heartbeat_interval": fc.heartbeat_s,
                "lmcache.mp.mq_timeout": fc.mq_timeout_s,
            }
        )
    return spec


def run_fault(fc: FaultConfig, cold_runs: ColdRuns) -> dict[str, Any]:
    t0 = time.monotonic()
    case = fc.case
    chunk, p = case.chunk, fc.prompt_len
    expected = p // chunk
    target = kill_target(expected, fc.kill_fraction)
    wd = fc.work / fc.arm / f"fault-kill-mid-store-{case.model}-{case.layout}-c{case.chunk_blocks}N"
    shutil.rmtree(wd, ignore_errors=True)
    l2 = wd / "l2"
    l2.mkdir(parents=True)
    model_dir = write_model_dir(case.spec, fc.work / "models")
    env = child_env(fc.lmcache_dir, case.layout)
    rec: dict[str, Any] = {"kill_target": target}
    cold = cold_runs.get_or_run(
        ("fault-kill-mid-store", case.model, p, case.layout, case.tp),
        lambda: run_engine(
            fc.python, env, fault_spec(fc, "cold", model_dir, None), wd, "cold", fc.engine_timeout
        ),
    )
    store = restore = None
    kill: dict[str, Any] = {"decision": "not run"}
    servers: list[Any] = []
    try:
        port = free_port()
        srv1 = start_server(fc.python, env, port, chunk, l2, wd / "server1.log")
        servers.append(srv1)
        box: dict[str, Any] = {}
        spec = fault_spec(fc, "fault-store", model_dir, port)

        def store_engine() -> None:
            box["store"] = run_engine(fc.python, env, spec, wd, "fault-store", fc.engine_timeout)

        th = threading.Thread(target=store_engine, daemon=True)
        th.start()
        kill = watch_and_kill(
            expected,
            target,
            lambda: folder_inventory(l2),
            th.is_alive,
            lambda: kill_group(srv1),
            fc.poll_s,
        )
        th.join()
        store = box.get("store")
        kill_group(srv1)  # no-op after a kill; ends a server the watcher did not kill
        rec["l2_after_kill"] = folder_inventory(l2)
        rec["tmp_files_after_kill"] = count_tmp(l2)
        text = (wd / "server1.log").read_text(errors="replace")
        rec["server1"] = server_log_facts(text)
        store_log = (wd / "fault-store.log").read_text(errors="replace")
        rec["store_log"] = {"degraded": store_log.count(DEGRADED)}
        if store and store.get("ok") and kill.get("decision") == "kill":
            port = free_port()
            srv2 = start_server(fc.python, env, port, chunk, l2, wd / "server2.log")
            servers.append(srv2)
            restore = run_engine(
                fc.python,
                env,
                fault_spec(fc, "restore", model_dir, port),
                wd,
                "restore",
                fc.engine_timeout,
            )
            kill_group(srv2)
            text = (wd / "server2.log").read_text(errors="replace")
            rec["server2"] = server_log_facts(text)
    except (ServerError, OSError) as e:
        rec["server_error"] = str(e)[-3000:]
    finally:
        for s in servers:
            kill_group(s)
    rec["kill"] = kill
    complete = int((rec.get("l2_after_kill") or {}).get("objects", 0))
    ev = evaluate_fault(
        cold, store, restore, kill, complete, expected, chunk, fc.heartbeat_s, fc.margin_s, fc.beats
    )
    if rec.get("server_error"):
        ev["errors"].append(rec["server_error"][-1500:])
        ev["pass"] = False
    rec["eval"] = ev
    rec["engines"] = {
        role: slim(r) for role, r in (("cold", cold), ("fault-store", store), ("restore", restore))
    }
    rec["elapsed_s"] = round(time.monotonic() - t0, 1)
    if not fc.keep_l2:
        shutil.rmtree(l2, ignore_errors=True)
    return rec


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_case_args(ap, model="olmo-r5", work=Path("/tmp/hybridfa-gate"), kv_cache_gib=None)
    ap.add_argument("--prompt-tokens", type=int, default=None, help="default: >= 60 chunks")
    ap.add_argument("--kill-fraction", type=float, default=0.3)
    ap.add_argument("--heartbeat-s", type=float, default=2.0)
    ap.add_argument("--mq-timeout-s", type=float, default=60.0)
    ap.add_argument("--margin-s", type=float, default=10.0)
    ap.add_argument("--beats", type=float, default=3.0)
    ap.add_argument("--plan", action="store_true", help="print the case and exit")
    a = ap.parse_args(argv)
    use_compile_cache(a)
    if a.lmcache_dir is None and not a.plan:
        ap.error("--lmcache-dir is required (except with --plan)")
    fc = FaultConfig(
        **case_args(a),
        prompt_tokens=a.prompt_tokens,
        kill_fraction=a.kill_fraction,
        heartbeat_s=a.heartbeat_s,
        mq_timeout_s=a.mq_timeout_s,
        margin_s=a.margin_s,
        beats=a.beats,
    )
    g = fc.case.geometry
    config = {
        "model": fc.model,
        "layout": fc.layout,
        "block_size": g.block_size,
        "kernel_page": g.kernel_page,
        "chunk": fc.case.chunk,
        "prompt_tokens": fc.prompt_len,
        "expected_objects": fc.prompt_len // fc.case.chunk,
        "kill_target": kill_target(fc.prompt_len // fc.case.chunk, fc.kill_fraction),
        "heartbeat_s": fc.heartbeat_s,
        "mq_timeout_s": fc.mq_timeout_s,
        "margin_s": fc.margin_s,
        "beats": fc.beats,
    }
    if a.plan:
        print(json.dumps(config, indent=1))
        return 0
    stem, header, problem = start_report(
        "gpu-fault-kill-mid-store", fc.arm, fc.python, fc.lmcache_dir, fc.out
    )
    report: dict[str, Any] = {"schema": SCHEMA, **header, "config": config}
    if problem:
        report["error"] = problem
        write_json_md(stem, report, markdown_report(report))
        print(f"fault: {problem}", file=sys.stderr)
        return 2
    install_cleanup_handler()
    report.update(run_fault(fc, ColdRuns()))
    write_json_md(stem, report, markdown_report(report))
    print(markdown_report(report))
    return 0 if report["eval"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
