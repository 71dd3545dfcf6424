"""The restore bench's pieces and report (bench/gpu_restore.py, bench/restore_report.py): the
disk plan, each restore's judgement, the merge of pieces, the floor ratios, the targets."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from bench import gpu_restore as bench
from bench import restore_report as report

M = bench.MODELS["qwen35-r17"]
N = bench.block(M)
P = 4 * N + 100
T = 1_800_000_000.0
GIB = 1 << 30


def hashes(hit: int, gdn: str = "g") -> list[dict[str, Any]]:
    """KV hashes of one rank whose restored GDN checkpoint is block hit/N - 1."""
    fa = {"fa0": {"0": "a", "1": "b"}}
    return [{"rank": 0, "block_size": N, "fa": fa, "gdn": {"gdn0": {str(hit // N - 1): gdn}}}]


STORED = {"tokens": [5, 6], "kv_hashes": hashes(4 * N)}


def restore(kind: str = "disk", **kw: Any) -> dict[str, Any]:
    """A bench_engine restore record: a full hit at T+10..11, its files dropped, 1 GB read."""
    r = {
        "round": 0,
        "kind": kind,
        "ttft_s": 0.5,
        "num_cached_tokens": 4 * N,
        "external_cached_tokens": 4 * N,
        "local_cached_tokens": 0,
        "span": [T + 10, T + 11],
        "io_read_bytes": 10**9,
        "resident_bytes": 0,
        "bytes": 5 * 10**9,
        "l2_quiet": True,
        "l1_cleared": True,
        "fixed_s": 0.1,
        "kv_hashes": hashes(4 * N),
        "tokens": [5, 6],
    }
    return {**r, **kw}


def prefetch_line(l1: int, l2: int) -> str:
    """The LMCache server's prefetch line, inside restore()'s span."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(T + 10.5)) + ",000"
    keys = f"{l1 + l2}/{l1 + l2} retained keys ({l1} L1, {l2} L2)"
    return f"[{stamp}] LMCache INFO: Prefetch request completed (L1+L2): {keys} in 80.0 ms\n"


def test_the_disk_plan_stores_one_prompt_per_round_where_it_fits() -> None:
    assert bench.disk_plan(GIB, 100 * GIB, 5) == 5
    assert bench.disk_plan(17 * GIB, 50 * GIB, 5) == 1  # 128k: one prompt next to one cold
    with pytest.raises(bench.Skipped):
        bench.disk_plan(17 * GIB, 30 * GIB, 5)


def test_the_servers_http_port_is_read_from_its_command_line() -> None:
    proc = subprocess.Popen(["true", "--port", "1", "--http-port", "4321"], executable="true")
    proc.wait()
    assert bench.http_port(proc) == 4321 and bench.http_port(object()) is None


def test_a_restore_from_dropped_files_with_exact_kv_is_correct_and_proven() -> None:
    got = bench.judge_restore(restore(), STORED, M, P, {})
    assert got["correct"] and got["proven"] and got["kv_match"] and got["tokens_match"]


def test_a_disk_restore_whose_files_were_resident_is_not_proven() -> None:
    got = bench.judge_restore(restore(resident_bytes=4 * 10**9), STORED, M, P, {})
    assert got["correct"] and not got["proven"]


def test_a_restore_that_started_before_l2_was_quiet_is_not_proven() -> None:
    assert not bench.judge_restore(restore(l2_quiet=False), STORED, M, P, {})["proven"]


def test_a_restore_served_from_l1_is_not_proven() -> None:
    log = prefetch_line(2, 3)
    ctx = {**report.parse_server_log(log), "groups": {"0": 1e6, "1": 3e6}, "fa": 10**6}
    got = bench.judge_restore(restore(), STORED, M, P, ctx)
    assert (got["l1_objects"], got["l2_objects"]) == (2, 3) and not got["proven"]


def test_a_page_cache_restore_that_read_the_disk_is_not_proven() -> None:
    log = prefetch_line(0, 5)
    ctx = {**report.parse_server_log(log), "groups": {"0": 1e8, "1": 3e8}, "fa": 10**8}
    assert bench.judge_restore(restore("pagecache", io_read_bytes=0), STORED, M, P, ctx)["proven"]
    assert not bench.judge_restore(restore("pagecache"), STORED, M, P, ctx)["proven"]


def test_every_restore_is_checked_against_the_storing_engines_kv() -> None:
    got = bench.judge_restore(restore(kv_hashes=hashes(4 * N, "other")), STORED, M, P, {})
    assert not got["correct"] and not got["kv_match"]


