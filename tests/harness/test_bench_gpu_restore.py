"""The side-by-side restore bench (bench/gpu_restore.py), with small fakes for the engines and
LMCache servers it drives."""

from __future__ import annotations

import argparse
import inspect
import json
import time
from pathlib import Path
from typing import Any

import pytest

from bench import gpu_restore as bench
from bench import restore_report
from hybridfa_gate import engine_proc
from hybridfa_gate.models import attn_bytes_per_token

TINY = bench.MODELS["qwen35-r17"]  # N = 544
N = 544
T = 1_800_000_000.0  # an epoch with whole seconds, for log stamps


def stamp(t: float) -> str:
    """LMCache's log time (asctime, local) of epoch ``t``."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f",{round(t * 1000) % 1000:03d}"


def window(t1: float, last: float, tokens: int, gb: float, gbps: float) -> str:
    return (
        f"\x1b[32;20m[{stamp(t1)}] LMCache INFO:\x1b[0m L0<->L1 stats [cuda:0] last "
        f"{last:.1f}s: store ops=0 tokens=0 size=0.00GB avg_copy=n/a | retrieve ops=1 "
        f"tokens={tokens} size={gb:.2f}GB avg_copy={gbps:.2f}GB/s (extra_stats.py:160:x)\n"
    )


def prefetch(t: float, l2: int) -> str:
    return (
        f"[{stamp(t)}] LMCache INFO: Prefetch request completed (L1+L2): {l2}/{l2} retained "
        f"keys (0 L1, {l2} L2) in 80.0 ms (external_request_id=r)\n"
    )


def timed(ttft: float, hit: int, t0: float, t1: float, read: int = 0) -> dict[str, Any]:
    """One engine_proc request summary with its probe."""
    probe = [{"epoch": t0, "read_bytes": 1000}, {"epoch": t1, "read_bytes": 1000 + read}]
    return {
        "ttft_s": ttft,
        "num_cached_tokens": hit,
        "external_cached_tokens": hit,
        "local_cached_tokens": 0,
        "probe": probe,
    }


def hashes(hit: int, gdn: str = "g") -> list[dict[str, Any]]:
    """KV hashes of one rank whose restored GDN checkpoint is block hit/N - 1."""
    return [
        {
            "rank": 0,
            "block_size": N,
            "fa": {"fa0": {"0": "a", "1": "b"}},
            "gdn": {"gdn0": {str(hit // N - 1): gdn}},
        }
    ]


def restore_result(hits: tuple[int, int, int] = (2 * N, 2 * N, 2 * N), **kw: Any) -> dict[str, Any]:
    """A restore engine's result: warm-up (cold, W at T+1..2), A at T+10..11, a cold, B at
    T+20..21, a cold, D at T+30..31, a cold; TTFTs 0.5, 0.4, 0.6 for A, B, D."""
    return {
        "ok": True,
        **timed(0.5, hits[0], T + 10, T + 11, read=3_000),
        "kv_hashes": hashes(hits[0]),
        "tokens": [5, 6],
        "warm_first": {"cold": timed(2.0, 0, T, T + 0.9), "restore": timed(0.3, N, T + 1, T + 2)},
        "cold_reference": timed(4.0, 0, T + 12, T + 16),
        "timed_pairs": [
            {
                "restore": timed(0.4, hits[1], T + 20, T + 21, read=1_000),
                "cold": timed(5.0, 0, T + 22, T + 27),
            },
            {
                "restore": timed(0.6, hits[2], T + 30, T + 31, read=2_000),
                "cold": timed(3.0, 0, T + 32, T + 35),
            },
        ],
        **kw,
    }


STORE = {"ok": True, "kv_hashes": hashes(2 * N), "tokens": [5, 6]}


def new_row(arm: str = "default", p: int = 2 * N + 100) -> dict[str, Any]:
    return {"model": TINY.name, "prompt_tokens": p, "arm": arm, "errors": [], "findings": []}


# --- the disk bound ------------------------------------------------------------------------


def test_disk_bound_reads_at_the_disk_rate_then_copies_at_the_pinned_rate() -> None:
    rates = {"disk_read_gbps": 2.0, "page_cache_read_gbps": 10.0, "pinned_h2d_gbps": 50.0}
    row = {"arm": "default", "rates": rates, "read_bytes": 2e9, "restore_ttft_s": 1.3}
    b = restore_report.bound_of(row)
    assert b["bound_s"] == pytest.approx(1.0 + 0.04)
    assert b["bound_over_restore"] == pytest.approx(1.04 / 1.3)
    assert b["restore_over_bound"] == pytest.approx(1.3 / 1.04)


def test_the_page_cache_arms_bound_reads_at_the_page_cache_rate() -> None:
    rates = {"disk_read_gbps": 2.0, "page_cache_read_gbps": 10.0, "pinned_h2d_gbps": 50.0}
    row = {"arm": "pagecache", "rates": rates, "read_bytes": 2e9, "restore_ttft_s": 1.0}
    assert restore_report.bound_of(row)["bound_s"] == pytest.approx(0.2 + 0.04)


def test_no_bound_without_the_bytes_read() -> None:
    rates = {"disk_read_gbps": 2.0, "pinned_h2d_gbps": 50.0}
    row = {"arm": "default", "rates": rates, "restore_ttft_s": 1.0}
    assert restore_report.bound_of(row) is None


# --- restored bytes and H2D rates ------------------------------------------------------------


def test_server_log_windows_and_prefetch_lines_are_read_with_their_times() -> None:
    got = bench.parse_server_log(window(T + 1.5, 0.3, 1088, 0.25, 40.0) + prefetch(T + 0.25, 15))
    [w] = got["windows"]
    assert (w["t0"], w["t1"]) == (pytest.approx(T + 1.2), pytest.approx(T + 1.5))
    assert (w["ops"], w["tokens"], w["bytes"], w["gbps"]) == (1, 1088, 0.25e9, 40.0)
    assert got["prefetch"] == [{"t": pytest.approx(T + 0.25), "l1": 0, "l2": 15}]


def test_h2d_comes_from_the_timed_restores_window_not_the_warm_ups() -> None:
    log = window(T + 2, 0.5, N, 0.1, 9.0) + window(T + 11, 0.5, 2 * N, 1.0, 30.0)
    windows = bench.parse_server_log(log)["windows"]
    assert bench.timed_h2d(windows, [((T + 1, T + 2), N), ((T + 10, T + 11), 2 * N)]) == [
        pytest.approx(9.0),
        pytest.approx(30.0),
    ]


def test_h2d_is_null_when_the_timed_copies_cover_less_than_the_hit() -> None:
    windows = bench.parse_server_log(window(T + 11, 0.5, N, 1.0, 30.0))["windows"]
    assert bench.timed_h2d(windows, [((T + 10, T + 11), 2 * N)]) == [None]


def test_a_window_flushed_inside_the_next_restore_goes_to_the_one_it_covers() -> None:
    # A's last copies end in a window that the next restore's first copy start flushed
    windows = bench.parse_server_log(window(T + 20.5, 2.0, 2 * N, 1.0, 30.0))["windows"]
    spans = [((T + 18, T + 19), 2 * N), ((T + 20, T + 21), 2 * N)]
    assert bench.timed_h2d(windows, spans) == [pytest.approx(30.0), None]


def test_h2d_is_null_for_both_restores_whose_copies_share_a_window() -> None:
    windows = bench.parse_server_log(window(T + 21, 3.0, 4 * N, 2.0, 30.0))["windows"]
    assert bench.timed_h2d(windows, [((T + 18, T + 19), 2 * N), ((T + 20, T + 21), 2 * N)]) == [
        None,
        None,
    ]


def test_l2_bytes_are_fa_for_every_hit_chunk_and_one_recurrent_object() -> None:
    groups = {"0": 2e6, "1": 6e6}  # FA objects 2 MB, GDN objects 6 MB
    assert bench.l2_read_bytes(11, 10 * N, N, groups, fa=2_000_000) == 10 * 2e6 + 6e6


def test_l2_bytes_of_one_object_group_are_every_object_at_its_size() -> None:
    assert bench.l2_read_bytes(10, 10 * N, N, {"0": 8e6}, fa=2_000_000) == 80e6


# --- engine specs: what is timed, in which order ---------------------------------------------


def test_a_restore_engine_times_restores_and_colds_in_turn_after_a_warm_up(tmp_path: Path) -> None:
    spec = bench.engine_spec(TINY, 26624, "restore", tmp_path, {"lmcache": 1}, "cold-default")
    assert list(spec["warm_first"]) == ["cold", "restore"]
    order = ["restore", "cold"] + [k for pair in spec["timed_pairs"] for k in pair]
    assert spec["cold_reference"] and order == ["restore", "cold"] * bench.RESTORES


def test_a_restore_engine_without_room_for_colds_times_its_restores_only(tmp_path: Path) -> None:
    spec = bench.engine_spec(TINY, 26624, "restore", tmp_path, {"lmcache": 1})
    assert list(spec["warm_first"]) == ["restore"] and spec["cold_reference"] is None
    assert [list(pair) for pair in spec["timed_pairs"]] == [["restore"], ["restore"]]


def test_the_restore_engine_restores_what_the_store_engine_stored(tmp_path: Path) -> None:
    store = bench.engine_spec(TINY, 26624, "store", tmp_path, {"lmcache": 1})
    restore = bench.engine_spec(TINY, 26624, "restore", tmp_path, {"lmcache": 1}, "cold-x")
    assert restore["prompt"] == store["prompt"] and restore["kv_hashes"] and store["kv_hashes"]
    timed = [restore["warm_first"]["restore"]] + [p["restore"] for p in restore["timed_pairs"]]
    assert timed == store["also_store"]
    assert not {tuple(p["cold"]) for p in restore["timed_pairs"]} & {tuple(t) for t in timed}


def test_medians_are_of_the_timed_restores_and_colds_not_the_warm_ups() -> None:
    row = new_row()
    bench.fill_restore_row(row, TINY, STORE, restore_result(), {})
    assert [r["ttft_s"] for r in row["restores"]] == [0.5, 0.4, 0.6]
    assert row["restore_ttft_s"] == 0.5
    assert row["cold_in_engine_s"] == 4.0 and row["cold_in_engine_ttfts_s"] == [4.0, 5.0, 3.0]


# --- correctness and findings -----------------------------------------------------------------


def test_a_restore_of_the_stored_bytes_and_tokens_is_correct() -> None:
    row = new_row()
    bench.fill_restore_row(row, TINY, STORE, restore_result(), {})
    assert row["kv"]["match"] and row["tokens_match"] and row["correct"] and not row["findings"]


def test_a_peer_that_restores_nothing_after_the_restart_is_a_finding() -> None:
    row = new_row("offloading")
    bench.fill_restore_row(row, TINY, STORE, restore_result(hits=(0, 0, 0)), {})
    assert not row["correct"] and "restored nothing" in row["findings"][0]["what"]
    assert row["findings"][0]["arm"] == "offloading"


def test_a_peer_that_restores_other_kv_bytes_is_a_finding() -> None:
    row = new_row("lmcache056")
    bench.fill_restore_row(row, TINY, STORE, restore_result(kv_hashes=hashes(2 * N, "other")), {})
    assert not row["correct"] and any("KV bytes differ" in f["what"] for f in row["findings"])


def test_a_peer_whose_restore_engine_fails_did_not_run() -> None:
    row = new_row("lmcache056")
    bench.fill_restore_row(row, TINY, STORE, {"ok": False, "error": "ImportError: x"}, {})
    assert row["errors"] and row["findings"][0]["what"].startswith("did not run: ")


def test_the_offloading_connectors_restored_bytes_are_its_engines_storage_reads() -> None:
    row = new_row("offloading")
    bench.fill_restore_row(row, TINY, STORE, restore_result(), {})
    assert [r["read_bytes"] for r in row["restores"]] == [3_000, 1_000, 2_000]
    assert row["read_bytes"] == 2_000 and row["h2d_gbps"] is None


def test_lmcaches_restored_bytes_and_h2d_come_from_its_log_during_each_restore() -> None:
    log = prefetch(T + 1.5, 2) + window(T + 2, 0.5, N, 0.1, 9.0)  # the warm-up W
    for t, gbps in ((T + 10, 30.0), (T + 20, 20.0), (T + 30, 10.0)):
        log += prefetch(t + 0.5, 3) + window(t + 1, 0.5, 2 * N, 0.03, gbps)
    fa = 2 * N * attn_bytes_per_token(TINY)  # qwen35-r17: 2 FA layers
    ctx = {**bench.parse_server_log(log), "groups": {"0": float(fa), "1": 3.0 * fa}}
    row = new_row()
    bench.fill_restore_row(row, TINY, STORE, restore_result(), ctx)
    assert [r["l2_objects"] for r in row["restores"]] == [3, 3, 3]
    assert row["read_bytes"] == pytest.approx(2 * fa + 3 * fa)
    assert [r["h2d_gbps"] for r in row["restores"]] == [pytest.approx(g) for g in (30, 20, 10)]
    assert row["h2d_gbps"] == pytest.approx(20.0) and row["h2d_timed"] == 3


# --- the report ---------------------------------------------------------------------------


def test_the_report_holds_the_top_level_fields_and_a_row_per_arm(tmp_path: Path) -> None:
    rates = {"disk_read_gbps": 2.0, "page_cache_read_gbps": 10.0, "pinned_h2d_gbps": 50.0}
    res = bench.new_results()
    for arm in ("cold", "default", "offloading"):
        res["rows"][bench.row_key(TINY.name, 26624, arm)] = {
            "model": TINY.name,
            "prompt_tokens": 26624,
            "arm": arm,
            "rates": rates,
            "ok": True,
            "cold_ttft_s": 4.0,
            "restore_ttft_s": 0.5,
            "read_bytes": 1e9,
            "errors": [],
            "findings": [{"model": TINY.name, "prompt_tokens": 26624, "arm": arm, "what": "x"}]
            if arm == "offloading"
            else [],
        }
    path = tmp_path / "bench.json"
    bench.write_results(res, path)
    data = json.loads(path.read_text())
    assert {"default", "offloadingconnector", "disk_bound", "findings"} <= set(data)
    assert "targets" not in data  # bench/README.md states them; the report measures
    assert data["default"][0]["speedup"] == 8.0 and len(data["offloadingconnector"]["rows"]) == 1
    assert data["offloadingconnector"]["kv_transfer_config"]["kv_connector"] == (
        "OffloadingConnector"
    )
    assert {r["arm"] for r in data["disk_bound"]["rows"]} == {"default", "offloading"}
    md = path.with_suffix(".md").read_text()
    assert f"| {TINY.name} | 26624 | default |" in md and "| 8 |" in md
    assert "## Findings" in md and "offloading: x" in md


# --- vLLM 0.26.0's OffloadingConnector ------------------------------------------------------


def test_the_offloading_config_selects_vllms_offloading_connector_with_hma() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cfg = KVTransferConfig(**bench.offloading_transfer_config(Path("/x"), 1 << 30, "e"))
    assert KVConnectorFactory.get_connector_class(cfg).__name__ == "OffloadingConnector"
    assert KVConnectorFactory.supports_hma_config(cfg)  # hybrid (Mamba) models keep HMA


def test_the_offloading_config_names_the_tiering_spec_and_its_fs_tier() -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    extra = bench.offloading_transfer_config(Path("/x"), 1 << 30, "e")["kv_connector_extra_config"]
    assert OffloadingSpecFactory.get_spec_cls(extra).__name__ == "TieringOffloadingSpec"
    [tier] = extra["secondary_tiers"]
    tier_cls = SecondaryTierFactory.get_tier_class(tier)
    assert set(tier) - {"type"} <= set(inspect.signature(tier_cls.__init__).parameters)


# --- the phases, with fake servers and engines ------------------------------------------------


def _args(tmp_path: Path, **kw: Any) -> argparse.Namespace:
    (tmp_path / "lmc" / "lmcache").mkdir(parents=True, exist_ok=True)
    base = {
        "work": tmp_path / "w",
        "results": tmp_path / "r.json",
        "time_limit_s": 0,
        "engine_timeout": 60.0,
        "lmcache_dir": tmp_path / "lmc",
    }
    return argparse.Namespace(**{**base, **kw})


def test_pagecache_and_default_share_one_store_and_only_default_drops_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p, roles, dropped = 2 * N + 100, [], []
    fa = 2 * N * attn_bytes_per_token(TINY)

    def start_server(py, env, port, chunk, l2, log, l1_size_gb=4, extra_args=()):
        assert tuple(extra_args) == bench.SERVER_STATS_ARGS and chunk == N
        log.write_text(prefetch(T + 10.5, 3) + window(T + 11, 0.5, 2 * N, 0.03, 30.0))
        return object()

    def run_engine(py, env, spec, wd, role, timeout):
        json.dumps(spec)  # what engine_proc reads must serialise
        roles.append(role)
        assert env["PYTHONHASHSEED"] == "0" and spec["lmcache"]["module_path"]
        if role == "store":
            for i in range(2):
                (Path(spec["l2"]) / f"m@0x1000000@0x0@{i:04x}.data").write_bytes(b"\0" * fa)
                (Path(spec["l2"]) / f"m@0x1000000@0x1@{i:04x}.data").write_bytes(b"\0" * 3 * fa)
            return dict(STORE)
        return restore_result()

    monkeypatch.setattr(bench, "start_server", start_server)
    monkeypatch.setattr(bench, "run_engine", run_engine)
    monkeypatch.setattr(bench, "kill_group", lambda proc: None)
    monkeypatch.setattr(bench, "wait_l2_stable", lambda *a, **k: None)
    monkeypatch.setattr(bench.fs_l2_read, "drop_cache", lambda files: dropped.append(len(files)))
    b = bench.Bench(_args(tmp_path), bench.new_results())
    b.restore_phase(TINY, p, ["pagecache", "default"], tmp_path / "lmc")
    assert roles == ["store", "restore-pagecache", "restore-default"] and dropped == [4]
    rows = b.results["rows"]
    page, default = (rows[bench.row_key(TINY.name, p, a)] for a in ("pagecache", "default"))
    assert page["ok"] and default["ok"] and default["correct"], default["errors"]
    assert not page["page_cache"]["dropped"] and default["page_cache"]["dropped"]
    assert default["restores"][0]["read_bytes"] == pytest.approx(5 * fa)
    assert not (tmp_path / "w" / f"{TINY.name}-{p}-pagecache-default" / "tier").exists()


def test_no_engine_starts_past_the_time_limit_and_the_row_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "run_engine", lambda *a, **k: pytest.fail("an engine started"))
    b = bench.Bench(_args(tmp_path, time_limit_s=1), bench.new_results())
    b.restore_phase(TINY, 2 * N + 100, ["offloading"])
    row = b.results["rows"][bench.row_key(TINY.name, 2 * N + 100, "offloading")]
    assert not row["ok"] and row["errors"][0].startswith("not run: ") and not row["findings"]
    assert json.loads((tmp_path / "r.json").read_text())["rows"]


def test_the_disk_probe_runs_on_any_filesystem(tmp_path: Path) -> None:
    res = bench.disk_probe(tmp_path, gib=1 / 64, chunk=1 << 20)
    assert res["write_gbps"] > 0 and res["cold_read"] > 0 and res["warm_read"] > 0
    assert res["direct_read"] or res["direct_read_error"]  # tmpfs refuses O_DIRECT
    assert not (tmp_path / "bench-disk-probe.bin").exists()


# --- engine_proc's probe around each timed request -----------------------------------------


def test_engine_proc_probes_the_wall_clock_and_the_bytes_read_from_storage() -> None:
    before = time.time()
    probe = engine_proc._request_probe()
    assert before <= probe["epoch"] <= time.time()
    assert probe["read_bytes"] is None or probe["read_bytes"] >= 0


def test_resume_measures_only_the_rows_that_are_missing_or_not_ok(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p, q, calls = 2 * N + 100, 4 * N + 100, []
    old = bench.new_results()
    old["runs"] = [{"started": "earlier"}]
    for length, arm, ok in ((p, "cold", True), (p, "pagecache", True), (p, "default", False)):
        key = bench.row_key(TINY.name, length, arm)
        old["rows"][key] = {"model": TINY.name, "prompt_tokens": length, "arm": arm, "ok": ok}
    args = _args(tmp_path, resume=True, cases=f"{TINY.name}:{p},{TINY.name}:{q}", l056_dir=None)
    args.arms = "cold,default,pagecache"
    args.results.write_text(json.dumps(old))
    monkeypatch.setattr(bench, "collect_environment", lambda py, lmc: {"versions": {}})
    monkeypatch.setattr(bench, "arm_problem", lambda *a: None)
    monkeypatch.setattr(bench, "disk_probe", lambda folder: {})
    monkeypatch.setattr(bench, "pinned_probe", lambda py: {})
    monkeypatch.setattr(bench.fs_l2_read, "machine", lambda path: {})
    monkeypatch.setattr(bench.Bench, "cold_phase", lambda self, m, ls: calls.append(("cold", ls)))
    monkeypatch.setattr(
        bench.Bench,
        "restore_phase",
        lambda self, m, length, arms, lmc=None: calls.append((length, arms)),
    )
    assert bench.run(args) == 0
    assert calls == [("cold", [q]), (p, ["default"]), (q, ["pagecache", "default"])]
    saved = json.loads(args.results.read_text())
    assert [r["started"] for r in saved["runs"]][0] == "earlier" and len(saved["runs"]) == 2
