"""CPU tests of the GPU fault case and load script (tests/gpu/fault_kill_mid_store.py,
tests/gpu/load.py) and of engine_proc.py's load role: every pure part, and both scripts'
process flow with fake servers and engines. No GPU, no vLLM engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import pytest
from script_modules import GPU_DIR
from script_modules import load_script as _load

load = _load("hybridfa_gpu_load", GPU_DIR / "load.py")
fault = _load("hybridfa_gpu_fault", GPU_DIR / "fault_kill_mid_store.py")
engine_proc = _load("hybridfa_gpu_engine_proc_load", GPU_DIR / "engine_proc.py")
gate = load.gate
assert fault.gate is gate


def _obj(l2: Path, i: int, size: int = 64, rank: int = 0) -> Path:
    p = l2 / f"m~hfa-ab@0x{(1 << 24) | (rank << 16):x}@0x0@{i:04x}.data"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"\1" * size)
    return p


# --- the scripts import without vLLM, torch, lmcache or blake3 --------------------------


def test_scripts_import_and_plan_without_vllm_torch_or_lmcache(tmp_path: Path) -> None:
    code = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("vllm", "torch", "lmcache", "blake3", "numpy"):
            raise ImportError("blocked " + name)
sys.meta_path.insert(0, Block())
sys.path.insert(0, {str(GPU_DIR)!r})
import engine_proc, fault_kill_mid_store, load
assert fault_kill_mid_store.main(["--plan"]) == 0
assert load.main(["--plan", "--duration", "420"]) == 0
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cp = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert cp.returncode == 0, cp.stderr[-2000:]
    assert '"kill_target": 60' in cp.stdout and '"phase_ends_s"' in cp.stdout


# --- workload ---------------------------------------------------------------------------

W = load.Workload(families=3, members=4, prefix_chunks=2, distinct=5, seed=7)
CHUNK = 80


def test_pool_is_deterministic_and_shares_exactly_the_family_prefix() -> None:
    pool = load.make_pool(W, CHUNK)
    assert pool == load.make_pool(W, CHUNK)
    assert pool != load.make_pool(
        load.Workload(families=3, members=4, prefix_chunks=2, distinct=5), CHUNK
    )
    assert len(pool) == 3 * 4 + 5
    assert all(gate.TOKEN_LO <= t < gate.TOKEN_HI for e in pool for t in e.tokens)
    plen = W.prefix_chunks * CHUNK
    for f in range(W.families):
        members = [e.tokens for e in pool if e.family == f]
        assert len(members) == W.members
        assert len({m[:plen] for m in members}) == 1  # one shared prefix of whole chunks
        assert len({m[plen] for m in members}) == W.members  # suffixes start differently
        for m in members:
            lo, hi = W.suffix_chunks
            assert round(lo * CHUNK) <= len(m) - plen <= round(hi * CHUNK)
    distinct = [e for e in pool if e.kind == "distinct"]
    assert all(e.family == -1 for e in distinct)
    heads = [e.tokens[0] for e in distinct] + [
        next(e.tokens[0] for e in pool if e.family == f) for f in range(W.families)
    ]
    assert len(set(heads)) == len(heads)  # nothing shares a first block across groups


def test_block_keys_are_chained_prefix_hashes() -> None:
    pool = load.make_pool(W, CHUNK)
    n = 40  # two blocks per chunk
    a, b = [e.tokens for e in pool if e.family == 0][:2]
    ka, kb = load.block_keys(a, n), load.block_keys(b, n)
    assert len(ka) == len(a) // n
    shared = W.prefix_chunks * CHUNK // n
    assert ka[:shared] == kb[:shared] and ka[shared] != kb[shared]
    other = next(e.tokens for e in pool if e.family == 1)
    assert not set(load.block_keys(other, n)) & set(ka)
    changed = list(a)
    changed[3] += 1  # a change in block 0 changes every later key
    kc = load.block_keys(changed, n)
    assert all(x != y for x, y in zip(ka, kc, strict=True))
    objs = load.unique_chunks(pool, n, CHUNK)
    per_prompt = sum(len(e.tokens) // CHUNK for e in pool)
    assert len(objs) == per_prompt - W.families * (W.members - 1) * W.prefix_chunks


def test_request_sequence_is_deterministic_and_mixes_as_asked() -> None:
    pool = load.make_pool(W, CHUNK)
    s1 = load.request_sequence(pool, 4000, "7-0", 0.75)
    assert s1 == load.request_sequence(pool, 4000, "7-0", 0.75)
    assert s1 != load.request_sequence(pool, 4000, "7-1", 0.75)
    assert set(s1) == set(range(len(pool)))
    shared = sum(pool[i].kind == "shared" for i in s1) / len(s1)
    assert 0.72 < shared < 0.78
    only = load.request_sequence(pool, 100, "x", 1.0)
    assert all(pool[i].kind == "shared" for i in only)


# --- statistics -------------------------------------------------------------------------


def test_percentiles_and_summary() -> None:
    xs = list(range(1, 101))
    assert load.percentile(xs, 50) == pytest.approx(50.5)
    assert load.percentile(xs, 90) == pytest.approx(90.1)
    assert load.percentile(xs, 99) == pytest.approx(99.01)
    assert load.percentile([3.0], 99) == 3.0
    assert load.percentile([], 50) is None
    s = load.latency_summary([0.2, None, 0.4, 0.1])
    assert s["n"] == 3 and s["p50"] == pytest.approx(0.2) and s["max"] == 0.4
    assert s["mean"] == pytest.approx(0.7 / 3)
    assert load.latency_summary([])["p99"] is None
    assert load.rate(10, 4.0) == 2.5 and load.rate(3, 0) is None


# --- reference hashes and verification --------------------------------------------------


def _rep(blocks: dict[int, str], gdn: dict[int, str] | None = None, rank: int = 0) -> dict:
    return {
        "rank": rank,
        "fa": {"fa.3": {str(j): h for j, h in blocks.items()}},
        "gdn": {"gdn.0": {str(j): h for j, h in (gdn or {}).items()}},
    }


def test_flatten_hashes_and_reference_map() -> None:
    flat = load.flatten_hashes([_rep({0: "a", 1: "b"}, {1: "g"}), {"rank": 1, "missing": True}])
    assert flat == {0: {"0:fa:fa.3": "a"}, 1: {"0:fa:fa.3": "b", "0:gdn:gdn.0": "g"}}
    ref = load.ReferenceMap()
    ref.add("k1", {"0:fa:fa.3": "a"}, phase=0)
    ref.add("k1", {"0:fa:fa.3": "a", "0:gdn:gdn.0": "g"}, phase=1)
    assert len(ref) == 1 and ref.first_phase["k1"] == 0 and ref.variants() == 0
    ok = ref.check("k1", {"0:fa:fa.3": "a", "0:gdn:gdn.0": "g"})
    assert ok["known"] and ok["compared"] == 2 and not ok["bad"]
    bad = ref.check("k1", {"0:fa:fa.3": "X", "0:gdn:gdn.0": "g"})
    assert bad["bad"] == ["0:fa:fa.3"]
    partial = ref.check("k1", {"0:fa:fa.7": "z"})  # a layer never hashed as computed
    assert partial["compared"] == 0 and partial["unknown_layers"] == 1
    assert not ref.check("k2", {"0:fa:fa.3": "a"})["known"]
    ref.add("k1", {"0:fa:fa.3": "a2"}, phase=1)  # the same block computed in another batch
    assert ref.variants() == 1 and not ref.check("k1", {"0:fa:fa.3": "a2"})["bad"]


def _first(phase, seq, pool, verify=(), ref=(), hashes=None, ext=0, local=0, p=400, t=0.0):
    return {
        "t": "first",
        "phase": phase,
        "seq": seq,
        "pool": pool,
        "P": p,
        "local": local,
        "external": ext,
        "t_add": t,
        "t_first": t + 0.1,
        "verify": list(verify),
        "ref": list(ref),
        "hashes": hashes,
        "hash_s": 0.0,
    }


KEYS = [["k0", "k1", "k2", "k3", "k4"], ["k0", "k1", "x2", "x3", "x4"], ["d0", "d1"]]


def test_verify_restores_counts_verified_mismatched_and_unverified() -> None:
    firsts = [
        _first(
            0, 0, 0, ref=[0, 1, 2, 3], hashes=[_rep({0: "a", 1: "b", 2: "c", 3: "d"}, {3: "G"})]
        ),
        _first(0, 1, 1, ref=[2, 3], hashes=[_rep({2: "e", 3: "f"})], local=160),
        # after the restart: pool 0 restored blocks 0-3, all equal (GDN only at the boundary)
        _first(
            1,
            0,
            0,
            verify=[0, 1, 2, 3],
            ext=320,
            hashes=[_rep({0: "a", 1: "b", 2: "c", 3: "d"}, {3: "G"})],
        ),
        # pool 1: block 3 restored wrong (a pristine-like wrong page)
        _first(
            1,
            1,
            1,
            verify=[0, 1, 2, 3],
            ext=320,
            hashes=[_rep({0: "a", 1: "b", 2: "e", 3: "WRONG"})],
        ),
        # pool 2 was never computed while hashed: nothing to compare with
        _first(1, 2, 2, verify=[0, 1], ext=160, hashes=[_rep({0: "q", 1: "r"})]),
        # hash RPC failed: blocks unhashed
        {**_first(1, 3, 0, verify=[0, 1], ext=160), "hash_error": "RuntimeError: x"},
    ]
    res = load.verify_restores(firsts, KEYS)
    p1 = res["per_phase"]["1"]
    assert p1["restored_requests"] == 4 and p1["restored_blocks"] == 12
    assert p1["verified_blocks"] == 7 and p1["mismatch_blocks"] == 1
    assert p1["unverified_blocks"] == 2 and p1["unhashed_blocks"] == 2
    assert p1["hash_errors"] == 1 and p1["fully_verified_requests"] == 1
    assert p1["gdn_layers_compared"] == 1
    assert res["reference_blocks"] == 6 and res["reference_variants"] == 0
    assert res["mismatch_examples"] == [
        {"phase": 1, "seq": 1, "pool": 1, "block": 3, "layers": ["0:fa:fa.3"]}
    ]
    assert res["total"]["mismatch_blocks"] == 1


def test_lost_objects_from_two_inventories(tmp_path: Path) -> None:
    l2 = tmp_path / "l2"
    for i in range(4):
        _obj(l2, i)
    (l2 / "x.tmp").write_bytes(b"half")  # an interrupted write is not an object
    before = gate.l2_inventory(l2, with_files=True)
    assert before["objects"] == 4 and len(before["files"]) == 4
    assert "files" not in gate.l2_inventory(l2)  # the gate's own calls are unchanged
    _obj(l2, 0).unlink()
    _obj(l2, 1, size=10)
    _obj(l2, 9)  # a new object is not lost
    after = gate.l2_inventory(l2, with_files=True)
    lost = load.lost_objects(before["files"], after["files"])
    assert [Path(n).name[-9:] for n in lost["missing"]] == ["0000.data"]
    assert [Path(n).name[-9:] for n in lost["changed"]] == ["0001.data"]
    assert load.lost_objects(before["files"], before["files"]) == {"missing": [], "changed": []}


def _with_trailer(path: Path, payload: bytes) -> None:
    blake3 = pytest.importorskip("blake3")
    h = blake3.blake3(payload)
    h.update(path.name.encode())
    path.write_bytes(payload + load.TRAILER_MAGIC + h.digest())


def test_trailer_check_matches_the_fs_adapter(tmp_path: Path) -> None:
    l2 = tmp_path / "l2"
    good, bad, old = _obj(l2, 1), _obj(l2, 2), _obj(l2, 3)
    _with_trailer(good, b"\7" * 1000)
    _with_trailer(bad, b"\7" * 1000)
    data = bytearray(bad.read_bytes())
    data[10] ^= 1
    bad.write_bytes(bytes(data))
    assert load.trailer_ok(good) is True and load.trailer_ok(bad) is False
    assert load.trailer_ok(old) is None  # no trailer: written by pristine
    res = load.verify_trailers(l2, [good.name, bad.name, old.name, "gone.data"])
    assert res == {"checked": 3, "bad": [bad.name], "no_trailer": 1, "gone": 1}
    try:
        from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import _trailer
    except ImportError:
        return  # pristine lmcache has no trailer
    payload = b"\3" * 333
    assert good.read_bytes()[-load.TRAILER_LEN :] != _trailer(payload, good.name)
    _with_trailer(good, payload)
    assert good.read_bytes()[-load.TRAILER_LEN :] == _trailer(payload, good.name)


def test_read_jsonl_skips_a_line_cut_by_sigkill(tmp_path: Path) -> None:
    p = tmp_path / "r.jsonl"
    p.write_text('{"t": "first", "seq": 0}\n{"t": "done", "seq": 0}\n{"t": "fi')
    recs, bad = load.read_jsonl(p)
    assert [r["t"] for r in recs] == ["first", "done"] and bad == 1
    assert load.read_jsonl(tmp_path / "absent.jsonl") == ([], 0)


# --- phases and the report --------------------------------------------------------------


def _ends(duration, every=140.0, min_phase=75.0):
    ends, t, k = [], 0.0, 0
    while (e := load.next_phase_end(t, duration, every, min_phase, k == 0)) is not None:
        ends.append(e)
        t, k = e, k + 1
    return ends


def test_phase_plan() -> None:
    assert _ends(420) == [140, 280, 420]
    assert _ends(600) == [140, 280, 420, 600]
    assert _ends(200) == [200]  # no phase shorter than min_phase_s is left behind
    assert _ends(60) == [60]  # a smoke run still gets its one phase
    assert _ends(150, every=60, min_phase=40) == [60, 150]
    assert load.next_phase_end(300, 420, 140, 75, first=False) == 420
    assert load.next_phase_end(380, 420, 140, 75, first=False) is None


def _done(phase, seq, pool, ttft, t_done):
    return {"t": "done", "phase": phase, "seq": seq, "pool": pool, "ttft_s": ttft, "t_done": t_done}


def _synthetic_run():
    h = [_rep({0: "a", 1: "b", 2: "c", 3: "d"})]
    p0 = [
        _first(0, 0, 0, ref=[0, 1, 2, 3], hashes=h, p=400, t=0.0),
        _first(0, 1, 0, local=320, p=400, t=1.0),
        _done(0, 0, 0, 1.0, 2.0),
        _done(0, 1, 0, 0.2, 3.0),
    ]
    p1 = [
        _first(1, 0, 0, verify=[0, 1, 2, 3], ext=320, hashes=h, p=400, t=10.0),
        _first(1, 1, 0, local=320, p=400, t=11.0),
        _done(1, 0, 0, 0.5, 12.0),
        _done(1, 1, 0, 0.1, 13.0),
    ]
    phases = [
        {
            "engine_up_s": 40,
            "load": {"load_start_epoch": 0.0, "load_end_epoch": 4.0},
            "l2_objects": 5,
        },
        {
            "engine_up_s": 38,
            "load": {"load_start_epoch": 10.0, "load_end_epoch": 14.0},
            "l2_objects": 5,
        },
    ]
    snaps = [{f"o{i}.data": 64 for i in range(5)}, {f"o{i}.data": 64 for i in range(5)}]
    return phases, [p0, p1], snaps


def test_analyze_arithmetic_and_verdict() -> None:
    phases, records, snaps = _synthetic_run()
    a = load.analyze(phases, records, KEYS, snaps, {"checked": 5, "bad": []})
    t = a["totals"]
    assert a["pass"], a["problems"]
    assert t["restarts"] == 1 and t["completed"] == 4 and t["load_s"] == 8.0
    assert t["requests_per_s"] == pytest.approx(0.5)
    assert t["external_hit_pct"] == pytest.approx(100 * 320 / 1600)
    assert t["total_hit_pct"] == pytest.approx(100 * (320 * 3) / 1600)
    assert t["requests_with_external_hit_pct"] == pytest.approx(25.0)
    assert t["restored_requests_after_restart"] == 1
    assert t["restore_ttft_after_restart"]["n"] == 1
    assert t["restore_ttft_after_restart"]["p50"] == pytest.approx(0.5)
    assert t["ttft"]["p50"] == pytest.approx(0.35)
    assert t["verified_blocks"] == 4 and t["mismatch_blocks"] == 0 and t["lost_objects"] == 0
    ph1 = a["per_phase"][1]
    assert ph1["requests_per_s"] == pytest.approx(0.5) and ph1["external_hit_pct"] == 40.0
    assert ph1["verify"]["verified_blocks"] == 4
    md = load.markdown_report(
        {"arm": "patched", "date": "D", "analysis": a, "phases": phases, "config": {}}
    )
    assert "**PASS**" in md and "| 1 | 38 | 4 | 2 | 0.5 | 40 | 1 |" in md
    assert "| 4/0/0 | - | 5 |" in md


def test_analyze_fails_on_mismatch_lost_unreadable_or_no_restart() -> None:
    phases, records, snaps = _synthetic_run()
    records[1][0]["hashes"] = [_rep({0: "a", 1: "b", 2: "c", 3: "WRONG"})]
    snaps[1] = {k: v for k, v in snaps[1].items() if k != "o1.data"}
    a = load.analyze(phases, records, KEYS, snaps, {"checked": 4, "bad": ["o2.data"]})
    assert not a["pass"]
    assert a["totals"]["mismatch_blocks"] == 1
    assert a["totals"]["lost_objects"] == 2 and a["lost_names"] == ["o1.data", "o2.data"]
    assert a["totals"]["unreadable_objects"] == 1
    md = load.markdown_report({"arm": "pristine", "date": "D", "analysis": a, "config": {}})
    assert "**FAIL**" in md and "Mismatches" in md
    phases[1]["server"] = {"l2_discards": 2}
    d = load.analyze(phases, records, KEYS, snaps, None)
    assert d["totals"]["discarded_damaged_objects"] == 2
    assert any("damaged" in p for p in d["problems"])
    one = load.analyze(phases[:1], records[:1], KEYS, snaps[:1], None)
    assert not one["pass"] and any("no restart" in p for p in one["problems"])
    assert "not finished" in load.markdown_report({"arm": "patched", "date": "D", "phases": [{}]})


def test_phase_spec(tmp_path: Path) -> None:
    cfg = load.LoadConfig(arm="patched", lmcache_dir=tmp_path, out=tmp_path, workload=W)
    pool = load.make_pool(W, cfg.case.chunk)
    n = cfg.case.geometry.block_size
    keys = [load.block_keys(e.tokens, n) for e in pool]
    spec = load.phase_spec(cfg, tmp_path, 5555, 1, pool, keys, 1000.0, tmp_path, tmp_path / "l2")
    json.dumps(spec)  # what engine_proc reads must serialise
    assert spec["role"] == "load" and spec["phase"] == 1 and spec["concurrency"] == 64
    assert spec["stop_admitting_epoch"] == 975.0 and spec["end_epoch"] == 990.0
    assert spec["exit_epoch"] == 998.0 and spec["log_stats"] and spec["new_tokens"] == 8
    assert spec["load_window_end_epoch"] == 975.0 and spec["min_load_s"] == 45.0
    assert "kill_epoch" not in spec
    assert spec["max_model_len"] >= max(len(e.tokens) for e in pool) + 8
    assert spec["max_num_batched_tokens"] == 2 * n - 1 and spec["kv_cache_memory_bytes"] == 8 << 30
    assert spec["lmcache"]["extra_config"]["lmcache.mp.port"] == 5555
    assert "prompt" not in spec and len(spec["warmup"]) == 2 * n + 3
    other = load.phase_spec(cfg, tmp_path, 5555, 2, pool, keys, 1000.0, tmp_path, tmp_path)
    assert other["sequence"] != spec["sequence"] and other["pool"] == spec["pool"]
    hard = load.LoadConfig(arm="patched", lmcache_dir=tmp_path, out=tmp_path, kill="hard")
    hs = load.phase_spec(hard, tmp_path, 1, 0, pool, keys, 1000.0, tmp_path, tmp_path)
    assert hs["stop_admitting_epoch"] > 1000.0  # the SIGKILL at kill_epoch ends the phase
    assert hs["kill_epoch"] == hs["load_window_end_epoch"] == 1000.0


def test_an_engine_ready_late_still_gets_its_minimum_load_window(tmp_path: Path) -> None:
    # The first load run (2026-11-29): the engine was ready 8 s after its phase's end (JIT on a
    # fresh node), was killed by the parent's timeout, and the whole run admitted nothing.
    cfg = load.LoadConfig(arm="patched", lmcache_dir=tmp_path, out=tmp_path, workload=W)
    pool = load.make_pool(W, cfg.case.chunk)
    keys = [load.block_keys(e.tokens, cfg.case.geometry.block_size) for e in pool]
    spec = load.phase_spec(cfg, tmp_path, 1, 0, pool, keys, 1000.0, tmp_path, tmp_path)
    assert load.shift_deadlines(dict(spec), 900.0) == 0.0  # ready in time
    late = dict(spec)
    shift = load.shift_deadlines(late, 1008.0)
    assert shift == 1008.0 + 45.0 - 975.0
    assert late["stop_admitting_epoch"] == 1053.0 and late["end_epoch"] == 990.0 + shift
    assert late["exit_epoch"] == 998.0 + shift and late["load_window_end_epoch"] == 1053.0
    hard_cfg = load.LoadConfig(arm="patched", lmcache_dir=tmp_path, out=tmp_path, kill="hard")
    hard = load.phase_spec(hard_cfg, tmp_path, 1, 0, pool, keys, 1000.0, tmp_path, tmp_path)
    assert load.shift_deadlines(hard, 990.0) == 35.0 and hard["kill_epoch"] == 1035.0


# --- load.py's flow with a fake server and fake engines ---------------------------------


class _FakeProc:
    pid = 0


def _fake_load_engine(l2: Path, pool_keys, wrong: bool = False, lose: bool = False):
    """One phase of engine_proc's load role: phase 0 computes pool entry 0 (reference
    hashes) and stores 4 chunk objects; later phases restore them (verify hashes)."""

    def run_engine(py, env, spec, wd, role, timeout):
        json.dumps(spec)
        k = spec["phase"]
        assert role == f"load{k}" and spec["concurrency"] == 4
        good = {j: f"h{j}" for j in range(2)}  # pool entry 0 shares 2 whole chunks
        rows = []
        if k == 0:
            rows.append(_first(0, 0, 0, ref=range(2), hashes=[_rep(good)], t=1.0))
            for i in range(4):
                _obj(l2, i)
        else:
            got = {**good, 1: "bad"} if wrong else good
            rows.append(_first(k, 0, 0, verify=range(2), ext=160, hashes=[_rep(got)], t=1.0))
            if lose and k == 1:
                next(iter(sorted(l2.glob("*.data")))).unlink()
        time.sleep(max(0.0, spec["exit_epoch"] + 2.0 - time.time()))  # until its phase ends
        rows.append(_done(k, 0, 0, 0.3, 2.0))
        Path(spec["records_path"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return {
            "ok": True,
            "rc": 0,
            "engine_up_s": 1.0,
            "load": {"load_start_epoch": 1.0, "load_end_epoch": 3.0, "completed": 1},
        }

    return run_engine


def _flow_config(tmp_path: Path, **kw: Any) -> Any:
    """Three 1-second phases of the olmo-r5 load on the fakes below."""
    return load.LoadConfig(
        arm="patched",
        lmcache_dir=tmp_path,
        out=tmp_path,
        model="olmo-r5",
        concurrency=4,
        duration=3.0,
        restart_every=1.0,
        min_phase_s=0.5,
        workload=W,
        work=tmp_path / "w",
        **kw,
    )


def _fake_flow(
    monkeypatch, cfg: Any, wrong: bool = False, lose: bool = False
) -> tuple[list[int], list[Any]]:
    """Fake servers and engines for load.run_load; returns (server ports, killed procs)."""
    l2 = cfg.work / "patched" / "l2"
    servers: list[int] = []
    killed: list[Any] = []

    def start_server(py, env, port, chunk, l2_dir, log, timeout=180.0, l1_size_gb=4):
        assert l2_dir == l2 and chunk == 80 and l1_size_gb == cfg.l1_size_gb
        log.write_text("Stored 80 tokens\n")
        servers.append(port)
        return _FakeProc()

    monkeypatch.setattr(gate, "start_server", start_server)
    monkeypatch.setattr(gate, "run_engine", _fake_load_engine(l2, None, wrong, lose))
    monkeypatch.setattr(gate, "kill_group", killed.append)
    return servers, killed


@pytest.mark.parametrize("wrong,lose", [(False, False), (True, False), (False, True)])
def test_load_flow_with_fakes(tmp_path: Path, monkeypatch, wrong: bool, lose: bool) -> None:
    cfg = _flow_config(tmp_path)
    l2 = cfg.work / "patched" / "l2"
    servers, killed = _fake_flow(monkeypatch, cfg, wrong, lose)
    report: dict[str, Any] = {"arm": "patched", "date": "D"}
    load.run_load(cfg, report)
    a = report["analysis"]
    assert len(report["phases"]) == 3 and len(killed) == len(servers) == 3
    assert a["totals"]["restarts"] == 2 and a["totals"]["completed"] == 3
    assert a["totals"]["verified_blocks"] + a["totals"]["mismatch_blocks"] > 0
    assert a["trailers"]["no_trailer"] >= 3  # the fake objects carry no trailer
    assert a["pass"] is (not wrong and not lose)
    if wrong:
        assert a["totals"]["mismatch_blocks"] >= 1
    if lose:
        assert a["totals"]["lost_objects"] >= 1
    assert not l2.exists()  # removed unless --keep-l2


# --- the load role: request loop, prefill split, block hashes ------------------------


def test_blocks_to_hash() -> None:
    keys = [f"k{j}" for j in range(10)]
    # nothing cached: reference = every block of complete chunks (chunk = 2 blocks)
    v, r = load.blocks_to_hash(10 * 80 + 30, 80, 160, 0, 0, keys, {}, 2)
    assert v == [] and r == list(range(10))
    v, r = load.blocks_to_hash(9 * 80 + 30, 80, 160, 0, 0, keys, {}, 2)
    assert r == list(range(8))  # block 8 lies in an incomplete chunk: never stored
    # local prefix hit of 2 blocks, LMCache restored 4 more: verify those, reference the rest
    v, r = load.blocks_to_hash(10 * 80 + 30, 80, 160, 160, 320, keys, {"k7": 2}, 2)
    assert v == [2, 3, 4, 5] and r == [6, 8, 9]
    # full hit up to the last chunk boundary
    v, r = load.blocks_to_hash(800, 80, 160, 0, 640, keys, {}, 2)
    assert v == list(range(8)) and r == [8, 9]


def test_prefill_tap_keeps_the_local_external_split() -> None:
    stats = NS(num_local_cached_tokens=160, num_external_cached_tokens=320)
    outs = NS(
        outputs=[
            NS(request_id="r1-abc", prefill_stats=stats),
            NS(request_id="r2", prefill_stats=None),
        ]
    )
    client = NS(get_output=lambda: outs)
    tap = engine_proc.PrefillTap(client)
    assert client.get_output() is outs
    assert tap.stats == {"r1-abc": (160, 320)}


class _FakeEngine:
    """LLMEngine stand-in: a request emits its first token 2 steps after admission and
    finishes 2 steps later; its prefill split arrives through the tapped client."""

    def __init__(self, split) -> None:
        self.t = 0
        self.reqs: dict[str, dict] = {}
        self.max_inflight = 0
        self.client = NS(get_output=self._core)
        self.split = split
        self.tap = engine_proc.PrefillTap(self.client)

    def add_request(self, ext, prompt, params):
        rid = f"{ext}-int"
        self.reqs[ext] = {"rid": rid, "age": 0, "prompt": prompt, "emitted": False}
        self.max_inflight = max(self.max_inflight, len(self.reqs))
        return rid

    def _core(self):
        out = []
        for r in self.reqs.values():
            if r["age"] == 2 and not r["emitted"]:
                r["emitted"] = True
                out.append(NS(request_id=r["rid"], prefill_stats=NS(**self.split(r["prompt"]))))
        return NS(outputs=out)

    def step(self):
        self.t += 1
        for r in self.reqs.values():
            r["age"] += 1
        self.client.get_output()
        outs = []
        for ext, r in list(self.reqs.items()):
            if r["age"] >= 2:
                done = r["age"] >= 4
                toks = list(range(r["age"] - 1))
                outs.append(
                    NS(
                        request_id=ext,
                        outputs=[NS(token_ids=toks)],
                        finished=done,
                        num_cached_tokens=0,
                        metrics=NS(first_token_latency=0.25),
                    )
                )
                if done:
                    del self.reqs[ext]
        return outs


def test_load_loop_with_a_fake_engine() -> None:
    pool = [list(range(100, 100 + 400)), list(range(900, 900 + 250))]
    keys = [load.block_keys(p, 80) for p in pool]

    def split(prompt):
        ext = 320 if prompt[0] == 100 else 0
        return {"num_local_cached_tokens": 0, "num_external_cached_tokens": ext}

    eng = _FakeEngine(split)
    clock = {"t": 0.0}

    def now() -> float:
        clock["t"] += 0.01
        return clock["t"]

    calls: list[tuple] = []

    def hash_rpc(rid, p, only):
        calls.append((rid, p, tuple(only)))
        if p == 250 and sum(c[1] == 250 for c in calls) == 1:
            raise RuntimeError("boom")  # once: the next computation of these blocks retries
        return [_rep({j: f"h{j}" for j in only})]

    recs: list[dict] = []
    spec = {
        "pool": pool,
        "block_keys": keys,
        "sequence": [0, 1, 0],
        "block_size": 80,
        "chunk": 80,
        "phase": 1,
        "concurrency": 3,
        "ref_copies": 1,
        "stop_admitting_epoch": 1.0,
        "end_epoch": 50.0,
    }
    s = load.load_loop(eng, lambda t: t, None, hash_rpc, eng.tap.stats, spec, recs.append, now)
    firsts = [r for r in recs if r["t"] == "first"]
    dones = [r for r in recs if r["t"] == "done"]
    assert eng.max_inflight == 3
    assert s["admitted"] == len(firsts) == len(dones) == s["completed"] > 3
    assert s["inflight_at_end"] == 0 and not s["stopped_at_end"]
    assert s["hash_errors"] == 1
    assert s["no_prefill_stats"] == 0
    assert {r["phase"] for r in recs} == {1}
    r0 = [r for r in firsts if r["pool"] == 0]
    # 400 tokens = 5 whole chunks: 4 restored (verify), the 5th computed (reference, once)
    assert r0[0]["external"] == 320 and r0[0]["verify"] == [0, 1, 2, 3] and r0[0]["ref"] == [4]
    assert r0[0]["hashes"][0]["fa"]["fa.3"] == {str(j): f"h{j}" for j in range(5)}
    assert all(r["verify"] == [0, 1, 2, 3] and r["ref"] == [] for r in r0[1:])
    r1 = [r for r in firsts if r["pool"] == 1]
    assert r1[0]["ref"] == [0, 1, 2] and "boom" in r1[0]["hash_error"]
    assert r1[1]["ref"] == [0, 1, 2] and "hash_error" not in r1[1]  # retried
    assert all(r["ref"] == [] for r in r1[2:])  # ref_copies=1: hashed once per engine
    assert all(c[0].endswith("-int") for c in calls)  # internal ids reach the worker
    assert all(d["ttft_s"] == 0.25 and d["n_out"] == 3 for d in dones)
    # the hard stop ends the loop with requests in flight
    eng2 = _FakeEngine(split)
    clock["t"] = 0.0
    spec2 = {**spec, "stop_admitting_epoch": 100.0, "end_epoch": 0.05}
    s2 = load.load_loop(eng2, lambda t: t, None, hash_rpc, eng2.tap.stats, spec2, [].append, now)
    assert s2["stopped_at_end"] and s2["inflight_at_end"] == 3


def _runner(torch, n=80, r=5, page=16, blocks=([0, 3, 1, 2], [5, 3, 1, 2])):
    g = torch.Generator().manual_seed(3)
    fa = torch.randn(8 * r, 2, page, 8, generator=g).to(torch.bfloat16)
    gdn = [
        torch.randn(8, 3, 16, generator=g).to(torch.bfloat16),
        torch.randn(8, 2, 4, 4, generator=g),
    ]
    tokens = gate.make_prompt(3 * n + 10, seed=4)
    mr = NS(
        requests={"req-1-int": NS(prompt_token_ids=tokens, block_ids=blocks)},
        compilation_config=NS(
            static_forward_context={"fa.0": NS(kv_cache=fa), "gdn.0": NS(kv_cache=gdn)}
        ),
        kv_cache_config=NS(
            kv_cache_groups=[
                NS(kv_cache_spec=NS(block_size=n), layer_names=["gdn.0"]),
                NS(kv_cache_spec=NS(block_size=n), layer_names=["fa.0"]),
            ]
        ),
        _gate_blocks={gate.prompt_key(tokens): [list(b) for b in blocks]},
    )
    return NS(worker=NS(model_runner=mr, rank=0)), tokens


def test_block_hashes_of_a_running_request_equal_the_gates_hashes() -> None:
    torch = pytest.importorskip("torch")
    w, tokens = _runner(torch)
    full = engine_proc._rpc_kv_hashes(w, gate.prompt_key(tokens), len(tokens))
    some = engine_proc._rpc_block_hashes(w, "req-1-int", len(tokens), [1, 3])
    assert some["rank"] == 0 and "block_ids" not in some
    assert some["fa"]["fa.0"] == {j: full["fa"]["fa.0"][j] for j in ("1", "3")}
    assert some["gdn"]["gdn.0"] == {"1": full["gdn"]["gdn.0"]["1"]}  # block 3 is partial
    assert sorted(full["fa"]["fa.0"], key=int) == ["0", "1", "2", "3"]
    gone = engine_proc._rpc_block_hashes(w, "other", len(tokens), [0])
    assert gone["missing"] and load.flatten_hashes([gone]) == {}


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
    assert spec["prompt_key"] == gate.prompt_key(spec["prompt"])
    assert len(spec["warmup"]) < fc.case.chunk  # no L2 object but the long prompt's
    extra = spec["lmcache"]["extra_config"]
    assert extra["lmcache.mp.heartbeat_interval"] == 2.0 and extra["lmcache.mp.mq_timeout"] == 60.0
    assert spec["max_model_len"] >= len(spec["prompt"]) + gate.NEW_TOKENS
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

    monkeypatch.setattr(gate, "start_server", start_server)
    monkeypatch.setattr(gate, "run_engine", run_engine)
    monkeypatch.setattr(gate, "kill_group", kill_group)
    rec = fault.run_fault(fc, gate.ColdRuns())
    ev = rec["eval"]
    assert rec["kill"]["decision"] == "kill" and rec["kill_target"] == 6
    assert 6 <= ev["complete_objects"] < 20 and servers == ["server1.log", "server2.log"]
    assert ev["checks"]["killed mid-store"] and ev["checks"]["kill during the in-flight request"]
    assert ev["checks"]["hit within complete objects"]
    assert rec["store_log"]["degraded"] == 1 and rec["tmp_files_after_kill"] == 0
    assert ev["kv"]["match"] and ev["pass"], ev
    assert rec["server2"]["l2_discards"] == 0
    assert not l2.exists()


def test_gate_l2_discards() -> None:
    text = (
        "FSL2Adapter: a.data is not an intact 4096-byte object (digest mismatch); treating\n"
        "Incomplete read for b.data: expected 4096, got 100\n"
        "Incomplete O_DIRECT read for c.data: expected 4096, got 0\n"
        "Stored 80 tokens\n"
    )
    assert gate.l2_discards(text) == 3 and gate.l2_discards("") == 0


def test_fault_report_renders_an_engine_failure() -> None:
    ev = fault.evaluate_fault(None, None, None, {"decision": "not run"}, 0, 200, 80, 2.0, 10.0)
    assert not ev["pass"] and len(ev["errors"]) == 4 and not ev["checks"]["killed mid-store"]
    md = fault.markdown_report({"arm": "pristine", "date": "D", "eval": ev, "kill": {}})
    assert "**FAIL**" in md and "cold: no result" in md