def piece(name: str, started: str, rows: dict[str, Any], ceiling: float = 2.0) -> dict[str, Any]:
    run = {"started": started, "ceiling": {"disk_gbps": ceiling, "page_cache_gbps": 10.0}}
    return {"piece": name, "run": run, "rows": rows}


def row(arm: str, restores: list[dict[str, Any]], colds: list[float]) -> dict[str, Any]:
    return {
        "model": "qwen35-9b",
        "prompt_tokens": 26624,
        "arm": arm,
        "mode": "graphs",
        "errors": [],
        "findings": [],
        "restores": restores,
        "colds_in_engine": colds,
    }


def judged(ttft: float, **kw: Any) -> dict[str, Any]:
    return bench.judge_restore(restore(ttft_s=ttft, **kw), STORED, M, P, {})


def test_pieces_merge_into_one_report_with_spreads_and_floors(tmp_path: Path) -> None:
    key = "qwen35-9b:26624:default:graphs"
    part2 = [judged(t) for t in (0.5, 0.7)] + [judged(0.2, resident_bytes=4 * 10**9)]
    old = piece("p1", "2026-12-04T01:00:00", {key: row("default", [judged(0.6)], [5.0])})
    new = piece("p2", "2026-12-04T02:00:00", {key: row("default", part2, [6.0, 4.0])})
    cold = {"qwen35-9b:26624:cold:graphs": row("cold", [], [3.0, 3.5, 4.0])}
    res = report.merge_pieces([new, old, piece("p3", "2026-12-04T03:00:00", cold)])
    r = res["rows"][key]
    assert r["pieces"] == ["p1", "p2"] and r["restores_counted"] == "3 of 4"  # one was resident
    assert r["restore_ttft"] == {"n": 3, "median": 0.6, "min": 0.5, "max": 0.7}
    assert r["cold_ttft"]["median"] == 5.0 and r["speedup"] == pytest.approx(5.0 / 0.6)
    assert r["speedup_vs_no_connector"] == pytest.approx(3.5 / 0.6)
    assert r["restores"][1]["floor_s"] == pytest.approx(1e9 / 2e9 + 0.1)  # 1 GB at 2 GB/s + fixed
    assert r["floor_over_restore"]["median"] == pytest.approx(0.6 / 0.6)
    path = tmp_path / "bench.json"
    report.write_results(res, path)
    md = path.with_suffix(".md").read_text()
    assert "| qwen35-9b | 26624 | default | graphs |" in md and "0.6 (0.5-0.7)" in md
    assert "disk restore >= 0.9 of its floor at 26624: **met**" in md
    assert "faster than offloading at 26624 (exact KV): not measured" in md
    assert json.loads(path.read_text())["plots"]


def test_a_piece_run_again_replaces_its_earlier_run() -> None:
    key = "qwen35-9b:26624:default:graphs"
    first = piece("p", "2026-12-04T01:00:00", {key: row("default", [judged(9.0)], [9.0])})
    again = piece("p", "2026-12-04T02:00:00", {key: row("default", [judged(0.5)], [4.0])})
    r = report.merge_pieces([again, first])["rows"][key]
    assert r["restore_ttft"]["median"] == 0.5 and r["colds_in_engine"] == [4.0]


def test_a_peer_slower_than_an_exact_default_is_beaten_in_the_targets() -> None:
    rows = {
        "qwen35-9b:26624:default:graphs": row("default", [judged(0.5)], [4.0]),
        "qwen35-9b:26624:offloading:graphs": row("offloading", [judged(2.0)], [4.0]),
    }
    res = report.merge_pieces([piece("p", "t", rows)])
    assert "- faster than offloading at 26624 (exact KV): **met** (0.5 s vs 2 s)" in "\n".join(
        report.targets(res)
    )


def test_a_default_with_wrong_kv_beats_no_peer() -> None:
    rows = {
        "qwen35-9b:26624:default:graphs": row(
            "default", [judged(0.5, kv_hashes=hashes(4 * N, "x"))], [4.0]
        ),
        "qwen35-9b:26624:offloading:graphs": row("offloading", [judged(2.0)], [4.0]),
    }
    res = report.merge_pieces([piece("p", "t", rows)])
    assert "faster than offloading at 26624 (exact KV): not measured" in "\n".join(
        report.targets(res)
    )


