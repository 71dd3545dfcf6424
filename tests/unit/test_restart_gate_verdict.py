"""The restart gate's pytest verdict over a report, without a GPU."""

from __future__ import annotations

import sys

from script_modules import GPU_DIR, load_script

sys.path.insert(0, str(GPU_DIR))  # test_restart_gate imports gate by that name
entry = load_script("hybridfa_test_restart_gate", GPU_DIR / "test_restart_gate.py")

PASS = {"completed": True, "pass": True, **dict.fromkeys("abcde", True)}


def _report(*evals: dict, selected: int | None = None) -> dict:
    cases = [{"case": f"c{i}", "eval": ev} for i, ev in enumerate(evals)]
    names = [f"c{i}" for i in range(len(evals) if selected is None else selected)]
    return {"cases": cases, "selected": names}


def test_every_selected_case_passing_is_a_pass() -> None:
    assert entry.gate_problems(_report(PASS, PASS), "patched") == []


def test_a_selected_case_that_did_not_run_fails_the_gate() -> None:
    assert entry.gate_problems(_report(PASS, selected=2), "patched") == ["c1: did not run"]


def test_a_refused_case_is_judged_on_b_c_e() -> None:
    refused = {**PASS, "refused": True, "a": None, "d": None}
    assert entry.gate_problems(_report(refused), "patched") == []


def test_a_pristine_case_that_restored_nothing_does_not_show_the_bug() -> None:
    nothing = {"completed": True, "pass": False, "bytes_match": None}
    assert "restored nothing" in entry.gate_problems(_report(nothing), "pristine")[0]
