"""The restore bench's pieces and report (bench/gpu_restore.py, bench/restore_report.py): each
restore's judgement and proof, the speedup over the no-connector cold of the same piece, the
cost of a miss, the floor, the merge per identity, the targets, a piece's run with fakes."""

from __future__ import annotations

import argparse
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
GRAPHS = {"enforce_eager": False, "compilation_mode": "VLLM_COMPILE", "cudagraph_mode": "FULL"}
PEER = {"tokens_count": False, "needed_from": "stored_files"}  # the OffloadingConnector's


def hashes(hit: int, gdn: str = "g", partial: str = "p") -> list[dict[str, Any]]:
    """KV hashes of one rank: FA blocks 0..3 restored, block 4 computed after the hit; the
    restored GDN checkpoint is block hit/N - 1."""
    fa = {"fa0": {"0": "a", "1": "b", "2": "c", "3": "d", "4": partial}}
    return [{"rank": 0, "block_size": N, "fa": fa, "gdn": {"gdn0": {str(hit // N - 1): gdn}}}]


STORED = {"tokens": [5, 6], "kv_hashes": hashes(4 * N), "files": {"a": 5 * 10**8, "b": 5 * 10**8}}


def restore(kind: str = "disk", **kw: Any) -> dict[str, Any]:
    """A bench_engine restore record: a full hit at T+10..11 after a reset and a clear, its
    files out of the page cache, 1 GB read."""
    r = {
        "round": 0,
        "kind": kind,
        "ttft_s": 0.5,
        "num_cached_tokens": 4 * N,
        "external_cached_tokens": 4 * N,
        "local_cached_tokens": 0,
        "span": [T + 10, T + 11],
        "io_read_bytes": 10**9,
        "hit_files": {"files": 2, "bytes": 10**9, "resident_files": 0, "missing_files": 0},
        "l2_quiet": True,
        "prefix_reset": True,
        "l1_cleared": True,
        "kv_hashes": hashes(4 * N),
        "tokens": [5, 6],
    }
    return {**r, **kw}


def prefetch_line(l1: int, l2: int) -> str:
    """The LMCache server's prefetch line, inside restore()'s span."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(T + 10.5)) + ",000"
    keys = f"{l1 + l2}/{l1 + l2} retained keys ({l1} L1, {l2} L2)"
    return f"[{stamp}] LMCache INFO: Prefetch request completed (L1+L2): {keys} in 80.0 ms\n"


def ours(l1: int = 0, l2: int = 5) -> dict[str, Any]:
    """This wheel's judging context: the server retained ``l1`` + ``l2`` objects (4 FA of
    1e8 bytes, the rest recurrent state of 2e8)."""
    ctx = {**report.parse_server_log(prefetch_line(l1, l2)), "groups": {"0": 1e8, "1": 2e8}}
    return {**ctx, "fa": 10**8, "tokens_count": False, "needed_from": "server_log"}


def judged(ttft: float = 0.5, ctx: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    r = restore(ttft_s=ttft, **kw)
    return bench.judge_restore(r, STORED, M, P, PEER if ctx is None else ctx)


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
    got = judged()
    assert got["correct"] and got["proven"] and got["needed_bytes"] == 10**9


def test_this_wheels_restore_needs_the_objects_its_server_retained() -> None:
    got = judged(ctx=ours())
    assert got["needed_bytes"] == pytest.approx(4e8 + 2e8) and got["proven"]


def test_a_disk_restore_with_one_resident_file_is_not_proven() -> None:
    files = {"files": 2, "bytes": 10**9, "resident_files": 1, "missing_files": 0}
    got = judged(hit_files=files)
    assert got["correct"] and not got["proven"]


def test_a_disk_restore_that_read_less_than_its_hit_needs_is_not_proven() -> None:
    assert not judged(io_read_bytes=10**8)["proven"]


@pytest.mark.parametrize("missing", ["prefix_reset", "l1_cleared", "l2_quiet"])
def test_a_restore_without_a_reset_a_clear_or_a_quiet_folder_is_not_proven(missing: str) -> None:
    assert not judged(**{missing: None})["proven"]


def test_a_restore_served_by_vllms_own_prefix_cache_is_not_proven() -> None:
    got = judged(ctx=ours(), kind="pagecache", io_read_bytes=0, external_cached_tokens=0)
    assert not got["proven"] and not got["correct"]
    got = judged(ctx=ours(), kind="pagecache", io_read_bytes=0, local_cached_tokens=N)
    assert not got["proven"]


def test_a_restore_served_from_l1_is_not_proven() -> None:
    got = judged(ctx=ours(l1=2, l2=3))
    assert (got["l1_objects"], got["l2_objects"]) == (2, 3) and not got["proven"]


def test_a_page_cache_restore_that_read_the_disk_is_not_proven() -> None:
    assert judged(ctx=ours(), kind="pagecache", io_read_bytes=0)["proven"]
    assert not judged(ctx=ours(), kind="pagecache")["proven"]


def test_a_block_computed_after_the_hit_is_not_judged() -> None:
    assert judged(kv_hashes=hashes(4 * N, partial="other"))["correct"]


def test_a_restored_block_that_differs_is_wrong() -> None:
    got = judged(kv_hashes=hashes(4 * N, gdn="other"))
    assert not got["correct"] and not got["kv_match"]


def test_tokens_count_only_where_the_weights_are_not_dummy() -> None:
    assert judged(tokens=[9, 9])["correct"]
    assert not judged(ctx={**PEER, "tokens_count": True}, tokens=[9, 9])["correct"]


def test_the_servers_store_lines_are_read_with_their_epochs() -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(T)) + ",250"
    log = f"[{stamp}] LMCache INFO: Stored 1056 tokens in 0.042 seconds\n"
    assert report.parse_server_log(log)["stores"] == [{"t": T + 0.25, "tokens": 1056, "s": 0.042}]


IDENT = {"gpu_model": "NVIDIA H100 80GB HBM3", "revision": ["0.5.3+hybridfa.20", "t"]}


def piece(
    name: str, started: str, rows: dict[str, Any], ceiling: float = 2.0, **ident: Any
) -> dict[str, Any]:
    run = {
        "stages": {"all": {"started": started}},
        "identity": {**IDENT, "software": {"vllm": "0.26.0"}, **ident},
        "ceiling": {"disk_gbps": ceiling, "page_cache_gbps": 10.0},
    }
    return {"piece": name, "complete": True, "run": run, "rows": rows}


def row(
    arm: str,
    restores: list[dict[str, Any]],
    colds: list[float],
    baseline: list[float] = (3.0, 3.5, 4.0),  # type: ignore[assignment]
    fixed: list[float | None] = (0.1, 0.2, None),  # type: ignore[assignment]
) -> dict[str, Any]:
    return {
        "model": "qwen35-9b",
        "prompt_tokens": 26624,
        "arm": arm,
        "mode": "graphs",
        "errors": [],
        "findings": [],
        "restores": restores,
        "colds_in_engine": colds,
        "baseline_colds": list(baseline),
        "fixed_probes": list(fixed),
    }


KEY = "qwen35-9b:26624:default:graphs"


def merged(*rows_: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    return report.merge_pieces([piece("p", "t", dict(rows_))])


def test_the_speedup_divides_the_no_connector_cold_of_the_same_piece() -> None:
    r = merged((KEY, row("default", [judged(t) for t in (0.5, 0.7, 0.6)], [5.0, 6.0])))["rows"]
    assert r[KEY]["restore_ttft"] == {"n": 3, "median": 0.6, "min": 0.5, "max": 0.7}
    assert r[KEY]["speedup"] == pytest.approx(3.5 / 0.6)


def test_the_cost_of_a_miss_is_the_connector_cold_over_the_no_connector_cold() -> None:
    r = merged((KEY, row("default", [judged()], [5.0, 6.0])))["rows"][KEY]
    assert r["miss_ttft"]["median"] == 5.5 and r["miss_cost"] == pytest.approx(5.5 / 3.5)


def test_unproven_restores_stay_in_the_row_and_out_of_its_spread() -> None:
    resident = {"files": 2, "bytes": 10**9, "resident_files": 2, "missing_files": 0}
    restores = [judged(0.5), judged(0.1, hit_files=resident)]
    r = merged((KEY, row("default", restores, [5.0])))["rows"][KEY]
    assert r["restores_counted"] == "1 of 2" and r["restore_ttft"]["median"] == 0.5


def test_the_floor_is_the_hits_bytes_at_the_ceiling_plus_the_probes_fixed_cost() -> None:
    r = merged((KEY, row("default", [judged(1.0)], [5.0])))["rows"][KEY]
    assert r["fixed_s"] == pytest.approx(0.15)  # the probes', not the restores'
    assert r["restores"][0]["floor_s"] == pytest.approx(1e9 / 2e9 + 0.15)
    assert r["floor_over_restore"]["median"] == pytest.approx(0.65)


def test_every_pieces_no_connector_colds_show_in_one_cold_row() -> None:
    a = piece("a", "1", {KEY: row("default", [judged()], [5.0], baseline=[3.0])})
    off = "qwen35-9b:26624:offloading:graphs"
    b = piece("b", "2", {off: row("offloading", [judged()], [5.0], baseline=[4.0, 5.0])})
    cold = report.merge_pieces([a, b])["rows"]["qwen35-9b:26624:cold:graphs"]
    assert cold["pieces"] == ["a", "b"] and cold["baseline_ttft"]["median"] == 4.0


def test_pieces_of_another_gpu_model_or_revision_are_not_merged(tmp_path: Path) -> None:
    a = piece("a", "1", {KEY: row("default", [judged()], [5.0])})
    b = piece("b", "2", {KEY: row("default", [judged()], [5.0])}, gpu_model="NVIDIA H100 PCIe")
    c = piece("c", "3", {KEY: row("default", [judged()], [5.0])}, revision=["x", "y"])
    with pytest.raises(report.MergeError):
        report.merge_pieces([a, b])
    written = report.write_merged([a, b, c], tmp_path / "bench.json")
    assert len(written) == 3 and all(p.exists() for p, _ in written)
    assert any("nvidia-h100-pcie" in p.name for p, _ in written)


def test_pieces_of_two_lmcache_056_versions_are_not_merged() -> None:
    a, b = (piece(x, x, {}) for x in "ab")
    a["run"]["peers"], b["run"]["peers"] = {"lmcache056": "0.5.6"}, {"lmcache056": "0.5.7"}
    with pytest.raises(report.MergeError):
        report.merge_pieces([a, b])


def test_an_incomplete_piece_is_left_out_and_listed() -> None:
    p = piece("half", "1", {KEY: row("default", [], [])})
    p["complete"] = False
    res = report.merge_pieces([p])
    assert res["left_out"] == ["half"] and not res["rows"]


def test_a_piece_run_again_replaces_its_earlier_run() -> None:
    first = piece("p", "2026-12-04T01:00:00", {KEY: row("default", [judged(9.0)], [9.0])})
    again = piece("p", "2026-12-04T02:00:00", {KEY: row("default", [judged(0.5)], [4.0])})
    r = report.merge_pieces([again, first])["rows"][KEY]
    assert r["restore_ttft"]["median"] == 0.5 and r["colds_in_engine"] == [4.0]


def test_the_report_holds_the_table_the_targets_and_the_plots_outcome(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    [(got, plots)] = report.write_merged(
        [piece("p", "t", {KEY: row("default", [judged()], [5.0])})], path
    )
    md = path.with_suffix(".md").read_text()
    assert got == path and "| qwen35-9b | 26624 | default | graphs |" in md
    assert "faster than offloading at 26624 (exact KV): not measured" in md
    assert json.loads(path.read_text())["plots"] == plots and plots


def target_lines(*rows_: tuple[str, dict[str, Any]]) -> str:
    return "\n".join(report.targets(merged(*rows_)))


def test_a_peer_slower_than_an_exact_default_is_beaten_in_the_targets() -> None:
    off = ("qwen35-9b:26624:offloading:graphs", row("offloading", [judged(2.0)], [4.0]))
    got = target_lines((KEY, row("default", [judged(0.5)], [4.0])), off)
    assert "- faster than offloading at 26624 (exact KV): **met** (0.5 s vs 2 s)" in got


def test_a_default_with_wrong_kv_beats_no_peer() -> None:
    bad = judged(0.5, kv_hashes=hashes(4 * N, "x"))
    off = ("qwen35-9b:26624:offloading:graphs", row("offloading", [judged(2.0)], [4.0]))
    got = target_lines((KEY, row("default", [bad], [4.0])), off)
    assert "faster than offloading at 26624 (exact KV): not measured" in got


def test_a_miss_over_ten_percent_above_the_cold_misses_its_target() -> None:
    got = target_lines((KEY, row("default", [judged()], [4.0], baseline=[3.5])))
    assert "no-connector cold at 26624: **missed** (1.14x)" in got


# --- a piece's run, with fake engines and servers


class Proc:
    pid, args = 4242, ["py", "--http-port", "5555"]


def fake_engines(monkeypatch: pytest.MonkeyPatch, mode: dict[str, Any] = GRAPHS) -> dict:
    """Engines that answer as bench_engine's roles would; their specs and envs by role."""
    seen: dict[str, Any] = {}

    def start_server(py, env, port, chunk, l2, log, l1_size_gb=4, extra_args=()):
        log.write_text(prefetch_line(0, 5))
        return Proc()

    def run_engine(py, env, spec, wd, role, timeout):
        json.dumps(spec)
        seen[role] = spec
        seen[f"{role}-env"] = env
        out: dict[str, Any] = {"ok": True, "engine_mode": mode}
        if role == "cold":
            cold = {"kind": "cold", "ttft_s": 3.0, "steps_s": [0.5] * 6, "span": [T, T + 3]}
            out["requests"] = [cold] * len(spec["cold_prompts"])
        elif role == "store":
            out["stored"] = []
            for i, _ in enumerate(spec["stored"]):
                f = Path(spec["tier"]) / f"s{i}.data"
                f.write_bytes(b"x" * 64)
                out["stored"].append({**STORED, "files": {str(f): 64}})
            out["l2"] = {"quiet": True}
        else:
            out["requests"] = [
                {"kind": "cold", "ttft_s": 4.0, "round": i, "span": [T + 20 * i, T + 20 * i + 4]}
                for i in range(spec["rounds"])
            ]
            for i in range(2):
                for k in ("disk", "pagecache"):
                    out["requests"].append(restore(k, round=i, stored_index=0, io_read_bytes=64))
                fixed = {"kind": "fixed", "ttft_s": 0.1, "round": i, "local_cached_tokens": 4 * N}
                out["requests"].append(fixed)
        return out

    monkeypatch.setattr(bench, "start_server", start_server)
    monkeypatch.setattr(bench, "run_engine", run_engine)
    monkeypatch.setattr(bench, "kill_group", lambda proc: None)
    monkeypatch.setattr(bench, "collect_environment", lambda py, lmc: {"versions": {}})
    monkeypatch.setattr(bench.machine, "gpus", lambda: [{"name": "GPU", "driver": "1"}])
    monkeypatch.setattr(bench.floor, "ceiling_probe", lambda *a: {"disk_gbps": 2.0})
    return seen


def args(tmp_path: Path, stage: str = "all") -> argparse.Namespace:
    (tmp_path / "lmc" / "lmcache").mkdir(parents=True, exist_ok=True)
    return argparse.Namespace(
        case=f"{M.name}:{P}",
        group="lmcache",
        eager=False,
        stage=stage,
        rounds=2,
        budget_s=570.0,
        lmcache_dir=tmp_path / "lmc",
        l056_dir=None,
        out=tmp_path / "pieces",
        work=tmp_path / "w",
        compile_cache=tmp_path / "cache",
        engine_timeout=60.0,
    )


def saved(tmp_path: Path, piece_: bench.Piece) -> dict[str, Any]:
    return json.loads((tmp_path / "pieces" / f"{piece_.name}.json").read_text())


def test_a_piece_runs_its_baseline_stores_restarts_and_restores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = fake_engines(monkeypatch)
    piece_ = bench.Piece(args(tmp_path))
    piece_.run()
    assert seen["restore"]["io_pid"] == 4242 and seen["restore"]["kinds"][-1] == "fixed"
    assert seen["restore"]["clear_url"] == "http://127.0.0.1:5555/cache/clear"
    assert seen["restore"]["stored_files"] == [
        [str(tmp_path / "w" / piece_.name / "tier" / "s0.data")],
        [str(tmp_path / "w" / piece_.name / "tier" / "s1.data")],
    ]
    default = saved(tmp_path, piece_)["rows"][f"{M.name}:{P}:default:graphs"]
    assert default["ok"] and [r["kind"] for r in default["restores"]] == ["disk", "disk"]
    assert default["baseline_colds"] == [3.0, 3.0] and default["colds_in_engine"] == [4.0, 4.0]
    assert (
        default["fixed_probes"] == [0.1, 0.1] and default["miss_path"]["summary"]["extra_s"] == 1.0
    )
    assert not (tmp_path / "w" / piece_.name / "tier").exists()


def test_every_engine_of_a_piece_has_one_max_model_len_and_one_compile_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = fake_engines(monkeypatch)
    bench.Piece(args(tmp_path)).run()
    roles = ("cold", "store", "restore")
    assert {seen[r]["max_model_len"] for r in roles} == {bench.max_model_len(M)}
    cache = str((tmp_path / "cache").resolve())
    assert all(seen[f"{r}-env"]["VLLM_CACHE_ROOT"].startswith(cache) for r in roles)


def test_a_piece_split_at_the_restart_resumes_from_its_store_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = fake_engines(monkeypatch)
    first = bench.Piece(args(tmp_path, "store"))
    first.run()
    assert not saved(tmp_path, first)["complete"] and "restore" not in seen
    assert (tmp_path / "w" / first.name / "tier" / "s0.data").exists()
    second = bench.Piece(args(tmp_path, "restore"))
    second.run()
    got = saved(tmp_path, second)
    assert got["complete"] and set(got["run"]["stages"]) == {"store", "restore"}
    assert got["rows"][f"{M.name}:{P}:default:graphs"]["baseline_colds"] == [3.0, 3.0]


def test_a_restore_stage_on_another_boot_measures_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_engines(monkeypatch)
    first = bench.Piece(args(tmp_path, "store"))
    first.run()
    handoff = first.handoff_path()
    h = json.loads(handoff.read_text())
    h["info"]["host"]["boot_id"] = "another"
    handoff.write_text(json.dumps(h))
    second = bench.Piece(args(tmp_path, "restore"))
    second.run()
    got = saved(tmp_path, second)
    assert not got["complete"] and "another machine, boot" in got["run"]["error"]


def test_an_engine_that_runs_eager_fails_a_graphs_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eager = {"enforce_eager": True, "compilation_mode": "NONE", "cudagraph_mode": "NONE"}
    fake_engines(monkeypatch, mode=eager)
    piece_ = bench.Piece(args(tmp_path))
    piece_.run()
    got = saved(tmp_path, piece_)
    assert not got["complete"] and "runs eager" in got["run"]["error"]


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


def test_no_engine_starts_with_less_of_the_budget_left_than_its_start_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = fake_engines(monkeypatch)
    a = args(tmp_path)
    a.budget_s = bench.ENGINE_START_S - 1
    piece_ = bench.Piece(a)
    piece_.run()
    assert not seen and "not started" in saved(tmp_path, piece_)["run"]["error"]


def test_the_report_names_each_engines_mode_and_what_its_deadline_cut() -> None:
    p = piece("p", "t", {KEY: row("default", [judged()], [5.0])})
    p["run"]["engines"] = {"restore": {"read_back": "graphs", "cut_by_deadline": 2}}
    md = report.markdown_report(report.merge_pieces([p]))
    assert "engines {'restore': 'graphs, 2 cut'}" in md


@pytest.mark.parametrize("gpus", [[], "nvidia-smi failed: timed out"])
def test_a_piece_whose_gpu_query_found_nothing_is_still_reported(gpus: Any) -> None:
    p = piece("p", "t", {KEY: row("default", [judged()], [5.0])})
    p["run"]["gpus"] = gpus
    assert "driver None" in report.markdown_report(report.merge_pieces([p]))
