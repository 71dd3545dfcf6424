"""The LMCache server SIGKILLed mid-store: after a restart only complete objects restore.

A child process stands in for the server: it stores NUM_KEYS objects of SIZE bytes
(deterministic contents per key), one store task after another, through LMCache's real
FSL2Adapter. In the child only, aiofiles' file write is wrapped: the payload write of
object INTERRUPTED writes its first half, flushes it, reports over a pipe and blocks. The
test sees the half-written file on disk, SIGKILLs the child and opens a fresh adapter on
the same folder, as a restarted server does.

A guard test, not a ``fix`` test: pristine 0.5.3 already writes each object to
``<name>.tmp`` and renames it into place only once it is complete, so a killed store
never leaves a ``.data`` file and both arms pass. The half-written ``.tmp`` file stays on
disk (neither arm removes it) until the same key is stored again.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.bases("0.5.3", "0.5.6")

pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_l2_adapter")

import fs_l2_driver  # noqa: E402
from fs_l2_driver import arm_env, load, lookup, open_adapter, store  # noqa: E402

SIZE = 4 << 20  # bytes per object
NUM_KEYS = 5
INTERRUPTED = 3  # objects 0..2 complete, 3 is killed mid-write, 4 never starts
# Only a hung child meets it; one that imports torch on a loaded 2-core machine can take 15 s.
CHILD_TIMEOUT_S = 60.0


def key(i: int) -> Any:
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk_hash=bytes([i + 1]) * 16, model_name="dense", kv_rank=0)


def payload(i: int) -> bytes:
    return random.Random(i).randbytes(SIZE)


# ---------------------------------------------------------------------------------
# the child: the server that is killed


def _child(base: Path, report_fd: int) -> None:
    from aiofiles.threadpool.binary import AsyncBufferedIOBase

    report = os.fdopen(report_fd, "w", buffering=1)
    real_write = AsyncBufferedIOBase.write
    payload_writes = 0

    async def write(self: Any, data: Any) -> Any:
        nonlocal payload_writes
        if len(data) != SIZE:  # the patched build's integrity trailer
            return await real_write(self, data)
        payload_writes += 1
        if payload_writes <= INTERRUPTED:
            return await real_write(self, data)
        await real_write(self, memoryview(data)[: SIZE // 2])
        await self.flush()
        report.write(f"mid-write {Path(self.name).name}\n")
        await asyncio.Event().wait()  # until the SIGKILL

    AsyncBufferedIOBase.write = write
    fs_l2_driver.TIMEOUT_S = 10 * CHILD_TIMEOUT_S  # the blocked store must not time out first
    adapter = open_adapter(base)
    for i in range(NUM_KEYS):
        store(adapter, [key(i)], [payload(i)])
        report.write(f"stored {i}\n")


# ---------------------------------------------------------------------------------
# the test side


@dataclass
class KilledStore:
    base: Path
    stored: list[int]  # objects whose store completed before the kill


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> KilledStore:
    work = tmp_path_factory.mktemp("killed")
    base = work / "l2"
    read_fd, write_fd = os.pipe()
    with open(work / "child.log", "wb") as log:
        child = subprocess.Popen(
            [sys.executable, __file__, str(base), str(write_fd)],
            pass_fds=(write_fd,),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=arm_env(),
            cwd=work,
        )
    os.close(write_fd)
    watchdog = threading.Timer(CHILD_TIMEOUT_S, child.kill)
    watchdog.start()
    stored: list[int] = []
    partial = None
    try:
        with os.fdopen(read_fd) as reports:
            for line in reports:
                what, _, arg = line.strip().partition(" ")
                if what == "stored":
                    stored.append(int(arg))
                elif what == "mid-write":
                    partial = base / arg
                    break
            assert partial is not None, (
                "child ended before the interrupted write:\n"
                + ((work / "child.log").read_text(errors="replace")[-3000:])
            )
            assert partial.stat().st_size == SIZE // 2, "the kill would not land mid-write"
            child.send_signal(signal.SIGKILL)
    finally:
        watchdog.cancel()
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert stored == list(range(INTERRUPTED))
    return KilledStore(base, stored)


@pytest.fixture
def restarted(killed: KilledStore) -> Iterator[Any]:
    """A fresh adapter on the killed server's folder."""
    adapter = open_adapter(killed.base)
    try:
        yield adapter
    finally:
        adapter.close()


def test_objects_stored_before_the_kill_restore_exactly(killed, restarted):
    keys = [key(i) for i in killed.stored]
    assert lookup(restarted, keys, {}) == [True] * len(keys)
    hits, bufs = load(restarted, keys, SIZE)
    assert hits == [True] * len(keys)
    for i, buf in zip(killed.stored, bufs, strict=True):
        assert buf.data == payload(i), f"object {i} restored with other bytes"


def test_interrupted_and_unstarted_objects_are_a_miss(restarted):
    keys = [key(i) for i in range(INTERRUPTED, NUM_KEYS)]
    assert lookup(restarted, keys, {}) == [False] * len(keys)
    hits, bufs = load(restarted, keys, SIZE)
    assert hits == [False] * len(keys), "a half-written object was restored"
    assert all(buf.data == bytes(SIZE) for buf in bufs), "bytes of a missing object were loaded"


def test_interrupted_object_is_stored_again_after_the_restart(killed, tmp_path):
    base = shutil.copytree(killed.base, tmp_path / "l2")
    adapter = open_adapter(base)
    try:
        store(adapter, [key(INTERRUPTED)], [payload(INTERRUPTED)])
        hits, bufs = load(adapter, [key(INTERRUPTED)], SIZE)
    finally:
        adapter.close()
    assert hits == [True]
    assert bufs[0].data == payload(INTERRUPTED)
    assert not list(base.glob("*.tmp")), "the half-written temp file is still there"


if __name__ == "__main__":
    _child(Path(sys.argv[1]), int(sys.argv[2]))
