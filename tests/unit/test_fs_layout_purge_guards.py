"""The fs layout purge command removes only what it is asked to.

``fs_layout_purge --model X --keep K --delete`` removes X's objects of layouts other
than K. It used to remove X's objects without a layout fingerprint too (its docstring
said they are never selected), and a mistyped K removed every layout of X, the live one
included. Now objects without a fingerprint and layouts written in the last ten minutes
are kept unless a flag asks for them, and a K that no object of X has removes nothing.

The folder is written by the real FSL2Adapter; the command runs in-process (``main``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_layout_purge")

from fs_l2_driver import open_adapter, store  # noqa: E402

pytestmark = [pytest.mark.bases("0.5.3", "0.5.6"), pytest.mark.feature]

MODEL = "hybrid"
LIVE, OLD = "0123456789abcdef", "fedcba9876543210"


def key(model: str, i: int = 1) -> Any:
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk_hash=bytes([i]) * 16, model_name=model, kv_rank=0)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """Two objects each of MODEL in layouts LIVE and OLD, without a fingerprint, and of
    another model; all written an hour ago."""
    base = tmp_path / "l2"
    adapter = open_adapter(base)
    try:
        for model in (f"{MODEL}~hfa-{LIVE}", f"{MODEL}~hfa-{OLD}", MODEL, "other"):
            store(adapter, [key(model, 1), key(model, 2)], [b"x" * 4096] * 2)
    finally:
        adapter.close()
    age(base.glob("*.data"), 3600)
    return base


def age(paths: Any, seconds: float) -> None:
    then = time.time() - seconds
    for path in paths:
        os.utime(path, (then, then))


def purge(base: Path, *args: str) -> int:
    from lmcache.v1.distributed.l2_adapters.fs_layout_purge import main

    return main([str(base), "--model", MODEL, *args, "--delete"])


def left(base: Path) -> dict[str, int]:
    """Object files per model name (with its fingerprint)."""
    counts: dict[str, int] = {}
    for path in base.glob("*.data"):
        name = path.name.split("@", 1)[0]
        counts[name] = counts.get(name, 0) + 1
    return counts


def test_the_purge_keeps_objects_without_a_fingerprint(folder):
    assert purge(folder, "--keep", LIVE) == 0
    assert left(folder) == {f"{MODEL}~hfa-{LIVE}": 2, MODEL: 2, "other": 2}


def test_the_purge_removes_objects_without_a_fingerprint_when_asked(folder):
    assert purge(folder, "--keep", LIVE, "--include-unnamespaced") == 0
    assert left(folder) == {f"{MODEL}~hfa-{LIVE}": 2, "other": 2}


@pytest.mark.parametrize("keep", [LIVE[:-1] + "0", "", LIVE.upper()], ids=["typo", "empty", "case"])
def test_a_keep_no_object_has_removes_nothing(keep, folder, capsys):
    before = left(folder)
    assert purge(folder, "--keep", keep, "--include-unnamespaced", "--include-live") == 2
    assert left(folder) == before
    err = capsys.readouterr().err
    assert "refused" in err and LIVE in err and OLD in err


def test_a_layout_written_in_the_last_ten_minutes_is_kept(folder, capsys):
    age(folder.glob(f"{MODEL}~hfa-{OLD}@*.data"), 60)
    assert purge(folder, "--keep", LIVE) == 0
    assert left(folder)[f"{MODEL}~hfa-{OLD}"] == 2
    assert f"layout {OLD} of {MODEL} was written" in capsys.readouterr().err


def test_a_layout_written_in_the_last_ten_minutes_is_removed_when_asked(folder):
    age(folder.glob(f"{MODEL}~hfa-{OLD}@*.data"), 60)
    assert purge(folder, "--keep", LIVE, "--include-live") == 0
    assert f"{MODEL}~hfa-{OLD}" not in left(folder)
