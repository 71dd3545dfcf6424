"""The load run with restarts (hybridfa_gate.load) and the engine process's load role: every
pure part, and the run's process flow with fake servers and engines. No GPU, no vLLM engine."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import pytest

from hybridfa_gate import engine_proc, load, load_loop, prompts, worker
from hybridfa_gate.l2 import folder_inventory

REPO = Path(__file__).resolve().parents[2]


def _obj(l2: Path, i: int, size: int = 64, rank: int = 0) -> Path:
    p = l2 / f"m~hfa-ab@0x{(1 << 24) | (rank << 16):x}@0x0@{i:04x}.data"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"\1" * size)
    return p


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
    assert all(prompts.TOKEN_LO <= t < prompts.TOKEN_HI for e in pool for t in e.tokens)
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


def test_latency_summary_interpolates_between_ranks_like_numpy() -> None:
    s = load.latency_summary(range(1, 101))
    assert s["n"] == 100 and s["p50"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1) and s["p99"] == pytest.approx(99.01)
    s = load.latency_summary([0.2, None, 0.4, 0.1])
    assert s["n"] == 3 and s["p50"] == pytest.approx(0.2)
    assert load.latency_summary([3.0])["p99"] == 3.0
    assert load.latency_summary([]) == {"n": 0, "p50": None, "p90": None, "p99": None}


# --- reference hashes and verification --------------------------------------------------


def _rep(blocks: dict[int, str], gdn: dict[int, str] | None = None, rank: int = 0) -> dict:
    return {
        "rank": rank,
        "fa": {"fa.3": {str(j): h for j, h in blocks.items()}},
        "gdn": {"gdn.0": {str(j): h for j, h in (gdn or {}).items()}},
    }


def test_flatten_hashes() -> None:
    flat = load.flatten_hashes([_rep({0: "a", 1: "b"}, {1: "g"}), {"rank": 1, "missing": True}])
    assert flat == {0: {"0:fa:fa.3": "a"}, 1: {"0:fa:fa.3": "b", "0:gdn:gdn.0": "g"}}
    two = load.flatten_hashes([_rep({0: "a"}), _rep({0: "b"}, rank=1)])
    assert two == {0: {"0:fa:fa.3": "a", "1:fa:fa.3": "b"}}


def _rec(phase, seq, pool, verify=(), ref=(), hashes=None, ext=0, local=0, p=400, ttft=0.1):
    """One request's record, as the load role writes it when the request finishes."""
    return {
        "phase": phase,
        "seq": seq,
        "pool": pool,
        "P": p,
        "local": local,
        "external": ext,
        "verify": list(verify),
        "ref": list(ref),
        "hashes": hashes,
        "ttft_s": ttft,
        "n_out": 8,
    }


KEYS = [["k0", "k1", "k2", "k3", "k4"], ["k0", "k1", "x2", "x3", "x4"], ["d0", "d1"]]


def test_verify_restores_counts_verified_mismatched_and_unverified() -> None:
    firsts = [
        _rec(0, 0, 0, ref=[0, 1, 2, 3], hashes=[_rep({0: "a", 1: "b", 2: "c", 3: "d"}, {3: "G"})]),
        _rec(0, 1, 1, ref=[2, 3], hashes=[_rep({2: "e", 3: "f"})], local=160),
        # after the restart: pool 0 restored blocks 0-3, all equal (GDN only at the boundary)
        _rec(
            1,
            0,
            0,
            verify=[0, 1, 2, 3],
            ext=320,
            hashes=[_rep({0: "a", 1: "b", 2: "c", 3: "d"}, {3: "G"})],
        ),
        # pool 1: block 3 restored wrong (a pristine-like wrong page)
        _rec(
            1,
            1,
            1,
            verify=[0, 1, 2, 3],
            ext=320,
            hashes=[_rep({0: "a", 1: "b", 2: "e", 3: "WRONG"})],
        ),
        # pool 2 was never computed while hashed: nothing to compare with
        _rec(1, 2, 2, verify=[0, 1], ext=160, hashes=[_rep({0: "q", 1: "r"})]),
        # hash RPC failed: blocks unhashed
        {**_rec(1, 3, 0, verify=[0, 1], ext=160), "hash_error": "RuntimeError: x"},
    ]
    res = load.verify_restores(firsts, KEYS)
    p1 = res["per_phase"]["1"]
    assert p1["restored_blocks"] == 12
    assert p1["verified_blocks"] == 7 and p1["mismatch_blocks"] == 1
    assert p1["unverified_blocks"] == 2 and p1["unhashed_blocks"] == 2
    assert p1["hash_errors"] == 1 and p1["gdn_layers_compared"] == 1
    assert res["reference_blocks"] == 6 and res["reference_variants"] == 0
    assert res["mismatch_examples"] == [{"phase": 1, "seq": 1, "block": 3, "bad": ["0:fa:fa.3"]}]
    assert res["total"]["mismatch_blocks"] == 1


