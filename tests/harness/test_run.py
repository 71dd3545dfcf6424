"""A gate run (hybridfa_gate.run, report, cli) without engines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hybridfa_gate import cli, judge, run
from hybridfa_gate.cases import Case, select_cases
from hybridfa_gate.report import markdown_report, table_row
from hybridfa_gate.specs import RunConfig


def test_cold_runs_run_once_across_threads_and_skip_failures() -> None:
    cold = run.ColdRuns()
    calls: list[int] = []

    def slow_ok() -> dict:
        calls.append(1)
        time.sleep(0.2)
        return {"ok": True, "gen_s": 1.5}

    got: list[dict] = []
    threads = [
        threading.Thread(target=lambda: got.append(cold.get_or_run(("m", 1, "NHD", 1), slow_ok)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and got == [{"ok": True, "gen_s": 1.5}] * 4
    assert cold.get_or_run(("m", 2, "NHD", 1), lambda: {"ok": False})["ok"] is False
    assert ("m", 2, "NHD", 1) not in cold.results


def test_arm_problem(tmp_path: Path) -> None:
    pkg = tmp_path / "lmcache"
    v = {"lmcache_path": str(pkg), "lmcache_hybridfa": True}
    assert run.arm_problem("patched", v, tmp_path) is None
    assert "_hybridfa" in run.arm_problem("pristine", v, tmp_path)
    assert "_hybridfa" in run.arm_problem("control", v, tmp_path)
    assert "not from" in run.arm_problem("patched", v, tmp_path / "other")
    pristine = {"lmcache_path": str(pkg), "lmcache_hybridfa": False}
    assert run.arm_problem("control", pristine, tmp_path) is None


def test_a_case_record_names_its_vllm_dtype_and_identity_settings() -> None:
    (case,) = select_cases("qwen35-r5-NHD-c1N-offset-fp8e4m3-to-fp8e5m2")
    rec = run.case_record(case, "patched")
    assert rec["kv_cache_dtype"] == "fp8_e4m3 -> fp8_e5m2" and rec["mode"] == "miss"
    assert rec["geometry"] == {"block_size": 144, "kernel_page": 16, "ratio": 9}
    rec = run.case_record(Case("qwen35-r25", "NHD", 1, False, separate_groups=True), "pristine")
    assert rec["server_args"] == ["--separate-object-groups"] and rec["kv_cache_dtype"] == "auto"
    rec.update(vllm="0.28.0", eval={"completed": True, "pass": True, "mode": "restore"})
    row = table_row("patched", rec)
    assert row[2:4] == ["0.28.0", "qwen35-r25"] and row[6] == "auto" and row[-1] == "yes"


def test_a_report_shows_an_engine_error() -> None:
    case = Case("qwen35-r17", "HND", 2, False)
    rec = {
        **run.case_record(case, "patched"),
        "eval": {"completed": False, "errors": ["store: boom"]},
    }
    md = markdown_report({"arm": "patched", "date": "d", "cases": [rec]})
    assert "| patched | qwen35-r17-HND-c2N-offset | - | qwen35-r17 |" in md and "ERROR" in md
    assert "store: boom" in md and "- model runner: -\n" in md


def test_a_report_names_the_model_runner_its_engines_ran_on() -> None:
    rec = run.case_record(Case("qwen35-r17", "HND", 2, False), "patched")
    v2 = {"model_runner": "V2 vllm.v1.worker.gpu.model_runner.GPUModelRunner"}
    rec.update(eval={"completed": True}, engines={"cold": v2, "store": v2, "restore": None})
    md = markdown_report({"arm": "patched", "date": "d", "cases": [rec]})
    assert "- model runner: V2 vllm.v1.worker.gpu.model_runner.GPUModelRunner\n" in md


def test_the_slim_record_keeps_no_hashes_or_snapshots() -> None:
    r = {
        "ok": True,
        "kv_hashes": [1],
        "l2_snapshot": {},
        "second": {"kv_hashes": [2], "tokens": [3]},
    }
    assert run.slim(r) == {"ok": True, "second": {"tokens": [3]}}


def test_the_cli_lists_cases_and_refuses_what_it_cannot_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--list", "--cases", "seed"]) == 0
    assert "qwen35-r25-NHD-c1N-offset-sog" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["--arm", "patched", "--lmcache-dir", str(tmp_path), "--jobs", "2"])
    with pytest.raises(SystemExit):
        cli.main(["--cases", "nope", "--list"])


def test_the_cli_passes_its_engine_timeout_to_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, float] = {}

    def run_matrix(cases: object, rc: object, on_progress: object) -> dict:
        seen["timeout"] = rc.engine_timeout  # type: ignore[attr-defined]
        return {"error": "stopped here"}

    monkeypatch.setattr(cli, "run_matrix", run_matrix)
    monkeypatch.setattr(cli, "install_cleanup_handler", lambda: None)
    argv = ["--lmcache-dir", str(tmp_path), "--cases", "quick", "--engine-timeout", "900"]
    assert cli.main(argv) == 2
    assert seen["timeout"] == 900.0


def test_the_environment_names_what_the_wheels_kernels_were_built_against(tmp_path: Path) -> None:
    package = tmp_path / "lmcache"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_hybridfa.py").write_text(
        'VERSION = "0.5.3+hybridfa.18"\nPATCHES = ()\nKERNELS = "torch 2.13.0+cu130 (CUDA 13.0)"\n'
    )
    proc = subprocess.run(
        [sys.executable, "-c", run.ENV_PROBE],
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("GATE-ENV ")]
    versions = json.loads(line.removeprefix("GATE-ENV "))
    assert versions["hybridfa_kernels"] == "torch 2.13.0+cu130 (CUDA 13.0)"


def _run_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: bool, expect_refusals: bool
) -> tuple[dict, list[str]]:
    """A patched run of the quick set whose engines' lmcache has (or lacks) compiled kernels
    that load: its report, and each case's mode as the run judged it."""
    versions = {"lmcache_dist": "0.5.3+hybridfa.20", "lmcache_compiled_kernels": kernels}
    header = {"arm": "patched", "versions": versions}
    monkeypatch.setattr(run, "start_report", lambda *a: (tmp_path / "r", header, None))
    monkeypatch.setattr(run, "write_report", lambda report, stem: None)
    modes: list[str] = []

    def run_case(case: Case, rc: RunConfig, cold_runs: object) -> dict:
        modes.append(run.case_record(case, rc.arm, rc.base, rc.kernels)["mode"])
        return {"case": case.case_id}

    monkeypatch.setattr(run, "run_case", run_case)
    rc = RunConfig("patched", tmp_path, tmp_path, expect_refusals=expect_refusals)
    return run.run_matrix(select_cases("quick"), rc), modes


