"""The GPU fault case, the LMCache server SIGKILLed mid-store (hybridfa_gate.fault): every pure
part, and its process flow with fake servers and engines; and that the GPU-side modules import
without vLLM, torch or lmcache. No GPU, no vLLM engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hybridfa_gate import engine_proc, fault, load, procs, prompts
from hybridfa_gate.run import ColdRuns

REPO = Path(__file__).resolve().parents[2]


def _obj(l2: Path, i: int, size: int = 64, rank: int = 0) -> Path:
    p = l2 / f"m~hfa-ab@0x{(1 << 24) | (rank << 16):x}@0x0@{i:04x}.data"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"\1" * size)
    return p


# --- the scripts import without vLLM, torch, lmcache or blake3 --------------------------


def test_scripts_import_and_plan_without_vllm_torch_or_lmcache(tmp_path: Path) -> None:
    code = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("vllm", "torch", "lmcache", "blake3", "numpy"):
            raise ImportError("blocked " + name)
sys.meta_path.insert(0, Block())
from hybridfa_gate import engine_proc, fault, load
from pathlib import Path
from typing import Any
assert fault.main(["--plan"]) == 0
cfg = load.LoadConfig(arm="patched", lmcache_dir=Path("."), out=Path("."))
print("pool", len(load.phase_spec(cfg, Path("model"), 1, 0, Path("work"))["pool"]))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cp = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert cp.returncode == 0, cp.stderr[-2000:]
    assert '"kill_target": 60' in cp.stdout and "pool 96" in cp.stdout


# --- fault case -------------------------------------------------------------------------


def test_default_prompt_and_kill_point() -> None:
    p = fault.default_prompt_tokens(80, 80)
    assert p // 80 == 200 and p % 80 != 0 and p >= 16000
    assert fault.default_prompt_tokens(544, 1088) // 1088 == 60
    assert fault.kill_target(200, 0.3) == 60
    assert fault.kill_target(3, 0.1) == 1 and fault.kill_target(3, 0.99) == 2
    with pytest.raises(ValueError):
        fault.kill_target(1, 0.5)
    assert [fault.kill_decision(c, 10, 3) for c in (0, 2, 3, 9, 10, 12)] == [
        "wait",
        "wait",
        "kill",
        "kill",
        "missed",
        "missed",
    ]


def test_watch_and_kill() -> None:
    def run(counts, alive_for=100):
        seq = iter(counts)
        killed, polls = [], []

        def inv():
            polls.append(1)
            return {"objects": next(seq)}

        res = fault.watch_and_kill(
            10,
            3,
            inv,
            lambda: len(polls) < alive_for,
            lambda: killed.append(1),
            0.0,
            lambda: 5.0,
            lambda s: None,
        )
        return res, killed

    res, killed = run([0, 0, 1, 2, 4, 9])
    assert res == {"decision": "kill", "t_kill_epoch": 5.0, "objects_seen": 4} and killed == [1]
    res, killed = run([0, 1, 10])
    assert res["decision"] == "missed" and not killed
    res, killed = run([0, 1, 2, 2, 2], alive_for=3)
    assert res["decision"] == "engine_ended" and not killed


def test_bounded_latency() -> None:
    b = fault.bounded_latency(9.0, 2.0, 2.0, 1.0)
    assert b["bound_s"] == 9.0 and b["ok"]
    assert not fault.bounded_latency(9.01, 2.0, 2.0, 1.0)["ok"]
    assert fault.bounded_latency(60.0, 0.3, 2.0, 10.0, beats=3)["bound_s"] == pytest.approx(16.3)
    assert not fault.bounded_latency(None, 2.0, 2.0, 1.0)["ok"]
    assert not fault.bounded_latency(1.0, None, 2.0, 1.0)["ok"]


def _engine(gen_s, health_s, tokens=(1, 2), cached=0, hashes=None, epoch=(100.0, 110.0)):
    return {
        "ok": True,
        "gen_s": gen_s,
        "tokens": list(tokens),
        "logprobs": [{"1": -0.5}, {"2": -0.25}],
        "num_cached_tokens": cached,
        "kv_hashes": hashes,
        "request_epoch": list(epoch),
        "health": {"ok": True, "s": health_s, "tokens": [5] * 8},
    }


def _kv(fa: dict[str, str], gdn: dict[str, str]) -> list[dict]:
    return [{"rank": 0, "block_size": 80, "fa": {"l3": fa}, "gdn": {"l0": gdn}}]


def _fault_inputs():
    fa = {str(j): f"f{j}" for j in range(6)}
    cold = _engine(8.0, 0.3)
    store = _engine(9.0, 5.0, hashes=_kv(fa, {"2": "g2", "5": "g5"}))
    restore = _engine(2.0, 0.3, cached=240, hashes=_kv(fa, {"2": "g2"}))
    kill = {"decision": "kill", "t_kill_epoch": 104.0, "objects_seen": 3}
    return cold, store, restore, kill


def test_evaluate_fault_pass() -> None:
    cold, store, restore, kill = _fault_inputs()
    ev = fault.evaluate_fault(cold, store, restore, kill, 3, 6, 80, 2.0, 10.0)
    assert ev["pass"], ev
    assert all(ev["checks"].values()) and len(ev["checks"]) == 9
    assert ev["further"]["bound_s"] == pytest.approx(16.3) and ev["inflight"]["bound_s"] == 24.0
    assert ev["hit_bound_tokens"] == 240 and ev["kv"]["match"]
    md = fault.markdown_report({"arm": "patched", "date": "D", "eval": ev, "config": {}})
    assert "**PASS**" in md and "| further request bounded | yes |" in md


def test_evaluate_fault_failures() -> None:
    def ev(**kw):
        cold, store, restore, kill = _fault_inputs()
        args = {"cold": cold, "store": store, "restore": restore, "kill": kill, "complete": 3}
        args.update(kw)
        return fault.evaluate_fault(
            args["cold"],
            args["store"],
            args["restore"],
            args["kill"],
            args["complete"],
            6,
            80,
            2.0,
            10.0,
        )

    cold, store, restore, kill = _fault_inputs()
    # pristine-like: the further request waited for mq_timeout (60 s)
    slow = dict(store, health={"ok": True, "s": 60.2, "tokens": [5] * 8})
    r = ev(store=slow)
    assert not r["pass"] and not r["checks"]["further request bounded"]
    # more restored than complete objects could hold
    r = ev(restore=dict(restore, num_cached_tokens=320))
    assert not r["checks"]["hit within complete objects"]
    # a restored FA block differs
    bad = _kv({**{str(j): f"f{j}" for j in range(6)}, "1": "X"}, {"2": "g2"})
    r = ev(restore=dict(restore, kv_hashes=bad))
    assert not r["pass"] and not r["checks"]["restored KV = stored KV"]
    # nothing restored proves nothing
    r = ev(restore=dict(restore, num_cached_tokens=0))
    assert not r["pass"] and any("no external hit" in e for e in r["errors"])
    # the kill came after the request ended: the in-flight check is void
    r = ev(kill=dict(kill, t_kill_epoch=111.0))
    assert not r["checks"]["kill during the in-flight request"]
    # the watcher never saw a partial folder
    r = ev(kill={"decision": "missed", "objects_seen": 6})
    assert not r["pass"] and "not killed mid-store" in r["errors"][0]
    # every object present after the kill is not mid-store either
    assert not ev(complete=6)["checks"]["killed mid-store"]
    # an engine that failed
    r = ev(store={"ok": False, "error": "Traceback"})
    assert not r["pass"] and r["errors"][0].startswith("fault-store: Traceback")
    # the store engine's own output changed
    assert not ev(store=dict(store, tokens=[9, 9]))["checks"]["store engine healthy, output = cold"]


def test_fault_spec(tmp_path: Path) -> None:
    fc = fault.FaultConfig(arm="patched", lmcache_dir=tmp_path, out=tmp_path, kv_cache_gib=4)
    spec = fault.fault_spec(fc, "fault-store", tmp_path, 4242)
    json.dumps(spec)
    assert spec["role"] == "fault-store" and len(spec["prompt"]) == fc.prompt_len == 16047
    assert spec["prompt_key"] == prompts.prompt_key(spec["prompt"])
    assert len(spec["warmup"]) < fc.case.chunk  # no L2 object but the long prompt's
    extra = spec["lmcache"]["extra_config"]
    assert extra["lmcache.mp.heartbeat_interval"] == 2.0 and extra["lmcache.mp.mq_timeout"] == 60.0
    assert spec["max_model_len"] >= len(spec["prompt"]) + prompts.NEW_TOKENS
    assert "l2" not in spec and spec["kv_cache_memory_bytes"] == 4 << 30
    assert "lmcache" not in fault.fault_spec(fc, "cold", tmp_path, None)
    assert "cold_reference" not in fault.fault_spec(fc, "restore", tmp_path, 4242)
    assert "fault-store" in engine_proc.HEALTH_ROLES


def test_fault_flow_with_fakes(tmp_path: Path, monkeypatch) -> None:
    """Server 1 stores objects one by one while the fake store engine runs; the watcher
    kills it mid-store; server 2 + the restore engine see what was complete."""
    fc = fault.FaultConfig(
        arm="patched",
        lmcache_dir=tmp_path,
        out=tmp_path,
        prompt_tokens=20 * 80 + 47,
        work=tmp_path / "w",
        poll_s=0.005,
    )
    l2 = fc.work / "patched" / "fault-kill-mid-store-olmo-r5-NHD-c1N" / "l2"
    dead = threading.Event()
    servers: list[str] = []

    class Proc:
        def __init__(self, name: str) -> None:
            self.name = name

    def start_server(py, env, port, chunk, l2_dir, log, timeout=180.0, l1_size_gb=4):
        assert l2_dir == l2 and chunk == 80
        log.write_text("")
        servers.append(log.name)
        return Proc(log.name)

    def kill_group(proc) -> None:
        if proc.name == "server1.log":
            dead.set()

    fa = {str(j): f"f{j}" for j in range(21)}

    def run_engine(py, env, spec, wd, role, timeout):
        json.dumps(spec)
        (wd / f"{role}.log").write_text("LMCache server is unhealthy — entering degraded mode\n")
        if role == "cold":
            return _engine(8.0, 0.3)
        if role == "fault-store":
            t0 = time.time()
            for i in range(20):
                if dead.is_set():
                    break
                _obj(l2, i)
                time.sleep(0.02)
            assert dead.wait(5)
            gdn = {str(j): f"g{j}" for j in range(20)}
            return _engine(9.0, 4.0, hashes=_kv(fa, gdn), epoch=(t0, time.time() + 0.1))
        n = len(list(l2.glob("*.data")))
        assert role == "restore" and 0 < n < 20
        # restored n chunks: the GDN checkpoint at the hit boundary, block n - 1
        return _engine(2.0, 0.3, cached=80 * n, hashes=_kv(fa, {str(n - 1): f"g{n - 1}"}))

    monkeypatch.setattr(fault, "start_server", start_server)
    monkeypatch.setattr(fault, "run_engine", run_engine)
    monkeypatch.setattr(fault, "kill_group", kill_group)
    rec = fault.run_fault(fc, ColdRuns())
    ev = rec["eval"]
    assert rec["kill"]["decision"] == "kill" and rec["kill_target"] == 6
    assert 6 <= ev["complete_objects"] < 20 and servers == ["server1.log", "server2.log"]
    assert ev["checks"]["killed mid-store"] and ev["checks"]["kill during the in-flight request"]
    assert ev["checks"]["hit within complete objects"]
    assert rec["store_log"]["degraded"] == 1 and rec["tmp_files_after_kill"] == 0
    assert ev["kv"]["match"] and ev["pass"], ev
    assert rec["server2"]["l2_discards"] == 0
    assert not l2.exists()


def test_server_log_facts_count_the_l2_objects_found_damaged() -> None:
    text = (
        "FSL2Adapter: a.data is not an intact 4096-byte object (digest mismatch); treating\n"
        "Incomplete read for b.data: expected 4096, got 100\n"
        "Incomplete O_DIRECT read for c.data: expected 4096, got 0\n"
        "FSL2Adapter: d.data is not an authentic 4096-byte object (no trailer); it is a miss.\n"
        "Stored 80 tokens\n"
    )
    assert procs.server_log_facts(text)["l2_discards"] == 4
    assert procs.server_log_facts("")["l2_discards"] == 0


def test_fault_report_renders_an_engine_failure() -> None:
    ev = fault.evaluate_fault(None, None, None, {"decision": "not run"}, 0, 200, 80, 2.0, 10.0)
    assert not ev["pass"] and len(ev["errors"]) == 4 and not ev["checks"]["killed mid-store"]
    md = fault.markdown_report({"arm": "pristine", "date": "D", "eval": ev, "kill": {}})
    assert "**FAIL**" in md and "cold: no result" in md


@pytest.mark.parametrize(("module", "config_name"), [(fault, "FaultConfig"), (load, "LoadConfig")])
def test_the_fault_and_load_runs_pass_their_engine_timeout_on(
    module: Any, config_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, float] = {}
    real = getattr(module, config_name)

    def config(**kw: object) -> object:
        cfg = real(**kw)
        seen["timeout"] = cfg.engine_timeout
        return cfg

    def start_report(*args: object) -> tuple[Path, dict, str]:
        return tmp_path / "r", {"arm": "patched", "date": "now"}, "stopped here"

    monkeypatch.setattr(module, "start_report", start_report)
    monkeypatch.setattr(module, config_name, config)
    argv = ["--lmcache-dir", str(tmp_path), "--out", str(tmp_path), "--engine-timeout", "900"]
    assert module.main(argv) == 2
    assert seen["timeout"] == 900.0
