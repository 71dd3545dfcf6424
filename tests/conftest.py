"""Test arms: run our tests against the patched build (default) or the pristine base.

HYBRIDFA_ARM=patched   lmcache must be our build (lmcache._hybridfa present).
HYBRIDFA_ARM=pristine  lmcache must be the pristine base; every test marked ``fix`` is then
                       a strict expected failure, and only an assertion failure counts:
                       a regression test that passes on pristine, or breaks for another
                       reason (ImportError, TypeError, ...), turns the run red.
                       A test marked ``feature`` pins what pristine lacks and is
                       skipped there.

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        marker = item.get_closest_marker("bases")
        bases = marker.args if marker is not None else DEFAULT_BASES
        if BASE not in bases:
            item.add_marker(
                pytest.mark.skip(reason=f"written for the lmcache {', '.join(bases)} base")
            )
    if ARM != "pristine":
        return
    for item in items:
        if item.get_closest_marker("feature") is not None:
            item.add_marker(pytest.mark.skip(reason=f"pristine lmcache {BASE} lacks this feature"))
        if item.get_closest_marker("fix") is not None:
            item.add_marker(
                pytest.mark.xfail(
                    strict=True,
                    raises=(AssertionError, pytest.fail.Exception),
                    reason=f"pristine lmcache {BASE} has the bug this test pins",
                )
            )


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