def test_a_patched_run_without_loadable_kernels_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report, modes = _run_on(tmp_path, monkeypatch, kernels=False, expect_refusals=False)
    assert modes == [] and "--kernels" in report["error"]
    assert judge.gate_problems({**report, "selected": ["c"]}, "patched") == [report["error"]]


def test_a_run_that_expects_refusals_judges_every_case_as_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report, modes = _run_on(tmp_path, monkeypatch, kernels=False, expect_refusals=True)
    assert "error" not in report and report["expect_refusals"] is True
    assert modes == ["refused"] * 3


def test_a_run_that_expects_refusals_where_the_kernels_load_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report, modes = _run_on(tmp_path, monkeypatch, kernels=True, expect_refusals=True)
    assert modes == [] and "nothing is refused" in report["error"]


def test_the_cli_passes_its_expectation_of_refusals_to_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []

    def run_matrix(cases: object, rc: RunConfig, on_progress: object) -> dict:
        seen.append(rc.expect_refusals)
        return {"error": "stopped here"}

    monkeypatch.setattr(cli, "run_matrix", run_matrix)
    monkeypatch.setattr(cli, "install_cleanup_handler", lambda: None)
    for extra in ([], ["--expect-refusals"]):
        assert cli.main(["--lmcache-dir", str(tmp_path), *extra]) == 2
    assert seen == [False, True]
