"""LMCache's resp L2 adapter on a real redis-server, one task at a time: a task whose
objects have different sizes, as a hybrid layout's FA and recurrent-state object groups
do, stores and loads every object. On the patched builds the adapter drives the series'
own Python RESP client, which takes each object's size on its own; pristine drives
LMCache's C++ Redis client, which takes one size per native batch. The adapter's
batching by size against that rule is tested in test_native_batch.py."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("lmcache.v1.distributed.l2_adapters.resp_l2_adapter")

from fs_l2_driver import Buf, wait_for  # noqa: E402

from hybridfa_gate.l2 import RedisServer  # noqa: E402

pytestmark = pytest.mark.bases("0.5.3", "0.5.6")

SIZES = [4096, 1024, 4096, 1024, 4096, 1024]  # object groups 0 and 1 of three chunks


@pytest.fixture
def adapter(redis: RedisServer) -> Iterator[Any]:
    from lmcache.v1.distributed.l2_adapters.resp_l2_adapter import (
        RESPL2AdapterConfig,
        _create_resp_l2_adapter,
    )

    adp = _create_resp_l2_adapter(RESPL2AdapterConfig("127.0.0.1", redis.port, num_workers=2))
    try:
        yield adp
    finally:
        adp.close()


def keys() -> list[Any]:
    from lmcache.v1.distributed.api import ObjectKey

    return [
        ObjectKey(chunk_hash=bytes([i // 2 + 1]) * 32, model_name="m", kv_rank=0,
                  object_group_id=i % 2)
        for i in range(len(SIZES))
    ]  # fmt: skip


def wait(poll: Any) -> Any:
    return wait_for(poll, "a resp adapter task")


@pytest.mark.fix
def test_a_task_of_two_object_sizes_stores_every_object(adapter, redis):
    payloads = [random.Random(i).randbytes(n) for i, n in enumerate(SIZES)]
    objects = [Buf(p).obj for p in payloads]  # the adapter holds only their addresses
    task = adapter.submit_store_task(keys(), objects)
    result = wait(lambda: adapter.pop_completed_store_tasks().get(task))
    assert result.is_successful(), "a store task of two object sizes failed"
    assert redis.inventory()["objects"] == len(SIZES)


@pytest.mark.fix
def test_a_task_of_two_object_sizes_loads_every_object(adapter, redis):
    payloads = [random.Random(i).randbytes(n) for i, n in enumerate(SIZES)]
    for size in set(SIZES):  # one task per size, which 0.5.3 stores too
        at = [i for i, n in enumerate(SIZES) if n == size]
        objects = [Buf(payloads[i]).obj for i in at]
        task = adapter.submit_store_task([keys()[i] for i in at], objects)
        assert wait(lambda t=task: adapter.pop_completed_store_tasks().get(t)).is_successful()
    assert redis.inventory()["objects"] == len(SIZES)
    bufs = [Buf(bytes(n)) for n in SIZES]
    task = adapter.submit_load_task(keys(), [b.obj for b in bufs])
    bitmap = wait(lambda: adapter.query_load_result(task))
    assert [bitmap.test(i) for i in range(len(SIZES))] == [True] * len(SIZES)
    assert [b.data for b in bufs] == payloads


def test_a_task_of_one_size_round_trips(adapter, redis):
    payloads = [random.Random(i).randbytes(2048) for i in range(3)]
    stored = keys()[:3]
    objects = [Buf(p).obj for p in payloads]  # the adapter holds only their addresses
    task = adapter.submit_store_task(stored, objects)
    assert wait(lambda: adapter.pop_completed_store_tasks().get(task)).is_successful()
    bufs = [Buf(bytes(2048)) for _ in payloads]
    task = adapter.submit_load_task(stored, [b.obj for b in bufs])
    bitmap = wait(lambda: adapter.query_load_result(task))
    assert [bitmap.test(i) for i in range(3)] == [True] * 3
    assert [b.data for b in bufs] == payloads