def test_a_block_computed_in_two_batches_verifies_against_either_result() -> None:
    computed = [
        _rec(0, 0, 0, ref=[0], hashes=[_rep({0: "a"})]),
        _rec(0, 1, 0, ref=[0], hashes=[_rep({0: "a2"})]),  # the same block, another batch
    ]
    restored = [
        _rec(1, k, 0, verify=[0], ext=80, hashes=[_rep({0: h})]) for k, h in enumerate("a2X")
    ]
    res = load.verify_restores(computed + restored[:1] + restored[2:], KEYS)
    assert res["reference_variants"] == 1 and res["per_phase"]["1"]["verified_blocks"] == 1
    assert res["per_phase"]["1"]["mismatch_blocks"] == 1  # "X" matches neither
    other_layer = _rec(
        1, 9, 0, verify=[0], ext=80, hashes=[{"rank": 0, "fa": {"fa.7": {"0": "z"}}}]
    )
    assert load.verify_restores([*computed, other_layer], KEYS)["total"]["unverified_blocks"] == 1


def test_lost_objects_from_two_inventories(tmp_path: Path) -> None:
    l2 = tmp_path / "l2"
    for i in range(4):
        _obj(l2, i)
    (l2 / "x.tmp").write_bytes(b"half")  # an interrupted write is not an object
    before = folder_inventory(l2, with_files=True)
    assert before["objects"] == 4 and len(before["files"]) == 4
    assert "files" not in folder_inventory(l2)  # the gate's own calls
    _obj(l2, 0).unlink()
    _obj(l2, 1, size=10)
    _obj(l2, 9)  # a new object is not lost
    after = folder_inventory(l2, with_files=True)
    lost = load.lost_objects([before["files"], after["files"]])
    assert [Path(n).name[-9:] for n in lost] == ["0000.data", "0001.data"]  # missing, resized
    assert load.lost_objects([before["files"], before["files"], after["files"]]) == lost
    assert load.lost_objects([before["files"]]) == []


def test_read_jsonl_skips_a_line_cut_by_sigkill(tmp_path: Path) -> None:
    p = tmp_path / "r.jsonl"
    p.write_text('{"t": "first", "seq": 0}\n{"t": "done", "seq": 0}\n{"t": "fi')
    assert [r["t"] for r in load.read_jsonl(p)] == ["first", "done"]
    assert load.read_jsonl(tmp_path / "absent.jsonl") == []


# --- phases and the report --------------------------------------------------------------


def _synthetic_run():
    h = [_rep({0: "a", 1: "b", 2: "c", 3: "d"})]
    records = [
        _rec(0, 0, 0, ref=[0, 1, 2, 3], hashes=h, ttft=1.0),
        _rec(0, 1, 0, local=320, ttft=0.2),
        _rec(1, 0, 0, verify=[0, 1, 2, 3], ext=320, hashes=h, ttft=0.5),
        _rec(1, 1, 0, local=320, ttft=0.1),
    ]
    phases = [
        {"phase": k, "engine_up_s": up, "l2_objects": 5, "load": {"completed": 2, **load_s}}
        for k, up, load_s in (
            (0, 40, {"load_start_epoch": 0.0, "load_end_epoch": 4.0}),
            (1, 38, {"load_start_epoch": 10.0, "load_end_epoch": 14.0}),
        )
    ]
    snaps = [{f"o{i}.data": 64 for i in range(5)}, {f"o{i}.data": 64 for i in range(5)}]
    return phases, records, snaps


def test_analyze_arithmetic_and_verdict() -> None:
    phases, records, snaps = _synthetic_run()
    a = load.analyze(phases, records, KEYS, snaps)
    t = a["totals"]
    assert a["pass"], a["problems"]
    assert t["restarts"] == 1 and t["completed"] == 4
    assert t["requests_per_s"] == pytest.approx(0.5)
    assert t["external_hit_pct"] == pytest.approx(100 * 320 / 1600)
    assert t["total_hit_pct"] == pytest.approx(100 * (320 * 3) / 1600)
    assert t["requests_with_external_hit"] == 1
    assert t["restore_ttft_after_restart"]["n"] == 1
    assert t["restore_ttft_after_restart"]["p50"] == pytest.approx(0.5)
    assert t["ttft"]["p50"] == pytest.approx(0.35)
    assert t["verified_blocks"] == 4 and t["mismatch_blocks"] == 0 and t["lost_objects"] == 0
    assert a["per_phase"]["1"]["verified_blocks"] == 4
    md = load.markdown_report(
        {"arm": "patched", "date": "D", "analysis": a, "phases": phases, "config": {}}
    )
    assert "**PASS**" in md and "| 1 | 38 | 4 | 2 | 4 / 0 / 0 / 0 | 5 |" in md
    assert "| restore_ttft_after_restart | 0.5 / 0.5 / 0.5 (n=1) |" in md


