"""GPU restart gate, quick cases, for the arm in HYBRIDFA_ARM (tests/conftest.py).

patched:  every case passes (a)-(e).
pristine: every case completes and fails (a): the restored FA bytes differ (issue 6).

Environment: HYBRIDFA_GATE_OUT (default results/), HYBRIDFA_GATE_CASES (default quick),
HYBRIDFA_GATE_TP (default 1).
The lmcache under test is the one this pytest imports (its folder goes first on the
engines' PYTHONPATH).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import gate
import pytest

ARM = os.environ.get("HYBRIDFA_ARM", "patched")


def _lmcache_dir() -> Path:
    spec = importlib.util.find_spec("lmcache")
    if spec is None or spec.origin is None:
        pytest.skip("lmcache is not importable")
    return Path(spec.origin).resolve().parent.parent


@pytest.fixture(scope="module")
def report() -> dict:
    rc = gate.RunConfig(
        arm=ARM,
        lmcache_dir=_lmcache_dir(),
        out=Path(os.environ.get("HYBRIDFA_GATE_OUT", "results")),
    )
    tp = int(os.environ.get("HYBRIDFA_GATE_TP", "1"))
    cases = gate.select_cases(os.environ.get("HYBRIDFA_GATE_CASES", "quick"), tp)
    return {**gate.run_matrix(cases, rc), "selected": [c.case_id for c in cases]}


def _summary(report: dict) -> str:
    return "\n" + gate.markdown_report(report)


def gate_problems(report: dict, arm: str) -> list[str]:
    """Why a gate report does not pass for ``arm``: patched, every selected case ran and passed
    (a)-(e), or (b) (c) (e) where the server refuses its layout; otherwise every case ran and
    failed (a) by comparison."""
    if report.get("error"):
        return [str(report["error"])]
    cases = report.get("cases") or []
    if not cases:
        return ["no case ran"]
    problems = [
        f"{c}: did not run" for c in sorted(set(report["selected"]) - {r["case"] for r in cases})
    ]
    for rec in cases:
        ev = rec["eval"]
        if not ev.get("completed"):
            problems.append(f"{rec['case']}: {ev.get('errors')}")
        elif arm == "patched":
            if not ev.get("pass"):  # evaluate_case's pass: (a)-(e), or (b) (c) (e) if refused
                problems.append(f"{rec['case']}: {gate.verdict(ev)} errors={ev.get('errors')}")
        else:
            shown, why = gate.pristine_shows_the_bug(ev)
            if not shown:
                problems.append(f"{rec['case']}: {why}")
    return problems


@pytest.mark.gpu
def test_restart_gate(report: dict) -> None:
    problems = gate_problems(report, ARM)
    assert not problems, "\n".join(problems) + _summary(report)
