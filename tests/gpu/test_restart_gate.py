"""GPU restart gate for the arm in HYBRIDFA_ARM (tests/conftest.py), on the lmcache this pytest
imports (its folder goes first on the engines' PYTHONPATH). The criteria (a)-(e) and what each
arm must show: hybridfa_gate/judge.py.

Environment: HYBRIDFA_GATE_CASES (default quick; a set name, case ids or regexes),
HYBRIDFA_GATE_OUT (default results/), HYBRIDFA_GATE_TP (default 1).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from hybridfa_gate.cases import select_cases
from hybridfa_gate.judge import gate_problems
from hybridfa_gate.report import markdown_report
from hybridfa_gate.run import run_matrix
from hybridfa_gate.specs import RunConfig

ARM = os.environ.get("HYBRIDFA_ARM", "patched")


def _lmcache_dir() -> Path:
    spec = importlib.util.find_spec("lmcache")
    if spec is None or spec.origin is None:
        pytest.skip("lmcache is not importable")
    return Path(spec.origin).resolve().parent.parent


@pytest.fixture(scope="module")
def report() -> dict:
    rc = RunConfig(
        arm=ARM,
        lmcache_dir=_lmcache_dir(),
        out=Path(os.environ.get("HYBRIDFA_GATE_OUT", "results")),
    )
    tp = int(os.environ.get("HYBRIDFA_GATE_TP", "1"))
    cases = select_cases(os.environ.get("HYBRIDFA_GATE_CASES", "quick"), tp)
    return {**run_matrix(cases, rc), "selected": [c.case_id for c in cases]}


@pytest.mark.gpu
def test_restart_gate(report: dict) -> None:
    problems = gate_problems(report, ARM)
    assert not problems, "\n".join(problems) + "\n" + markdown_report(report)