def test_analyze_fails_on_mismatch_lost_or_no_restart() -> None:
    phases, records, snaps = _synthetic_run()
    records[2]["hashes"] = [_rep({0: "a", 1: "b", 2: "c", 3: "WRONG"})]
    snaps[1] = {k: v for k, v in snaps[1].items() if k != "o1.data"}
    a = load.analyze(phases, records, KEYS, snaps)
    assert not a["pass"]
    assert a["totals"]["mismatch_blocks"] == 1
    assert a["totals"]["lost_objects"] == 1 and a["lost_names"] == ["o1.data"]
    md = load.markdown_report({"arm": "pristine", "date": "D", "analysis": a, "config": {}})
    assert "**FAIL**" in md and "Mismatches" in md
    phases[1]["server"] = {"l2_discards": 2}
    d = load.analyze(phases, records, KEYS, snaps)
    assert d["totals"]["discarded_damaged_objects"] == 2
    assert any("damaged" in p for p in d["problems"])
    one = load.analyze(phases[:1], records[:2], KEYS, snaps[:1])
    assert not one["pass"] and any("no restart" in p for p in one["problems"])
    running = {"arm": "patched", "date": "D", "phases": [{"phase": 0}]}
    assert "not finished" in load.markdown_report(running)


def test_phase_spec(tmp_path: Path) -> None:
    cfg = load.LoadConfig(arm="patched", lmcache_dir=tmp_path, out=tmp_path, workload=W)
    n = cfg.case.geometry.block_size
    spec = load.phase_spec(cfg, tmp_path, 5555, 1, tmp_path)
    json.dumps(spec)  # what engine_proc reads must serialise
    assert spec["role"] == "load" and spec["phase"] == 1 and spec["concurrency"] == 64
    assert spec["load_s"] == 60.0 and spec["drain_s"] == load.DRAIN_S  # from the engine's start
    assert spec["log_stats"] and spec["new_tokens"] == 8
    assert spec["block_keys"] == [load.block_keys(e.tokens, n) for e in cfg.pool]
    assert spec["max_model_len"] >= max(len(e.tokens) for e in cfg.pool) + 8
    assert spec["max_num_batched_tokens"] == 2 * n - 1 and spec["kv_cache_memory_bytes"] == 8 << 30
    assert spec["lmcache"]["extra_config"]["lmcache.mp.port"] == 5555
    assert len(spec["warmup"]) == 2 * n + 3 and spec["l2"] == str(tmp_path / "l2")
    other = load.phase_spec(cfg, tmp_path, 5555, 2, tmp_path)
    assert other["sequence"] != spec["sequence"] and other["pool"] == spec["pool"]


# --- the load run's flow with a fake server and fake engines ---------------------------------


class _FakeProc:
    pid = 0


def _fake_load_engine(l2: Path, pool_keys, wrong: bool = False, lose: bool = False):
    """One phase of engine_proc's load role: phase 0 computes pool entry 0 (reference
    hashes) and stores 4 chunk objects; later phases restore them (verify hashes)."""

    def run_engine(py, env, spec, wd, role, timeout):
        json.dumps(spec)
        k = spec["phase"]
        assert role == f"load{k}" and spec["concurrency"] == 4 and spec["load_s"] == 1.0
        good = {j: f"h{j}" for j in range(2)}  # pool entry 0 shares 2 whole chunks
        if k == 0:
            row = _rec(0, 0, 0, ref=range(2), hashes=[_rep(good)])
            for i in range(4):
                _obj(l2, i)
        else:
            got = {**good, 1: "bad"} if wrong else good
            row = _rec(k, 0, 0, verify=range(2), ext=160, hashes=[_rep(got)])
            if lose and k == 1:
                next(iter(sorted(l2.glob("*.data")))).unlink()
        Path(spec["records_path"]).write_text(json.dumps(row) + "\n")
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
        phases=3,
        phase_s=1.0,
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

    monkeypatch.setattr(load, "start_server", start_server)
    monkeypatch.setattr(load, "run_engine", _fake_load_engine(l2, None, wrong, lose))
    monkeypatch.setattr(load, "kill_group", killed.append)
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
    assert a["pass"] is (not wrong and not lose)
    if wrong:
        assert a["totals"]["mismatch_blocks"] >= 1
    if lose:
        assert a["totals"]["lost_objects"] >= 1
    assert not l2.exists()  # removed unless --keep-l2


# --- the load role: request loop, prefill split, block hashes ------------------------


