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


@pytest.mark.gpu
def test_restart_gate(report: dict) -> None:
    assert not report.get("error"), report.get("error")
    cases = report["cases"]
    assert cases, "no case ran" + _summary(report)
    not_run = set(report["selected"]) - {rec["case"] for rec in cases}
    assert not not_run, f"cases that did not run: {sorted(not_run)}" + _summary(report)
    for rec in cases:
        ev = rec["eval"]
        assert ev.get("completed"), f"{rec['case']}: {ev.get('errors')}" + _summary(report)
        if ARM == "patched":
            # a refused layout (fs_native) must miss: (a) and (d) do not apply
            failed = [k for k in ("bce" if ev.get("refused") else "abcde") if not ev.get(k)]
            assert ev["pass"] and not failed, (
                f"{rec['case']}: failed {failed} errors={ev.get('errors')} "
                f"kv={ev.get('kv')}" + _summary(report)
            )
        else:
            shown, why = gate.pristine_shows_the_bug(ev)
            assert shown, f"{rec['case']}: {why}" + _summary(report)