def test_an_lmcache_piece_stores_restarts_and_restores_in_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With fake servers and engines: store, a new server whose pid and /cache/clear the
    restore engine gets, rows for default and pagecache, the piece file, the tier removed."""
    import argparse

    specs: dict[str, Any] = {}

    class Proc:
        pid, args = 4242, ["py", "--http-port", "5555"]

    def start_server(py, env, port, chunk, l2, log, l1_size_gb=4, extra_args=()):
        log.write_text(prefetch_line(0, 5))
        return Proc()

    def run_engine(py, env, spec, wd, role, timeout):
        json.dumps(spec)
        specs[role] = spec
        if role == "store":
            stored = [dict(STORED) for _ in spec["stored"]]
            return {"ok": True, "stored": stored, "l2": {"quiet": True}}
        reqs = [{"kind": "cold", "ttft_s": 4.0, "round": i} for i in range(spec["rounds"])]
        reqs += [
            restore(k, round=i, stored_index=0) for i in range(2) for k in ("disk", "pagecache")
        ]
        return {"ok": True, "requests": reqs}

    monkeypatch.setattr(bench, "start_server", start_server)
    monkeypatch.setattr(bench, "run_engine", run_engine)
    monkeypatch.setattr(bench, "kill_group", lambda proc: None)
    monkeypatch.setattr(bench, "collect_environment", lambda py, lmc: {"versions": {}})
    monkeypatch.setattr(bench.floor, "ceiling_probe", lambda *a: {"disk_gbps": 2.0})
    (tmp_path / "lmc" / "lmcache").mkdir(parents=True)
    a = argparse.Namespace(
        case=f"{M.name}:{P}",
        group="lmcache",
        eager=False,
        rounds=2,
        lmcache_dir=tmp_path / "lmc",
        l056_dir=None,
        out=tmp_path / "pieces",
        work=tmp_path / "w",
        engine_timeout=60.0,
        part="a",
    )
    piece = bench.Piece(a)
    piece.run()
    assert specs["restore"]["io_pid"] == 4242
    assert specs["restore"]["clear_url"] == "http://127.0.0.1:5555/cache/clear"
    assert specs["restore"]["kinds"] == ["cold", "disk", "pagecache"]
    assert specs["store"]["enforce_eager"] is False and len(specs["store"]["stored"]) == 2
    saved = json.loads((tmp_path / "pieces" / f"{piece.name}.json").read_text())
    default = saved["rows"][f"{M.name}:{P}:default:graphs"]
    assert default["ok"] and [r["kind"] for r in default["restores"]] == ["disk", "disk"]
    assert default["colds_in_engine"] == [4.0, 4.0]
    assert not (tmp_path / "w" / piece.name / "tier").exists() and piece.name.endswith("-a")


def test_the_bench_runs_cuda_graphs_and_the_gates_engines_stay_eager(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from hybridfa_gate import engine_proc

    graphs = bench.engine_spec(M, P, "restore", tmp_path, eager=False, conn={"lmcache": 1})
    eager = bench.engine_spec(M, P, "restore", tmp_path, eager=True, conn={"lmcache": 1})
    gate = {k: v for k, v in graphs.items() if k != "enforce_eager"}
    assert engine_proc.llm_kwargs(graphs)["enforce_eager"] is False
    assert engine_proc.llm_kwargs(eager)["enforce_eager"] is True
    assert engine_proc.llm_kwargs(gate)["enforce_eager"] is True


def test_the_offloading_config_selects_vllms_offloading_connector_with_hma() -> None:
    pytest.importorskip("vllm")
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cfg = KVTransferConfig(**report.offloading_transfer_config(Path("/x"), 1 << 30, "e"))
    assert KVConnectorFactory.get_connector_class(cfg).__name__ == "OffloadingConnector"
    assert KVConnectorFactory.supports_hma_config(cfg)  # hybrid (Mamba) models keep HMA


def test_the_offloading_config_names_the_tiering_spec_and_its_fs_tier() -> None:
    pytest.importorskip("vllm")
    import inspect

    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    cfg = report.offloading_transfer_config(Path("/x"), 1 << 30, "e")
    extra = cfg["kv_connector_extra_config"]
    assert OffloadingSpecFactory.get_spec_cls(extra).__name__ == "TieringOffloadingSpec"
    [tier] = extra["secondary_tiers"]
    tier_cls = SecondaryTierFactory.get_tier_class(tier)
    assert set(tier) - {"type"} <= set(inspect.signature(tier_cls.__init__).parameters)


def test_an_offloading_spec_steps_its_stores_and_reads_its_own_files(tmp_path: Path) -> None:
    conn = {"kv_transfer_config": report.offloading_transfer_config(tmp_path, 1 << 30, "e")}
    spec = bench.engine_spec(M, P, "store", tmp_path, eager=False, conn=conn)
    assert spec["connector"] == "offloading" and spec["suffix"] == ".bin" and "lmcache" not in spec
