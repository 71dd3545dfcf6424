"""Drive LMCache's real fs L2 adapter (FSL2Adapter) synchronously from tests.

Host buffers are LMCache's real ``TensorMemoryObj`` over a CPU tensor: its ``byte_array``
is a ctypes-backed memoryview (format ``<B``), which is what the server hands the adapter
(a plain ``bytearray``, format ``B``, once hid a crash in the integrity trailer).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hybrid_kv import host_object

TIMEOUT_S = 5.0


class Buf:
    """A host object: the bytes the fs adapter writes from or loads into."""

    def __init__(self, data: bytes) -> None:
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0)
        self.raw = raw.to(torch.uint8)
        self.obj = host_object(self.raw)

    @property
    def byte_array(self) -> memoryview:
        return self.obj.byte_array

    @property
    def data(self) -> bytes:
        return self.raw.numpy().tobytes()


def arm_env() -> dict[str, str]:
    """Environment for a child Python that imports the lmcache under test, whatever else
    is on sys.path or in its working directory."""
    import lmcache

    return dict(os.environ, PYTHONPATH=str(Path(lmcache.__file__).resolve().parent.parent))


def open_adapter(base: Path, **config: Any) -> Any:
    """The fs adapter on ``base``; ``config``: more of its config keys (``secret_file``),
    which pristine's config ignores."""
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import (
        FSL2Adapter,
        FSL2AdapterConfig,
    )

    return FSL2Adapter(FSL2AdapterConfig.from_dict({"base_path": str(base), **config}))


def wait_for(poll: Any, what: str, timeout: float = TIMEOUT_S) -> Any:
    """``poll()``'s first result that is not None, polled for ``timeout`` seconds. A wait
    that never ends is the code under test hanging (0.5.3's Redis client waits forever on a
    vanished key): it fails the test, as an assertion would."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = poll()
        if result is not None:
            return result
        time.sleep(0.01)
    pytest.fail(f"{what} did not complete within {timeout}s")


def store(adapter: Any, keys: list[Any], payloads: list[bytes]) -> None:
    task = adapter.submit_store_task(keys, [Buf(p) for p in payloads])
    result = wait_for(lambda: adapter.pop_completed_store_tasks().get(task), "fs L2 store")
    if int(result) < 0:
        raise RuntimeError("fs L2 store failed")


def lookup(adapter: Any, keys: list[Any], layouts: dict[int, Any]) -> list[bool]:
    task = adapter.submit_lookup_and_lock_task(keys, layouts)
    bitmap = wait_for(lambda: adapter.query_lookup_and_lock_result(task), "fs L2 lookup")
    return [bitmap.test(i) for i in range(len(keys))]


def load(adapter: Any, keys: list[Any], nbytes: int) -> tuple[list[bool], list[Buf]]:
    """Load each key into a fresh zeroed ``nbytes`` buffer; (hit flags, buffers)."""
    bufs = [Buf(bytes(nbytes)) for _ in keys]
    task = adapter.submit_load_task(keys, bufs)
    bitmap = wait_for(lambda: adapter.query_load_result(task), "fs L2 load")
    return [bitmap.test(i) for i in range(len(keys))], bufs


class HeldLoads:
    """Every fs load reads its file only after ``release()``; ``started`` is set by the
    first."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from lmcache.v1.distributed.l2_adapters import fs_l2_adapter

        self.started = threading.Event()
        self._released = threading.Event()
        readinto = fs_l2_adapter._async_readinto_full

        async def held(f: Any, buf: Any) -> int:
            self.started.set()
            while not self._released.is_set():
                await asyncio.sleep(0.01)
            return await readinto(f, buf)

        monkeypatch.setattr(fs_l2_adapter, "_async_readinto_full", held)

    def release(self) -> None:
        self._released.set()
