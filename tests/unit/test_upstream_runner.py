"""The upstream runner's verdict: which persistent failures count as regressions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

RUNNER = Path(__file__).resolve().parent.parent / "upstream" / "run_upstream.py"
spec = importlib.util.spec_from_file_location("hybridfa_run_upstream", RUNNER)
assert spec is not None and spec.loader is not None
runner = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = runner
spec.loader.exec_module(runner)


def test_passes_on_pristine_and_fails_again_on_patched_is_a_regression() -> None:
    regressions, pristine_fail, flaky = runner.classify(
        ["t::a"], {"t::a": ["passed"]}, {"t::a": ["failed", "failed"]}
    )
    assert (regressions, pristine_fail, flaky) == (["t::a"], [], [])


def test_failing_on_pristine_too_is_not_a_regression() -> None:
    assert runner.classify(["t::b"], {"t::b": ["failed"] * 3}, {}) == ([], ["t::b"], [])


def test_passing_on_patched_right_after_pristine_is_flaky() -> None:
    got = runner.classify(["t::c"], {"t::c": ["passed"]}, {"t::c": ["failed", "passed"]})
    assert got == ([], [], ["t::c"])


def _entry(pattern: str) -> object:
    import re

    regex = re.compile(".*".join(re.escape(p) for p in pattern.split("*")) + r"\Z")
    return runner.Known(pattern, "0017: by design", regex)


def test_a_test_the_series_changes_is_reported_apart_from_regressions() -> None:
    key = "tests/v1/test_mm.py::test_key"
    got = runner.split_changed([key, "tests/v1/x.py::t"], [_entry(key)], ["tests"])
    assert got == (["tests/v1/x.py::t"], [key], [])


def test_a_changed_entry_whose_test_no_longer_fails_is_stale() -> None:
    key = "tests/v1/test_mm.py::test_key"
    assert runner.split_changed([], [_entry(key)], ["tests"]) == ([], [], [key])
