"""The gate on either lmcache base: 0.5.3 (vLLM 0.26-0.28) or 0.5.6 (vLLM 0.29-0.34). The base
is the engines' lmcache release; it decides which vLLMs a run may use and what a case means."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from judge_fakes import engine, hashes

from hybridfa_gate import l2 as l2_tiers
from hybridfa_gate import procs, run
from hybridfa_gate.cases import Case, select_cases
from hybridfa_gate.judge import evaluate_case
from hybridfa_gate.specs import RunConfig, store_spec

pytestmark = pytest.mark.bases("0.5.3", "0.5.6")


def _versions(lmcache: str, vllm: str, patched: bool, pkg: Path) -> dict[str, Any]:
    return {
        "lmcache_dist": lmcache,
        "vllm": vllm,
        "lmcache_path": str(pkg / "lmcache"),
        "lmcache_hybridfa": patched,
    }


def test_the_base_is_the_engines_lmcache_release() -> None:
    assert run.lmcache_base({"lmcache_dist": "0.5.6+hybridfa.1"}) == "0.5.6"
    assert run.lmcache_base({"lmcache_dist": "0.5.6"}) == "0.5.6"
    assert run.lmcache_base({"lmcache_dist": "0.5.3+hybridfa.15"}) == "0.5.3"
    assert run.lmcache_base({"lmcache_dist": None, "lmcache": "0.5.6"}) == "0.5.6"
    assert run.lmcache_base({}) == "0.5.3"


def test_each_base_runs_only_with_the_vllms_it_serves(tmp_path: Path) -> None:
    def problem(lmcache: str, vllm: str, arm: str = "pristine") -> str | None:
        versions = _versions(lmcache, vllm, arm == "patched", tmp_path)
        return run.arm_problem(arm, versions, tmp_path)

    assert problem("0.5.6", "0.29.0") is None
    assert problem("0.5.6+hybridfa.1", "0.34.0", "patched") is None
    assert problem("0.5.3", "0.28.0") is None
    assert problem("0.5.3+hybridfa.15", "0.26.0", "patched") is None
    assert "serves vLLM 0.29-0.34" in (problem("0.5.6+hybridfa.1", "0.28.0", "patched") or "")
    assert "serves vLLM 0.26-0.28" in (problem("0.5.3", "0.29.0") or "")
    assert "the gate knows 0.5.3, 0.5.6" in (problem("0.5.4", "0.29.0") or "")


def test_the_control_arm_is_pristine_053_with_patches(tmp_path: Path) -> None:
    versions = _versions("0.5.6", "0.29.0", False, tmp_path)
    problem = run.arm_problem("control", versions, tmp_path) or ""
    assert "--arm control is pristine 0.5.3" in problem
    versions = _versions("0.5.3", "0.27.1", False, tmp_path)
    assert run.arm_problem("control", versions, tmp_path) is None


def test_both_series_refuse_a_hybrid_layout_on_fs_native(tmp_path: Path) -> None:
    native = {c.case_id: c for c in select_cases("l2")}["olmo-r5-NHD-c2N-offset-fsnative"]
    for base in ("0.5.3", "0.5.6"):
        assert native.refused_by("patched", base) and not native.refused_by("pristine", base)
        assert native.mode("pristine", base) == "restore"
        rc = RunConfig(arm="patched", lmcache_dir=tmp_path, out=tmp_path, base=base)
        spec = store_spec(native, tmp_path, rc, 5555, tmp_path / "l2")
        assert spec["l2_min_objects"] == 0  # the refusing server stores nothing
        assert run.case_record(native, "patched", base)["expect_refusal"] is True


def test_a_run_judges_its_cases_on_the_engines_base(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    versions = _versions("0.5.6+hybridfa.1", "0.29.0", True, tmp_path)
    header = {"arm": "patched", "versions": versions}
    monkeypatch.setattr(run, "start_report", lambda *a: (tmp_path / "r", header, None))
    monkeypatch.setattr(run, "write_report", lambda report, stem: None)
    seen: list[str] = []

    def run_case(case: Case, rc: RunConfig, cold_runs: Any) -> dict[str, Any]:
        seen.append(rc.base)
        return {"case": case.case_id}

    monkeypatch.setattr(run, "run_case", run_case)
    rc = RunConfig(arm="patched", lmcache_dir=tmp_path, out=tmp_path)
    cases = select_cases("l2")
    report = run.run_matrix(cases, rc)
    assert report["base"] == "0.5.6" and seen == ["0.5.6"] * len(cases)


def test_a_kv_layout_vllm_resolved_otherwise_than_the_case_asked_is_an_error() -> None:
    case = Case("olmo-r5", "NHD", 1, False)
    p = case.prompt_tokens
    kv = [hashes({"0": "a"}, {str(p // 80 - 1): "x"})]

    def evaluate(layout: str | None) -> dict[str, Any]:
        cold, store = engine([5], [], 2.0), engine([5], [], 2.1, kv=kv)
        restore = engine([5], [], 0.5, cached=p // 80 * 80, kv=kv)
        if layout is not None:
            for r in (cold, store, restore):
                r["kv_cache_layout"] = layout
        return evaluate_case(case, cold, store, restore, "patched", "0.5.6")

    assert evaluate(None)["pass"]  # vLLM 0.26-0.28 report no resolved layout
    assert evaluate("LBNHC")["pass"]
    ev = evaluate("LBHNC")
    assert (
        not ev["pass"] and "cold: vLLM resolved the KV layout LBHNC, not LBNHC" in ev["errors"][0]
    )


def test_an_engine_of_a_vllm_that_resolves_a_layout_must_report_it() -> None:
    case = Case("olmo-r5", "NHD", 1, False)
    p = case.prompt_tokens
    kv = [hashes({"0": "a"}, {str(p // 80 - 1): "x"})]
    cold, store = engine([5], [], 2.0), engine([5], [], 2.1, kv=kv)
    restore = engine([5], [], 0.5, cached=p // 80 * 80, kv=kv)
    for r in (cold, store, restore):
        r.update(vllm="0.29.0", kv_cache_layout="LBNHC")
    assert evaluate_case(case, cold, store, restore, "patched", "0.5.6")["pass"]
    del restore["kv_cache_layout"]
    ev = evaluate_case(case, cold, store, restore, "patched", "0.5.6")
    assert not ev["pass"] and ev["errors"] == [
        "restore: vLLM resolved the KV layout None, not LBNHC (NHD)"
    ]


def test_the_installed_lmcache_server_takes_the_gates_options(tmp_path: Path) -> None:
    pytest.importorskip("lmcache")
    from lmcache.cli.commands.server import ServerCommand

    parser = argparse.ArgumentParser()
    ServerCommand().add_arguments(parser)
    adapter = l2_tiers.adapter_json("fs", folder=tmp_path)
    args = parser.parse_args(procs.server_args(5555, 160, adapter, l1_size_gb=2))
    assert (args.chunk_size, args.l1_size_gb, args.port) == (160, 2, 5555)
    assert args.eviction_policy == "LRU" and "base_path" in str(args.l2_adapter)
