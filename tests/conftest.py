"""Test arms: run our tests against the patched build (default) or the pristine base.

HYBRIDFA_ARM=patched   lmcache must be our build (lmcache._hybridfa present).
HYBRIDFA_ARM=pristine  lmcache must be the pristine base. A test marked ``feature`` pins
                       what pristine lacks and is skipped there. A test marked ``fix`` must
                       fail there at its expected point, and nowhere else:

  * the failure is an AssertionError (an ``assert``) or ``pytest.fail`` (``pytest.raises``
    that saw nothing raised is one too);
  * its raising frame, the innermost one outside pytest's own code, is in the test's own
    file (any function of it). A test whose bug shows in a helper of another file declares
    it, e.g. a hang that fs_l2_driver.wait_for reports:
    ``@pytest.mark.fix(raised_in="fs_l2_driver.py::wait_for", match="did not complete")``
    (a file name under tests/, optionally ``::function``; ``match`` requires the failure's
    message to match, re.search). Use them sparingly: a declared helper says what the test
    pins, and the file or function must be one only that bug reaches.

  Anything else turns the run red: a ``fix`` test that passes on pristine, fails with
  another exception (ImportError, TypeError, KeyError, ...), fails at an assertion
  elsewhere (a library's own ``assert``, a shared helper not declared), or is skipped (a
  missing redis-server, a ``pytest.skip``, a ``skipif``), and a test file that holds a
  ``fix`` test of this base and is skipped whole at import. A ``fix`` test of another base
  is skipped as below; one that only a vLLM version can run is left out of the pristine
  pass on other vLLMs (``--deselect``/``--ignore`` in tests/run), never skipped. The
  terminal summary counts the ``fix`` tests of this base and how many failed at their
  expected point.

  So a new ``fix`` test written plainly (it calls the code under test and ends in an
  ``assert`` of its own) needs no argument. A test that drives a shared helper which
  asserts for it (restore_server's byte comparison in restore_through/restore_compared)
  asserts on what the helper's twin returns instead (restored_and_wrong,
  restart_and_restore: the blocks restored and those whose bytes differ), and a test of a
  miss asserts on the lookup (hit_blocks, hit_after_restart), before any restore.

Bases: the installed lmcache's release (0.5.3 or 0.5.6) is the base under test. A test
runs on the bases its ``bases(...)`` marker names, by default on 0.5.3 only; on another
base it is skipped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
ARM = os.environ.get("HYBRIDFA_ARM", "patched")


def _checkout_last() -> None:
    """The checkout's own packages (hybridfa_build, hybridfa_gate, bench) import from its
    root, which goes last on sys.path: `python -m pytest` puts it first, where a materialized
    lmcache/ (`python -m hybridfa_build wheel` writes one) would shadow the installed wheel or
    the PYTHONPATH build under test."""
    rest = [p for p in sys.path if Path(p or ".").resolve() != REPO]
    sys.path[:] = [*rest, str(REPO)]


_checkout_last()


def _lmcache_state() -> tuple[Path, bool] | None:
    spec = importlib.util.find_spec("lmcache")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).resolve().parent, importlib.util.find_spec(
        "lmcache._hybridfa"
    ) is not None


DEFAULT_BASES = ("0.5.3",)


def _installed_base() -> str:
    """The lmcache release installed (its version without the local +hybridfa.N)."""
    try:
        return metadata.version("lmcache").split("+", 1)[0]
    except metadata.PackageNotFoundError:
        return DEFAULT_BASES[0]


BASE = _installed_base()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """On a base other than 0.5.3, a test file that names no ``bases`` marker with that
    base is not even imported: its imports may be of 0.5.3's modules."""
    if BASE in DEFAULT_BASES or not collection_path.name.startswith("test_"):
        return None
    if collection_path.suffix != ".py" or not collection_path.is_file():
        return None
    text = collection_path.read_text()
    named = re.search(rf"mark\.bases\([^)]*\"{re.escape(BASE)}\"", text)
    return True if named is None else None


def pytest_report_header(config: pytest.Config) -> str:
    state = _lmcache_state()
    where = f"{state[0]} ({'patched' if state[1] else 'pristine'})" if state else "absent"
    return f"hybridfa arm: {ARM}; lmcache: {where}; base {BASE}"


