"""LMCache's real NativeConnectorL2Adapter over a native connector written in Python
(native_connector_fake) that keeps the C++ connectors' rule of one object size per native
batch: a store or load task whose objects differ in size, as a hybrid layout's FA and
recurrent-state object groups do, must go out as one native batch per size, and the
task's result must merge theirs (ok only when every batch is; the load bitmap at the
task's positions)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter")

from fs_l2_driver import Buf, wait_for  # noqa: E402
from native_connector_fake import FakeNativeConnector  # noqa: E402

pytestmark = pytest.mark.bases("0.5.3", "0.5.6")

SIZES = [4096, 1024, 4096, 1024, 4096, 1024]  # object groups 0 and 1 of three chunks


@pytest.fixture
def connector() -> FakeNativeConnector:
    return FakeNativeConnector()  # the adapter closes it


@pytest.fixture
def adapter(connector: FakeNativeConnector) -> Iterator[Any]:
    from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
        NativeConnectorL2Adapter,
    )

    adp = NativeConnectorL2Adapter(connector, type_name="fake")
    try:
        yield adp
    finally:
        adp.close()


def keys(n: int = len(SIZES)) -> list[Any]:
    from lmcache.v1.distributed.api import ObjectKey

    return [
        ObjectKey(chunk_hash=bytes([i // 2 + 1]) * 32, model_name="m", kv_rank=0,
                  object_group_id=i % 2)
        for i in range(n)
    ]  # fmt: skip


def wire(key: Any) -> str:
    """The key string the adapter hands the native connector."""
    from lmcache.v1.distributed.l2_adapters import native_connector_l2_adapter as mod

    return mod._object_key_to_string(key)


def payloads(sizes: list[int]) -> list[bytes]:
    return [random.Random(i).randbytes(n) for i, n in enumerate(sizes)]


def store(adapter: Any, stored: list[Any], data: list[bytes]) -> Any:
    """Run one store task; its L2StoreResult."""
    objects = [Buf(p).obj for p in data]  # the connector reads them after submit returns
    task = adapter.submit_store_task(stored, objects)
    return wait_for(lambda: adapter.pop_completed_store_tasks().get(task), "a store task")


def load(adapter: Any, loaded: list[Any], sizes: list[int]) -> tuple[list[bool], list[bytes]]:
    """Run one load task into zeroed buffers of ``sizes``; (bitmap, loaded bytes)."""
    bufs = [Buf(bytes(n)) for n in sizes]
    task = adapter.submit_load_task(loaded, [b.obj for b in bufs])
    bitmap = wait_for(lambda: adapter.query_load_result(task), "a load task")
    return [bitmap.test(i) for i in range(len(loaded))], [b.data for b in bufs]


def hold(connector: FakeNativeConnector, held: list[Any], data: list[bytes]) -> None:
    """Put objects straight into the connector's backend."""
    connector.objects.update({wire(k): p for k, p in zip(held, data, strict=True)})


@pytest.mark.fix
def test_a_store_task_of_two_sizes_stores_every_object(adapter, connector):
    data = payloads(SIZES)
    result = store(adapter, keys(), data)
    assert result.is_successful(), "a store task of two object sizes failed"
    assert sorted(connector.objects) == sorted(wire(k) for k in keys())
    assert connector.objects == {wire(k): p for k, p in zip(keys(), data, strict=True)}


@pytest.mark.fix
def test_a_store_task_of_two_sizes_is_one_native_batch_per_size(adapter, connector):
    store(adapter, keys(), payloads(SIZES))
    batches = [(b.keys, b.sizes) for b in connector.batches if b.op == "set"]
    expected = [
        ([wire(k) for k in keys()][at::2], [SIZES[at]] * 3) for at in (0, 1)
    ]  # one batch per size, sizes in first-seen order, keys in task order
    assert batches == expected


@pytest.mark.fix
def test_a_two_size_store_is_found_by_a_later_lookup(adapter):
    store(adapter, keys(), payloads(SIZES))
    task = adapter.submit_lookup_and_lock_task(keys(), {})
    bitmap = wait_for(lambda: adapter.query_lookup_and_lock_result(task), "a lookup task")
    assert [bitmap.test(i) for i in range(len(SIZES))] == [True] * len(SIZES)
    adapter.submit_unlock(keys())


@pytest.mark.fix
def test_a_load_task_of_two_sizes_loads_every_object(adapter, connector):
    data = payloads(SIZES)
    hold(connector, keys(), data)
    bitmap, loaded = load(adapter, keys(), SIZES)
    assert bitmap == [True] * len(SIZES)
    assert loaded == data


@pytest.mark.fix
def test_a_store_whose_one_size_fails_fails_and_stores_the_other_size(adapter, connector):
    connector.fail_sizes = {1024}
    data = payloads(SIZES)
    result = store(adapter, keys(), data)
    assert not result.is_successful(), "a store task with a failed native batch reported ok"
    expected = {wire(k): p for k, p, n in zip(keys(), data, SIZES, strict=True) if n == 4096}
    assert sorted(connector.objects) == sorted(expected)
    assert connector.objects == expected


@pytest.mark.fix
def test_a_load_whose_one_size_fails_misses_exactly_those_positions(adapter, connector):
    data = payloads(SIZES)
    hold(connector, keys(), data)
    connector.fail_sizes = {4096}  # the size of the task's first object
    bitmap, loaded = load(adapter, keys(), SIZES)
    assert bitmap == [n != 4096 for n in SIZES]
    assert [b for b, n in zip(loaded, SIZES, strict=True) if n == 1024] == [
        p for p, n in zip(data, SIZES, strict=True) if n == 1024
    ]


def test_a_task_of_one_size_is_one_native_batch(adapter, connector):
    data = payloads([2048] * 3)
    assert store(adapter, keys(3), data).is_successful()
    bitmap, loaded = load(adapter, keys(3), [2048] * 3)
    assert bitmap == [True] * 3
    assert loaded == data
    names = [wire(k) for k in keys(3)]
    assert [(b.op, b.keys, b.sizes) for b in connector.batches] == [
        ("set", names, [2048] * 3),
        ("get", names, [2048] * 3),
    ]