def test_blocks_to_hash() -> None:
    keys = [f"k{j}" for j in range(10)]
    none: Counter[str] = Counter()
    # nothing cached: reference = every block of complete chunks (chunk = 2 blocks)
    v, r = load_loop.blocks_to_hash(10 * 80 + 30, 80, 160, 0, 0, keys, none)
    assert v == [] and r == list(range(10))
    v, r = load_loop.blocks_to_hash(9 * 80 + 30, 80, 160, 0, 0, keys, none)
    assert r == list(range(8))  # block 8 lies in an incomplete chunk: never stored
    # local prefix hit of 2 blocks, LMCache restored 4 more: verify those, reference the rest
    twice = Counter({"k7": load_loop.REF_COPIES})
    v, r = load_loop.blocks_to_hash(10 * 80 + 30, 80, 160, 160, 320, keys, twice)
    assert v == [2, 3, 4, 5] and r == [6, 8, 9]
    # full hit up to the last chunk boundary
    v, r = load_loop.blocks_to_hash(800, 80, 160, 0, 640, keys, none)
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
        "stop_admitting_epoch": 1.0,
        "end_epoch": 50.0,
    }

    def run(engine, spec, emit):
        submit = lambda ext, tokens: engine.add_request(ext, tokens, None)  # noqa: E731
        return load_loop.load_loop(submit, engine.step, hash_rpc, engine.tap.stats, spec, emit, now)

    s = run(eng, spec, recs.append)
    recs.sort(key=lambda r: r["seq"])
    assert eng.max_inflight == 3
    assert s["admitted"] == s["first_tokens"] == len(recs) == s["completed"] > 3
    assert s["inflight_at_end"] == 0
    assert s["hash_errors"] == 1
    assert s["no_prefill_stats"] == 0
    assert {r["phase"] for r in recs} == {1}
    r0 = [r for r in recs if r["pool"] == 0]
    # 400 tokens = 5 whole chunks: 4 restored (verify), the 5th computed (reference, twice)
    assert r0[0]["external"] == 320 and r0[0]["verify"] == [0, 1, 2, 3] and r0[0]["ref"] == [4]
    assert r0[0]["hashes"][0]["fa"]["fa.3"] == {str(j): f"h{j}" for j in range(5)}
    assert [r["ref"] for r in r0[:3]] == [[4], [4], []]  # REF_COPIES = 2 per engine
    assert all(r["verify"] == [0, 1, 2, 3] for r in r0)
    r1 = [r for r in recs if r["pool"] == 1]
    assert r1[0]["ref"] == [0, 1, 2] and "boom" in r1[0]["hash_error"]
    assert r1[1]["ref"] == [0, 1, 2] and "hash_error" not in r1[1]  # the next one retries
    assert [r["ref"] for r in r1[2:4]] == [[0, 1, 2], []]
    assert all(c[0].endswith("-int") for c in calls)  # internal ids reach the worker
    assert all(r["ttft_s"] == 0.25 and r["n_out"] == 3 and "rid" not in r for r in recs)
    # the hard stop ends the loop with requests in flight
    eng2 = _FakeEngine(split)
    clock["t"] = 0.0
    s2 = run(eng2, {**spec, "stop_admitting_epoch": 100.0, "end_epoch": 0.05}, [].append)
    assert s2["inflight_at_end"] == 3


def _runner(torch, n=80, r=5, page=16, blocks=([0, 3, 1, 2], [5, 3, 1, 2])):
    g = torch.Generator().manual_seed(3)
    fa = torch.randn(8 * r, 2, page, 8, generator=g).to(torch.bfloat16)
    gdn = [
        torch.randn(8, 3, 16, generator=g).to(torch.bfloat16),
        torch.randn(8, 2, 4, 4, generator=g),
    ]
    tokens = prompts.make_prompt(3 * n + 10, seed=4)
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
        _update_states=None,
        _gate_blocks={prompts.prompt_key(tokens): [list(b) for b in blocks]},
    )
    return NS(worker=NS(model_runner=mr, rank=0)), tokens


def test_block_hashes_of_a_running_request_equal_the_gates_hashes() -> None:
    torch = pytest.importorskip("torch")
    w, tokens = _runner(torch)
    full = worker.rpc_kv_hashes(w, prompts.prompt_key(tokens), len(tokens))
    some = worker.rpc_block_hashes(w, "req-1-int", len(tokens), [1, 3])
    assert some["rank"] == 0 and "block_ids" not in some
    assert some["fa"]["fa.0"] == {j: full["fa"]["fa.0"][j] for j in ("1", "3")}
    assert some["gdn"]["gdn.0"] == {"1": full["gdn"]["gdn.0"]["1"]}  # block 3 is partial
    assert sorted(full["fa"]["fa.0"], key=int) == ["0", "1", "2", "3"]
    gone = worker.rpc_block_hashes(w, "other", len(tokens), [0])
    assert gone["missing"] and load.flatten_hashes([gone]) == {}