def pytest_configure(config: pytest.Config) -> None:
    ROOTDIR[0] = config.rootpath
    # Where CI is set, pytest explains a failed comparison with a full difflib diff: minutes
    # for two 64 KiB payloads, and the pristine arms fail such comparisons on purpose.
    for name in ("CI", "BUILD_NUMBER"):
        os.environ.pop(name, None)
    if ARM not in ("patched", "pristine"):
        raise pytest.UsageError(f"HYBRIDFA_ARM must be patched or pristine, not {ARM!r}")
    state = _lmcache_state()
    if state is None:
        return  # tests that need lmcache skip on their own
    where, patched = state
    if where == REPO / "lmcache":
        raise pytest.UsageError(
            f"lmcache is imported from the materialized tree {where}, not from an installed "
            "wheel: install it (python -m hybridfa_build install) or put a build on PYTHONPATH"
        )
    if patched != (ARM == "patched"):
        raise pytest.UsageError(
            f"HYBRIDFA_ARM={ARM} but the lmcache at {where} is "
            f"{'patched' if patched else 'pristine'}"
        )


def _item_bases(item: pytest.Item) -> tuple[str, ...]:
    marker = item.get_closest_marker("bases")
    return tuple(marker.args) if marker is not None else DEFAULT_BASES


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("fix") is not None:
            ExpectedFailure.of(item)  # a wrong argument is an error on either arm
        bases = _item_bases(item)
        if BASE not in bases:
            item.add_marker(
                pytest.mark.skip(reason=f"written for the lmcache {', '.join(bases)} base")
            )
    if ARM != "pristine":
        return
    for item in items:
        if item.get_closest_marker("feature") is not None:
            item.add_marker(pytest.mark.skip(reason=f"pristine lmcache {BASE} lacks this feature"))


# ---------------------------------------------------------------------------------------
# The pristine arm: every ``fix`` test fails at its expected point (module docstring).


def _outside_pytest(path: str) -> bool:
    return not any(part in ("_pytest", "pytest", "pluggy") for part in Path(path).parts)


@dataclass(frozen=True)
class ExpectedFailure:
    """Where a ``fix`` test fails on pristine: a file (and function) and a message."""

    file: str
    function: str | None = None
    match: str | None = None

    @classmethod
    def of(cls, item: pytest.Item) -> ExpectedFailure:
        marker = item.get_closest_marker("fix")
        kwargs = dict(marker.kwargs) if marker is not None else {}
        unknown = set(kwargs) - {"raised_in", "match"}
        if unknown or (marker is not None and marker.args):
            raise pytest.UsageError(
                f"{item.nodeid}: fix takes raised_in= and match= only, not {marker}"
            )
        where = kwargs.get("raised_in") or Path(str(item.path)).name
        file, _, function = where.partition("::")
        return cls(file, function or None, kwargs.get("match"))

    def __str__(self) -> str:
        where = f"{self.file}::{self.function}" if self.function else self.file
        return where + (f" matching {self.match!r}" if self.match else "")


def raising_frame(excinfo: pytest.ExceptionInfo[BaseException]) -> tuple[str, str, int] | None:
    """(file name, function, line) of the innermost frame outside pytest and pluggy: the
    line of the ``assert``, or of the ``pytest.fail``/``pytest.raises`` that failed."""
    for entry in reversed(excinfo.traceback):
        path = str(entry.path)
        if _outside_pytest(path):
            return Path(path).name, entry.name, entry.lineno + 1
    return None


def fails_as_expected(
    expected: ExpectedFailure, excinfo: pytest.ExceptionInfo[BaseException]
) -> str | None:
    """None when the failure is the expected one, else why not."""
    if not isinstance(excinfo.value, (AssertionError, pytest.fail.Exception)):
        return f"raised {excinfo.typename}, not an assertion"
    frame = raising_frame(excinfo)
    if frame is None:
        return "raised from pytest's own code only"
    file, function, line = frame
    if file != expected.file or (expected.function and function != expected.function):
        return f"failed at {file}:{line} in {function}, expected in {expected}"
    message = str(excinfo.value)
    if expected.match and not re.search(expected.match, message):
        return (
            f"failed with {message.splitlines()[0] if message else '(no message)'!r}, "
            f"expected {expected}"
        )
    return None


