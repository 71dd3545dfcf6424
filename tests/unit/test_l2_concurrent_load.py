"""The fs L2 adapter reads the objects of one load task concurrently.

A restore's prefetch is one load task over every chunk of the prompt. Pristine 0.5.3 reads them
one file after another, so the disk idles between two reads (bench/fs_l2_read.py measures it).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import aiofiles
import pytest
from fs_l2_driver import load, store

pytestmark = pytest.mark.bases("0.5.3", "0.5.6")

N_OBJECTS = 8
PAYLOADS = [bytes([i + 1]) * 4096 for i in range(N_OBJECTS)]


class OpenReads:
    """Counts object files open for reading at once; each open pauses a little so that
    reads which the adapter would overlap do overlap."""

    def __init__(self) -> None:
        self.now = self.most = 0
        self._lock = threading.Lock()
        self._real_open = aiofiles.open

    def open(self, path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = self._real_open(path, mode, *args, **kwargs)
        return self._Counted(self, handle) if mode == "rb" else handle

    class _Counted:
        def __init__(self, reads: OpenReads, handle: Any) -> None:
            self.reads, self.handle = reads, handle

        async def __aenter__(self) -> Any:
            with self.reads._lock:
                self.reads.now += 1
                self.reads.most = max(self.reads.most, self.reads.now)
            await asyncio.sleep(0.05)
            return await self.handle.__aenter__()

        async def __aexit__(self, *exc: Any) -> Any:
            try:
                return await self.handle.__aexit__(*exc)
            finally:
                with self.reads._lock:
                    self.reads.now -= 1


def _keys(n: int = N_OBJECTS) -> list[Any]:
    from lmcache.v1.distributed.api import ObjectKey

    return [
        ObjectKey(chunk_hash=bytes([i + 1]) * 16, model_name="dense", kv_rank=0) for i in range(n)
    ]


@pytest.mark.feature
def test_one_load_task_reads_several_objects_at_once(adapter, monkeypatch):
    keys = _keys()
    store(adapter, keys, PAYLOADS)
    reads = OpenReads()
    monkeypatch.setattr(aiofiles, "open", reads.open)
    hits, _ = load(adapter, keys, len(PAYLOADS[0]))
    assert hits == [True] * N_OBJECTS
    assert reads.most >= 2, "the adapter read the objects of one load task one at a time"


@pytest.mark.feature
def test_one_load_task_keeps_sixteen_reads_in_flight(adapter, monkeypatch):
    # 0.5.3 reads one file at a time; four at a time left a page-cache restore at a third of
    # what parallel reads reach (docs/results.md).
    keys = _keys(40)
    payloads = [bytes([i + 1]) * 4096 for i in range(40)]
    store(adapter, keys, payloads)
    reads = OpenReads()
    monkeypatch.setattr(aiofiles, "open", reads.open)
    hits, _ = load(adapter, keys, 4096)
    assert hits == [True] * 40
    assert reads.most >= 16, f"at most {reads.most} object files were read at once"


def test_concurrent_load_keeps_every_object_in_its_own_buffer(adapter, tmp_path):
    keys = _keys()
    store(adapter, keys, PAYLOADS)
    damaged = sorted((tmp_path / "l2").rglob("*.data"))[3]
    damaged.write_bytes(damaged.read_bytes()[:100])
    hits, bufs = load(adapter, keys, len(PAYLOADS[0]))
    assert hits.count(False) == 1
    for hit, buf, payload in zip(hits, bufs, PAYLOADS, strict=True):
        if hit:
            assert buf.data == payload
