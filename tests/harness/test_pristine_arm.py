"""The pristine arm's verdict on ``fix`` tests (tests/conftest.py): each fails at its
expected point, or the run is red.

Each case runs pytest on a small test file beside a copy of tests/conftest.py, under
HYBRIDFA_ARM=pristine, with a stand-in pristine lmcache (a package without _hybridfa).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
INI = """\
[pytest]
markers =
    fix: regression test
    feature: feature
    bases(*versions): bases
"""
HELPER = """\
def check(value):
    assert value == 1, "the helper's assertion"


def other(value):
    assert value == 1
"""


def run_pristine(tmp_path: Path, test_source: str) -> subprocess.CompletedProcess[str]:
    root = tmp_path / "checkout"
    (root / "tests" / "unit").mkdir(parents=True)
    (root / "tests" / "conftest.py").write_text(CONFTEST.read_text())
    (root / "tests" / "unit" / "helper.py").write_text(HELPER)
    (root / "tests" / "unit" / "test_case.py").write_text(textwrap.dedent(test_source))
    (root / "pytest.ini").write_text(INI)
    fake = tmp_path / "site" / "lmcache"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env.update(HYBRIDFA_ARM="pristine", PYTHONPATH=str(tmp_path / "site"))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rx", "tests/unit"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def assert_green(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 fix tests of this base ran, 1 failed at their expected point" in proc.stdout


def assert_red(proc: subprocess.CompletedProcess[str], why: str) -> None:
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert why in proc.stdout, proc.stdout


def test_an_assert_in_the_test_s_own_file_is_the_expected_failure(tmp_path: Path) -> None:
    proc = run_pristine(
        tmp_path,
        """
        import pytest

        def compute():
            return 2

        @pytest.mark.fix
        def test_bug():
            assert compute() == 1
        """,
    )
    assert_green(proc)
    assert "test_case.py:9" in proc.stdout


def test_pytest_fail_and_a_pytest_raises_that_saw_nothing_count_too(tmp_path: Path) -> None:
    proc = run_pristine(
        tmp_path,
        """
        import pytest

        @pytest.mark.fix
        def test_bug():
            with pytest.raises(ValueError):
                pass
        """,
    )
    assert_green(proc)


def test_a_fix_test_that_passes_on_pristine_turns_the_run_red(tmp_path: Path) -> None:
    proc = run_pristine(
        tmp_path,
        """
        import pytest

        @pytest.mark.fix
        def test_bug():
            assert True
        """,
    )
    assert_red(proc, "passed on pristine")


def test_another_exception_turns_the_run_red(tmp_path: Path) -> None:
    proc = run_pristine(
        tmp_path,
        """
        import pytest

        @pytest.mark.fix
        def test_bug():
            {}["missing"]
        """,
    )
    assert_red(proc, "raised KeyError, not an assertion")


def test_an_assertion_in_an_undeclared_helper_turns_the_run_red(tmp_path: Path) -> None:
    proc = run_pristine(
        tmp_path,
        """
        import pytest
        from helper import check

        @pytest.mark.fix
        def test_bug():
            check(2)
        """,
    )
    assert_red(proc, "failed at helper.py:2 in check, expected in test_case.py")


def test_a_declared_helper_is_the_expected_point(tmp_path: Path) -> None:
    proc = run_pristine(
        tmp_path,
        """
        import pytest
        from helper import check

        @pytest.mark.fix(raised_in="helper.py::check", match="helper's assertion")
        def test_bug():
            check(2)
        """,
    )
    assert_green(proc)


@pytest.mark.parametrize(
    "marker, why",
    [
        ('raised_in="helper.py::other"', "expected in helper.py::other"),
        ('raised_in="helper.py", match="another message"', "matching 'another message'"),
    ],
)
def test_a_declared_point_not_reached_turns_the_run_red(
    tmp_path: Path, marker: str, why: str
) -> None:
    proc = run_pristine(
        tmp_path,
        f"""
        import pytest
        from helper import check

        @pytest.mark.fix({marker})
        def test_bug():
            check(2)
        """,
    )
    assert_red(proc, why)


def test_a_skipped_fix_test_turns_the_run_red(tmp_path: Path) -> None:
    proc = run_pristine(
        tmp_path,
        """
        import pytest

        @pytest.fixture
        def server():
            pytest.skip("redis-server not found")

        @pytest.mark.fix
        def test_bug(server):
            assert False
        """,
    )
    assert_red(proc, "skipped on pristine: a fix test must run there (redis-server not found)")


def test_a_file_of_fix_tests_skipped_at_import_turns_the_run_red(tmp_path: Path) -> None:
    proc = run_pristine(
        tmp_path,
        """
        import pytest

        pytest.importorskip("a_module_nobody_has")

        @pytest.mark.fix
        def test_bug():
            assert False
        """,
    )
    assert_red(proc, "FILE OF FIX TESTS SKIPPED WHOLE")


def test_a_fix_test_of_another_base_is_skipped_as_before(tmp_path: Path) -> None:
    proc = run_pristine(
        tmp_path,
        """
        import pytest

        @pytest.mark.fix
        def test_bug():
            assert False

        @pytest.mark.fix
        @pytest.mark.bases("0.5.6")
        def test_other_base():
            assert True
        """,
    )
    assert_green(proc)


def test_a_fix_test_comparing_two_large_payloads_fails_in_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where CI is set, pytest diffs two 64 KiB byte strings in full: for many minutes.
    monkeypatch.setenv("CI", "true")
    proc = run_pristine(
        tmp_path,
        """
        import random

        import pytest

        @pytest.mark.fix
        def test_bug():
            assert random.Random(1).randbytes(64 << 10) == random.Random(2).randbytes(64 << 10)
        """,
    )
    assert_green(proc)
