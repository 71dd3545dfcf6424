"""lmcache 0.5.6's fs L2 adapter publishes whole objects only and restores only intact ones.

A store writes the payload and a trailer keyed by the tier's secret to a temporary name,
syncs it, renames it into place and syncs the folder. A load checks the trailer: a file
that is torn, short, long, damaged or copied under another key's name is a miss with one
warning, never restored, and this server's next store of the key replaces it. Pristine
0.5.6 renames an unsynced file and restores any file at least as long as the buffer.

Real FSL2Adapter of the installed lmcache on tmp_path (fixture ``adapter``); the host
buffers are LMCache's TensorMemoryObj (fs_l2_driver).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.bases("0.5.6")

pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_l2_adapter")

from fs_l2_driver import load, lookup, store  # noqa: E402
from log_recorder import Recorder  # noqa: E402

PAYLOAD = random.Random(56).randbytes(64 << 10)
TRAILER_LEN = 40


def key(n: int = 1) -> Any:
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk_hash=bytes([n]) * 16, model_name="org/model", kv_rank=0)


def object_file(base: Path, n: int = 1) -> Path:
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import _object_key_to_filename

    return base / _object_key_to_filename(key(n))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: len(PAYLOAD) // 2])


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _bitflip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(PAYLOAD) // 3] ^= 0x10
    path.write_bytes(bytes(data))


def _torn_trailer(path: Path) -> None:
    """Cut inside the trailer: a copy or a write that stopped short."""
    path.write_bytes(path.read_bytes()[: len(PAYLOAD) + TRAILER_LEN // 2])


def _oversize(path: Path) -> None:
    """An object of a larger layout under the same name."""
    path.write_bytes(PAYLOAD * 2)


def _appended(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0" * 8)


SHORT: dict[str, Callable[[Path], None]] = {"truncated": _truncate, "empty": _empty}
DAMAGED: dict[str, Callable[[Path], None]] = {
    "bit-flipped": _bitflip,
    "torn-trailer": _torn_trailer,
    "oversized": _oversize,
    "appended": _appended,
}


def test_an_intact_object_round_trips(adapter, tmp_path):
    store(adapter, [key()], [PAYLOAD])
    assert lookup(adapter, [key()], {}) == [True]
    hits, bufs = load(adapter, [key()], len(PAYLOAD))
    assert hits == [True]
    assert bufs[0].data == PAYLOAD


@pytest.mark.parametrize("damage", SHORT.values(), ids=SHORT)
def test_a_short_object_is_a_miss(damage, adapter, tmp_path):
    store(adapter, [key()], [PAYLOAD])
    damage(object_file(tmp_path / "l2"))
    hits, _ = load(adapter, [key()], len(PAYLOAD))
    assert hits == [False]


@pytest.mark.fix
@pytest.mark.parametrize("damage", DAMAGED.values(), ids=DAMAGED)
def test_a_damaged_object_is_a_miss(damage, adapter, tmp_path):
    store(adapter, [key()], [PAYLOAD])
    damage(object_file(tmp_path / "l2"))
    hits, _ = load(adapter, [key()], len(PAYLOAD))
    assert hits == [False], "a damaged object file was restored"


@pytest.mark.fix
def test_an_object_copied_under_another_keys_name_is_a_miss(adapter, tmp_path):
    base = tmp_path / "l2"
    store(adapter, [key(1)], [PAYLOAD])
    object_file(base, 2).write_bytes(object_file(base, 1).read_bytes())
    hits, _ = load(adapter, [key(2)], len(PAYLOAD))
    assert hits == [False], "an object file copied under another key's name was restored"


@pytest.mark.fix
def test_a_rejected_object_is_logged_once_naming_it_and_the_cause(adapter, tmp_path, monkeypatch):
    from lmcache.v1.distributed.l2_adapters import fs_l2_adapter

    store(adapter, [key()], [PAYLOAD])
    path = object_file(tmp_path / "l2")
    _bitflip(path)
    recorder = Recorder()
    monkeypatch.setattr(fs_l2_adapter, "logger", recorder)
    hits = [load(adapter, [key()], len(PAYLOAD))[0][0] for _ in range(3)]
    assert hits == [False] * 3, "a damaged object file was restored"
    assert len(recorder.warnings) == 1, recorder.warnings
    assert path.name in recorder.warnings[0] and "tag mismatch" in recorder.warnings[0]


@pytest.mark.fix
def test_the_next_store_replaces_a_rejected_object(adapter, tmp_path):
    store(adapter, [key()], [PAYLOAD])
    path = object_file(tmp_path / "l2")
    _truncate(path)
    load(adapter, [key()], len(PAYLOAD))  # the miss
    assert path.exists(), "a load removed a file that failed its check"
    store(adapter, [key()], [PAYLOAD])
    hits, bufs = load(adapter, [key()], len(PAYLOAD))
    assert hits == [True], "a rejected file stays in place and blocks every later store"
    assert bufs[0].data == PAYLOAD


@pytest.mark.fix
def test_a_store_syncs_the_object_before_its_name_appears_and_the_folder_after(
    adapter, tmp_path, monkeypatch
):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        events.append(("rename", os.path.realpath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    store(adapter, [key()], [PAYLOAD])
    base = (tmp_path / "l2").resolve()
    final = str(object_file(base))
    assert events[:1] == [("fsync", final[: -len(".data")] + ".tmp")], (
        f"the object was not synced under its temporary name first: {events}"
    )
    assert events[1:] == [("rename", final), ("fsync", str(base))], (
        f"the rename was not followed by a sync of the folder: {events}"
    )


def test_delete_accounts_for_the_payload_only(adapter, tmp_path):
    store(adapter, [key(1), key(2)], [PAYLOAD, PAYLOAD])
    assert adapter.get_usage().total_bytes_used == 2 * len(PAYLOAD)
    adapter.delete([key(1)])
    assert not object_file(tmp_path / "l2", 1).exists()
    assert adapter.get_usage().total_bytes_used == len(PAYLOAD)
