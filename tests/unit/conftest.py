"""Fixtures shared by the CPU tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def _temp_env_folder(tmp_path_factory: pytest.TempPathFactory, variable: str) -> Iterator[Path]:
    """``$variable`` pointing at a new temp folder while the session lasts (child
    processes inherit it)."""
    folder = tmp_path_factory.mktemp(variable.lower())
    before = os.environ.get(variable)
    os.environ[variable] = str(folder)
    yield folder
    if before is None:
        os.environ.pop(variable, None)
    else:
        os.environ[variable] = before


@pytest.fixture(autouse=True, scope="session")
def tier_secret_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """$XDG_CONFIG_HOME in a temp folder: the L2 adapters create their default tier secret
    there (lmcache/l2-tier.key), not in the user's home."""
    yield from _temp_env_folder(tmp_path_factory, "XDG_CONFIG_HOME")


@pytest.fixture(autouse=True, scope="session")
def digest_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """$XDG_CACHE_HOME in a temp folder: the connector keeps its weight-file digests
    there (lmcache-hybridfa/file-digests), not in the user's home."""
    yield from _temp_env_folder(tmp_path_factory, "XDG_CACHE_HOME")


@pytest.fixture
def adapter(tmp_path: Path) -> Iterator[Any]:
    """LMCache's real fs L2 adapter (FSL2Adapter) on ``tmp_path / "l2"``."""
    from fs_l2_driver import open_adapter

    adp = open_adapter(tmp_path / "l2")
    try:
        yield adp
    finally:
        adp.close()


@pytest.fixture
def real_servers(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Starts whole LMCache servers on CPU over an fs L2 folder (restore_server)."""
    from restore_server import ServerFactory

    factory = ServerFactory(monkeypatch)
    try:
        yield factory
    finally:
        factory.close_all()