PRISTINE_FIX: dict[str, str] = {}  # node id -> "expected" or why not
SKIPPED_FILES: list[str] = []
ROOTDIR: list[Path] = [REPO]


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Iterator[pytest.TestReport]:
    report: pytest.TestReport = yield
    if ARM != "pristine" or item.get_closest_marker("fix") is None:
        return report
    if BASE not in _item_bases(item) or call.when == "teardown":
        return report
    reason = f"pristine lmcache {BASE} has the bug this test pins"
    if report.skipped:
        why = "skipped on pristine: a fix test must run there"
        if call.excinfo is not None:
            why += f" ({_first_line(str(call.excinfo.value))})"
    elif call.when == "setup":
        return report  # a setup error stays an error
    elif call.excinfo is None:
        why = "passed on pristine: a fix test must fail there"
    else:
        expected = ExpectedFailure.of(item)
        why = fails_as_expected(expected, call.excinfo) or ""
        if not why:
            frame = raising_frame(call.excinfo)
            PRISTINE_FIX[item.nodeid] = "expected"
            report.outcome = "skipped"
            report.wasxfail = f"{reason}: {frame[0]}:{frame[2]}" if frame else reason
            return report
    PRISTINE_FIX[item.nodeid] = why
    report.outcome = "failed"
    note = f"[pristine arm] {why}"
    if isinstance(report.longrepr, str) or report.longrepr is None:
        report.longrepr = f"{note}\n{report.longrepr or ''}".rstrip()
    else:
        report.sections.append(("pristine arm", note))
        report.longrepr = f"{note}\n{report.longrepr}"
    return report


def _file_runs_on_base(text: str) -> bool:
    named = re.findall(r"mark\.bases\(([^)]*)\)", text)
    if not named:
        return BASE in DEFAULT_BASES
    return any(f'"{BASE}"' in args for args in named)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if ARM != "pristine" or not report.skipped:
        return
    path = Path(report.fspath)
    if not path.is_absolute():  # a node id's path, from the rootdir
        path = ROOTDIR[0] / path
    if path.suffix != ".py" or not path.name.startswith("test_") or not path.is_file():
        return
    text = path.read_text()
    if "mark.fix" in text and _file_runs_on_base(text):
        SKIPPED_FILES.append(f"{report.nodeid}: {_first_line(str(report.longrepr))}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if ARM == "pristine" and SKIPPED_FILES and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if ARM != "pristine" or not (PRISTINE_FIX or SKIPPED_FILES):
        return
    write = terminalreporter.write_line
    expected = sum(1 for v in PRISTINE_FIX.values() if v == "expected")
    write(
        f"pristine lmcache {BASE}: {len(PRISTINE_FIX)} fix tests of this base ran, "
        f"{expected} failed at their expected point"
    )
    for nodeid, why in PRISTINE_FIX.items():
        if why != "expected":
            write(f"NOT AT ITS POINT: {nodeid}: {why}", red=True)
    for line in SKIPPED_FILES:
        write(f"FILE OF FIX TESTS SKIPPED WHOLE: {line}", red=True)


@pytest.fixture(scope="session")
def pristine_wheel() -> Path:
    """The pinned pristine lmcache wheel for this Python, fetched by the factory's cache."""
    root = REPO
    pins = json.loads((root / "pins.json").read_text())
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    default = Path.home() / ".cache" / "lmcache-hybridfa"
    cache = Path(os.environ.get("LMCACHE_HYBRIDFA_CACHE", default))
    path = cache / pins["wheels"][tag]["filename"]
    if not path.is_file():
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "hybridfa_build",
                "wheel",
                "--no-materialize",
                "--out",
                str(cache / "probe"),
            ],
            cwd=root,
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
    return path


@pytest.fixture
def redis(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A real redis-server on a free port in the test's temp folder, without persistence
    (hybridfa_gate.l2's, which the restart gate uses too); a test marked
    ``redis_maxmemory("2mb")`` gets one that evicts (``allkeys-lru``). Without a
    redis-server binary ($REDIS_SERVER or PATH) the test skips, saying so."""
    from hybridfa_gate.l2 import RedisServer, redis_server_binary

    binary = redis_server_binary()
    if binary is None:
        pytest.skip(
            "redis-server not found ($REDIS_SERVER or PATH): the resp L2 tier is not tested; "
            "install it (Debian: apt-get install redis-server)"
        )
    marker = request.node.get_closest_marker("redis_maxmemory")
    server = RedisServer(
        binary, workdir=tmp_path / "redis", maxmemory=marker.args[0] if marker else None
    )
    server.start()
    try:
        yield server
    finally:
        server.close()
