"""CPU tests of bench/gpu_restore.py's pure helpers (and its step flow with fake processes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from script_modules import BENCH_DIR, load_script

bench = load_script("hybridfa_bench_gpu", BENCH_DIR / "gpu_restore.py")
gate = bench.gate


def test_9b_class_geometry_on_flashinfer_and_flash_attn() -> None:
    m = bench.MODELS["qwen35-9b"]
    assert bench.layer_counts(m) == (24, 8)
    # attention 2*4*256*2 = 4096 B/token; GDN page 49152 + 2097152 B -> N = 16*33
    assert gate.attn_bytes_per_token(m) == 4096
    assert gate.mamba_page_bytes(m) == 2146304
    assert bench.backend_geometry(m, "FLASHINFER") == gate.Geometry(528, 16, 33)
    assert bench.backend_geometry(m, "FLASH_ATTN") == gate.Geometry(528, 528, 1)


def test_small_model_is_the_gates_ratio_17() -> None:
    assert bench.backend_geometry(bench.MODELS["qwen35-r17"], "FLASHINFER") == gate.Geometry(
        544, 32, 17
    )


@pytest.mark.parametrize("name", ["qwen35-r17", "qwen35-9b"])
def test_patched_chunk_bytes_match_the_gate_and_pristine_moves_1_over_r_of_fa(name: str) -> None:
    m = bench.MODELS[name]
    g = gate.expected_geometry(m)
    pa = bench.chunk_bytes(m, 2 * g.block_size, "patched")
    pr = bench.chunk_bytes(m, 2 * g.block_size, "pristine")
    assert pa["total"] == gate.expected_chunk_bytes(m, 2 * g.block_size)
    assert pr["gdn"] == pa["gdn"]
    assert pr["fa"] * g.ratio == pa["fa"]


def test_pristine_bytes_match_the_gpu_gate_observation() -> None:
    # results/gpu-gate-2026-11-29T104041-pristine.json: olmo-r25, chunk 2N -> 19922944 B
    m = gate.MODELS["olmo-r25"]
    assert bench.chunk_bytes(m, 3200, "pristine")["total"] == 19922944
    assert bench.chunk_bytes(m, 3200, "patched")["total"] == 26214400


def test_flash_attn_has_nothing_for_pristine_to_drop() -> None:
    m = bench.MODELS["qwen35-9b"]
    assert bench.chunk_bytes(m, 528, "pristine", "FLASH_ATTN") == bench.chunk_bytes(
        m, 528, "patched", "FLASH_ATTN"
    )


def test_chunk_must_be_a_multiple_of_n() -> None:
    with pytest.raises(ValueError):
        bench.chunk_bytes(bench.MODELS["qwen35-9b"], 512, "patched")


def test_l1_holds_every_chunk() -> None:
    assert bench.l1_size_gb(10**9) == 4
    assert bench.l1_size_gb(16 * 10**9) == 22


def test_parse_server_log_and_rates() -> None:
    text = "\n".join(
        [
            "[x] INFO Stored 544 tokens in 0.010 seconds (mod.py:1)",
            "[x] INFO Stored 544 tokens in 0.030 seconds",
            "[x] INFO Stored 3 Q tokens in 1.000 seconds",
            "Prefetch request completed (L1+L2): 52/52 retained keys (0 L1, 52 L2) in 53.5 ms (x)",
            "\x1b[1mRetrieved 1088 tokens in 0.020 seconds\x1b[0m",
        ]
    )
    p = bench.parse_server_log(text)
    assert p["stored"] == [(544, 0.010), (544, 0.030)]
    assert p["retrieved"] == [(1088, 0.020)]
    assert p["prefetch"] == [(52, 52, 0, 52, pytest.approx(0.0535))]
    st = bench.transfer_rate(p["stored"], bytes_per_token=1000)
    assert st["bytes"] == 1088000 and st["gbps"] == pytest.approx(1088000 / 0.04 / 1e9)
    pf = bench.prefetch_rate(p["prefetch"], object_bytes=1e6)
    assert pf["bytes"] == 52_000_000 and pf["gbps"] == pytest.approx(52e6 / 0.0535 / 1e9)
    assert bench.transfer_rate([], 10)["gbps"] is None


def test_ttft_prefers_request_metrics() -> None:
    assert bench.ttft_of({"ok": True, "gen_s": 2.0, "metrics": {"first_token_latency": 1.5}}) == 1.5
    assert bench.ttft_of({"ok": True, "gen_s": 2.0, "metrics": None}) == 2.0
    assert bench.ttft_of({"ok": False, "gen_s": 2.0}) is None
    assert bench.ratio(10.0, 0.5) == 20.0 and bench.ratio(None, 1.0) is None


def _restore_rec(
    speedup: float, after_prefetch_s: float | None, ttft: float = 4.0
) -> dict[str, Any]:
    """A restore of 100 objects of 1 GB (chunk 500) whose TTFT is ``ttft`` seconds."""
    rec: dict[str, Any] = {
        "ok": True,
        "kind": "restore",
        "chunk": 500,
        "hit_tokens": 50_000,
        "l2": {"bytes_per_object": 1e9},
        "speedup_ttft": speedup,
        "restore_ttft_s": ttft,
        "restore_effective_gbps": 100e9 / ttft / 1e9,
        "retrieve_log": {"gbps": 9000.0},  # enqueue time: must never be used
    }
    if after_prefetch_s is not None:
        rec["prefetch_lines"] = [
            (2, 2, 0, 2, 0.1),  # the warm-up request
            (100, 100, 0, 100, ttft - after_prefetch_s),
        ]
    return rec


def test_restore_breakdown_uses_the_restored_requests_prefetch() -> None:
    b = bench.restore_breakdown(_restore_rec(1.0, after_prefetch_s=2.0))
    assert b is not None and b["prefetch_exact"]
    assert b["prefetch_s"] == pytest.approx(2.0) and b["after_prefetch_s"] == pytest.approx(2.0)
    assert b["prefetch_gbps"] == pytest.approx(50.0)
    assert b["retrieve_gbps_lower_bound"] == pytest.approx(50.0)
    assert b["prefetch_share_of_ttft"] == pytest.approx(0.5)


def test_restore_breakdown_splits_a_summed_prefetch_by_objects() -> None:
    rec = _restore_rec(1.0, after_prefetch_s=None)
    rec["prefetch_log"] = {"l2_objects": 102, "seconds": 3.06}
    b = bench.restore_breakdown(rec)
    assert b is not None and not b["prefetch_exact"]
    assert b["prefetch_s"] == pytest.approx(3.0)
    assert b["retrieve_gbps_lower_bound"] == pytest.approx(100.0)


def test_targets_met_and_missed() -> None:
    b = bench.BIG_MODEL
    res = {
        "records": {
            f"restore:{b}:FLASHINFER:patched:26624": _restore_rec(12.0, 2.0),
            f"restore:{b}:FLASHINFER:patched:131072": _restore_rec(15.0, 4.0 / 3, ttft=8.0),
            f"restore:{b}:FLASH_ATTN:patched:131072": _restore_rec(15.0, 1.0, ttft=8.0),
            "pinned": {"ok": True, "h2d_gbps": 125.0},
        }
    }
    got = {t["target"]: t for t in bench.evaluate_targets(res)}
    assert got["ttft_speedup_26k"]["met"] and not got["ttft_speedup_128k"]["met"]
    assert got["retrieve_vs_flash_attn"]["value"] == pytest.approx(0.75)
    assert not got["retrieve_vs_flash_attn"]["met"]
    assert got["retrieve_vs_pinned_h2d"]["value"] == pytest.approx(0.6)
    assert got["retrieve_vs_pinned_h2d"]["met"]
    assert "lower bound" in got["retrieve_vs_pinned_h2d"]["detail"]


def test_targets_fall_back_to_effective_rate_and_missing_is_missed() -> None:
    b = bench.BIG_MODEL
    rec = _restore_rec(3.0, None, ttft=4.0)  # no prefetch lines: hit bytes / TTFT = 25 GB/s
    res = {"records": {f"restore:{b}:FLASHINFER:patched:8192": rec}}
    got = {t["target"]: t for t in bench.evaluate_targets(res)}
    assert got["ttft_speedup_26k"]["value"] is None and not got["ttft_speedup_26k"]["met"]
    assert got["retrieve_vs_pinned_h2d"]["value"] is None  # no pinned probe
    res["records"]["pinned"] = {"ok": True, "h2d_gbps": 50.0}
    got = {t["target"]: t for t in bench.evaluate_targets(res)}
    assert got["retrieve_vs_pinned_h2d"]["value"] == pytest.approx(0.5)
    assert "restore TTFT" in got["retrieve_vs_pinned_h2d"]["detail"]


def test_step_ids_round_trip_and_selection() -> None:
    steps = bench.default_steps("patched")
    assert [s.id for s in steps[:2]] == ["pinned", "disk"]
    assert len(steps) == 2 + 8 + len(bench.FA_LENGTHS)
    for s in steps:
        assert bench.parse_step_id(s.id) == s
    sel = bench.select_steps("restore:qwen35-9b:FLASH_ATTN:patched:.*", "patched")
    assert [s.prompt_tokens for s in sel] == list(bench.LENGTHS)
    assert {s.kind for s in bench.default_steps("pristine")} == {"bytes"}
    assert len(bench.default_steps("patched", plain_cold=True)) == len(steps) + 8


def test_markdown_report_renders_partial_results(tmp_path: Path) -> None:
    path = tmp_path / "bench-gpu-x.json"
    res = bench.load_results(path)
    rec = _restore_rec(12.0, 20.0)
    rec.update(
        id="restore:qwen35-9b:FLASHINFER:patched:26624",
        model="qwen35-9b",
        backend="FLASHINFER",
        arm="patched",
        prompt_tokens=26624,
        geometry={"block_size": 528, "kernel_page": 16, "ratio": 33},
        expected_chunk_bytes=bench.chunk_bytes(bench.MODELS["qwen35-9b"], 528, "patched"),
        l2={"bytes_per_object": 69206016.0},
    )
    res["records"][rec["id"]] = rec
    res["records"]["bad"] = {
        "ok": False,
        "kind": "restore",
        "model": "qwen35-r17",
        "backend": "FLASHINFER",
        "prompt_tokens": 8192,
        "errors": ["boom"],
    }
    bench.write_results(res, path)
    again = bench.load_results(path)
    assert again["records"].keys() == res["records"].keys()
    md = path.with_suffix(".md").read_text()
    assert "| qwen35-9b | FLASHINFER | 528/16/33 | 26624 |" in md
    assert "ERROR: boom" in md and "ttft_speedup_26k: 12 vs >= 10.0: met" in md


def test_restore_step_flow_with_fake_server_and_engines(tmp_path: Path, monkeypatch) -> None:
    step = bench.Step("restore", "qwen35-r17", "FLASHINFER", "patched", 8192)
    n = 544
    obj = bench.chunk_bytes(step.spec, n, "patched")["total"]
    logs: list[str] = [
        "Stored 8160 tokens in 0.100 seconds\n",
        "Prefetch request completed (L1+L2): 15/15 retained keys (0 L1, 15 L2) in 50.0 ms\n"
        "Retrieved 8160 tokens in 0.020 seconds\n"
        "L0<->L1 stats [cuda:0] cumulative: store ops=0 tokens=0 size=0.00GB avg_copy=n/a"
        " | retrieve ops=1 tokens=8160 size=0.13GB avg_copy=40.00GB/s\n",
    ]

    class FakeProc:
        pid = 0

    def start_server(py, env, port, chunk, l2, log, timeout=180.0, l1_size_gb=4, extra_args=()):
        assert chunk == n and l1_size_gb >= 4
        assert tuple(extra_args) == bench.SERVER_STATS_ARGS
        log.write_text(logs.pop(0))
        return FakeProc()

    def run_engine(py, env, spec, wd, role, timeout):
        json.dumps(spec)  # what engine_proc reads must serialise
        assert spec["new_tokens"] == 1 and spec["attention_backend"] == "FLASHINFER"
        assert spec["max_num_batched_tokens"] == 2 * n - 1
        if role == "store":
            for i in range(15):
                (Path(spec["l2"]) / f"m@0x1000000@0x0@{i:04x}.data").write_bytes(b"\0" * obj)
            return {
                "ok": True,
                "gen_s": 4.0,
                "engine_up_s": 30.0,
                "cache_block_size": n,
                "metrics": {"first_token_latency": 3.9},
                "num_cached_tokens": 0,
            }
        return {
            "ok": True,
            "gen_s": 0.4,
            "engine_up_s": 30.0,
            "cache_block_size": n,
            "metrics": {"first_token_latency": 0.39},
            "num_cached_tokens": 8160,
        }

    monkeypatch.setattr(gate, "start_server", start_server)
    monkeypatch.setattr(gate, "run_engine", run_engine)
    monkeypatch.setattr(gate, "kill_group", lambda p: None)
    monkeypatch.setattr(gate, "wait_l2_stable", lambda root, k, timeout=0: gate.l2_inventory(root))
    node = bench.Node(arm="patched", lmcache_dir=tmp_path, work=tmp_path / "w")
    rec = bench.run_store_restore_step(step, node)
    assert rec["ok"], rec["errors"]
    assert rec["l2"]["bytes_per_object"] == obj
    assert rec["speedup_ttft"] == pytest.approx(10.0)
    assert rec["store_log"]["bytes"] == 15 * obj
    assert rec["breakdown"]["prefetch_s"] == pytest.approx(0.05)
    assert rec["breakdown"]["after_prefetch_s"] == pytest.approx(0.39 - 0.05)
    assert rec["prefetch_log"]["gbps"] == pytest.approx(15 * obj / 0.05 / 1e9)
    assert rec["page_cache"]["files"] == 15
    assert rec["copy_stats"]["retrieve"]["copy_gbps"] == 40.0 and rec["store_copy_stats"] is None
    assert not (tmp_path / "w" / step.id.replace(":", "_") / "l2").exists()


def test_disk_probe_runs_on_any_filesystem(tmp_path: Path) -> None:
    res = bench.disk_probe(tmp_path, gib=1 / 64, block=1 << 20)
    assert res["ok"] and res["write_gbps"] > 0
    assert res["cold_read"]["bytes"] == res["bytes"] == res["warm_read"]["bytes"]
    assert "gbps" in res["direct_read"] or "error" in res["direct_read"]
    assert not (tmp_path / "bench-disk-probe.bin").exists()


def test_restore_breakdown_with_fa_and_gdn_objects_apart() -> None:
    # GDN-last-chunk prototype: FA objects (1 GB) for every hit chunk, GDN (3 GB) for the last.
    rec = _restore_rec(1.0, after_prefetch_s=2.0)
    rec["expected_chunk_bytes"] = {"fa": 1e9, "gdn": 3e9, "total": 4e9}
    rec["l2"] = {
        "per_object_group": {
            "0": {"objects": 100, "bytes": 300e9},
            "1": {"objects": 100, "bytes": 100e9},
        }
    }
    rec["prefetch_lines"] = [(2, 4, 0, 2, 0.1), (101, 200, 0, 101, 2.0)]
    assert bench.chunk_object_bytes(rec) == pytest.approx(4e9)
    b = bench.restore_breakdown(rec)
    assert b is not None and b["hit_bytes"] == pytest.approx(103e9)
    assert b["prefetch_gbps"] == pytest.approx(51.5)


def test_restored_bytes_of_one_object_group_is_every_hit_chunk() -> None:
    rec = _restore_rec(1.0, after_prefetch_s=2.0)
    assert bench.restored_bytes(rec, 100) == pytest.approx(100e9)
    assert bench.chunk_object_bytes(rec) == pytest.approx(1e9)


def test_copy_stats_parse_lmcaches_own_line() -> None:
    from lmcache.v1.mp_observability.subscribers.logging.extra_stats import (
        _format_side,
        _TransferStats,
    )

    store = _format_side("store", _TransferStats(3, 1584, 207_000_000, 207_000_000, 0.02))
    none = _format_side("store", _TransferStats())
    retrieve = _format_side("retrieve", _TransferStats(2, 27456, 3_600_000_000, 3.6e9, 0.1))
    log = (
        f"L0<->L1 stats [cuda:0] cumulative: {none} | {retrieve}\n"
        f"INFO L0<->L1 stats [cuda:0] last 1.0s: {store} | {retrieve}\n"
        f"INFO L0<->L1 stats [cuda:0] cumulative: {store} | {retrieve}\n"
    )
    got = bench.parse_copy_stats(log)
    assert got == {
        "device": "cuda:0",
        "store": {"ops": 3, "tokens": 1584, "gb": 0.21, "copy_gbps": 10.35},
        "retrieve": {"ops": 2, "tokens": 27456, "gb": 3.6, "copy_gbps": 36.0},
    }
    first = bench.parse_copy_stats(log.splitlines()[0])
    assert first is not None and first["store"]["copy_gbps"] is None
    assert bench.parse_copy_stats("no stats here") is None


def test_retrieve_rate_prefers_the_stream_timed_copy() -> None:
    rec = _restore_rec(1.0, after_prefetch_s=2.0)
    assert bench._retrieve_gbps(rec)[0] == pytest.approx(50.0)
    rec["copy_stats"] = {"retrieve": {"tokens": 50_000, "copy_gbps": 41.5}}
    assert bench._retrieve_gbps(rec) == (41.5, "LMCache's stream-timed H2D copy")


def test_a_restore_from_the_page_cache_is_labelled_in_table_and_targets(tmp_path: Path) -> None:
    b = bench.BIG_MODEL
    rec = _restore_rec(12.0, 2.0)
    rec.update(model=b, backend="FLASHINFER", prompt_tokens=26624, page_cache={"dropped": False})
    res = bench.load_results(tmp_path / "x.json")
    res["records"][f"restore:{b}:FLASHINFER:patched:26624"] = rec
    got = {t["target"]: t for t in bench.evaluate_targets(res)}
    assert "page cache" in got["ttft_speedup_26k"]["detail"]
    md = bench.markdown_report(res)
    assert md.splitlines()[
        [i for i, x in enumerate(md.splitlines()) if "| 26624 |" in x][0]
    ].endswith("| kept |")
    rec["page_cache"] = {"dropped": True}
    assert "page cache" not in bench.evaluate_targets(res)[0]["detail"]
    assert "| dropped |" in bench.markdown_report(res)


def test_a_copy_rate_is_reported_only_when_it_covers_the_restore() -> None:
    warm_up_only = {"retrieve": {"ops": 1, "tokens": 1056, "gb": 0.1, "copy_gbps": 13.5}}
    assert bench.timed_copy_gbps(warm_up_only, "retrieve", 26400) is None
    both = {"retrieve": {"ops": 2, "tokens": 27456, "gb": 3.6, "copy_gbps": 33.5}}
    assert bench.timed_copy_gbps(both, "retrieve", 26400) == 33.5
    assert bench.timed_copy_gbps(None, "retrieve", 26400) is None
    assert bench.timed_copy_gbps(both, "retrieve", None) is None


def test_both_arms_add_their_records_to_one_results_file(tmp_path: Path, monkeypatch) -> None:
    env = {"versions": {}, "hardware": {}, "server_args": []}
    monkeypatch.setattr(gate, "collect_environment", lambda py, d: env)
    monkeypatch.setattr(gate, "arm_problem", lambda arm, v, d: None)
    monkeypatch.setattr(bench, "run_step", lambda s, node, gib: {"ok": True})
    path = tmp_path / "bench-gpu-x.json"
    for arm in ("patched", "pristine"):
        node = bench.Node(arm=arm, lmcache_dir=tmp_path, work=tmp_path / "w")
        bench.run_steps(bench.default_steps(arm)[:1], node, path)
    res = bench.load_results(path)
    assert [r["arm"] for r in res["runs"]] == ["patched", "pristine"]
    assert set(res["records"]) == {"pinned", "bytes:qwen35-r17:FLASHINFER:pristine:8192"}
