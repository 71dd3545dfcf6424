"""A native storage connector in Python, in place of the pybind-wrapped C++ connectors
(LMCache's ConnectorBase: Redis, fs, Mooncake, ...) that NativeConnectorL2Adapter drives.

It keeps the contract the adapter relies on and the C++ side's rules:

- ``submit_batch_set`` / ``submit_batch_get`` take keys and byte memoryviews, refuse an
  empty batch or a length mismatch by raising (as the pybind layer does), and return a
  future id at once; a worker thread runs the batch later.
- A batch carries ONE object size: the pybind layer passes the first buffer's length as
  the batch's chunk size and every single SET/GET refuses a buffer of another length
  ("buffer size mismatch"). A SET batch stops at its first failing object and completes
  not ok (the objects before it stay stored); a GET fails only that object (its result is
  False) and the batch still completes ok with per-key results.
- Completions are signalled on an eventfd and returned by ``drain_completions`` as
  ``(future_id, ok, error, result_bools)``; ``result_bools`` is None for a SET.

One worker, so a batch is one tile. ``fail_sizes``: object sizes the backend refuses (a
SET or GET of such an object raises, handled as any per-object error above).
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from dataclasses import dataclass, field

Completion = tuple[int, bool, str, list[bool] | None]


@dataclass
class Batch:
    """One native batch as submitted: its op ("set", "get", "exists"), keys and sizes."""

    op: str
    keys: list[str]
    sizes: list[int] = field(default_factory=list)


class FakeNativeConnector:
    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}  # the backend: key string -> payload
        self.batches: list[Batch] = []  # every batch submitted, in order
        self.fail_sizes: set[int] = set()
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._next_future_id = 1
        self._lock = threading.Lock()
        self._completions: list[Completion] = []
        self._requests: queue.Queue[tuple[int, Batch, list[memoryview]] | None] = queue.Queue()
        self._worker = threading.Thread(target=self._work, daemon=True, name="fake-native")
        self._worker.start()

    # The pybind surface the adapter calls.

    def event_fd(self) -> int:
        return self._efd

    def submit_batch_set(self, keys: list[str], memoryviews: list[memoryview]) -> int:
        return self._submit("set", keys, memoryviews)

    def submit_batch_get(self, keys: list[str], memoryviews: list[memoryview]) -> int:
        return self._submit("get", keys, memoryviews)

    def submit_batch_exists(self, keys: list[str]) -> int:
        if not keys:
            raise RuntimeError("keys list is empty")
        return self._enqueue(Batch("exists", list(keys)), [])

    def drain_completions(self) -> list[Completion]:
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass
        with self._lock:
            drained, self._completions = self._completions, []
        return drained

    def close(self) -> None:
        if self._worker.is_alive():
            self._requests.put(None)
            self._worker.join(timeout=5)
            os.close(self._efd)

    # The C++ side.

    def _submit(self, op: str, keys: list[str], memoryviews: list[memoryview]) -> int:
        if len(keys) != len(memoryviews):
            raise RuntimeError("keys and memviews size mismatch")
        if not keys:
            raise RuntimeError("keys list is empty")
        sizes = [mv.nbytes for mv in memoryviews]
        return self._enqueue(Batch(op, list(keys), sizes), list(memoryviews))

    def _enqueue(self, batch: Batch, bufs: list[memoryview]) -> int:
        with self._lock:
            future_id = self._next_future_id
            self._next_future_id += 1
            self.batches.append(batch)
        self._requests.put((future_id, batch, bufs))
        return future_id

    def _check(self, size: int, chunk_size: int) -> None:
        if size != chunk_size:
            raise RuntimeError("buffer size mismatch")
        if size in self.fail_sizes:
            raise RuntimeError(f"the backend refused an object of {size} bytes")

    def _run(self, batch: Batch, bufs: list[memoryview]) -> tuple[bool, str, list[bool] | None]:
        """The batch's (ok, error, per-key results), as ConnectorBase completes it."""
        if batch.op == "exists":
            return True, "", [key in self.objects for key in batch.keys]
        chunk_size = batch.sizes[0]  # the batch's one object size, as pybind passes it
        if batch.op == "set":
            for key, buf in zip(batch.keys, bufs, strict=True):
                try:
                    self._check(buf.nbytes, chunk_size)
                except RuntimeError as e:  # a SET tile stops at its first error
                    return False, str(e), None
                self.objects[key] = bytes(buf)
            return True, "", None
        results: list[bool] = []
        for key, buf in zip(batch.keys, bufs, strict=True):
            try:
                self._check(buf.nbytes, chunk_size)
                data = self.objects.get(key)
                if data is None:
                    raise RuntimeError("GET: key not found")
                if len(data) != buf.nbytes:
                    raise RuntimeError("GET: size header mismatch")
            except RuntimeError:  # a GET fails that object only
                results.append(False)
                continue
            target = (ctypes.c_ubyte * buf.nbytes).from_buffer(buf)
            ctypes.memmove(target, data, len(data))
            results.append(True)
        return True, "", results

    def _work(self) -> None:
        while (request := self._requests.get()) is not None:
            future_id, batch, bufs = request
            ok, error, results = self._run(batch, bufs)
            with self._lock:
                self._completions.append((future_id, ok, error, results))
            os.eventfd_write(self._efd, 1)
