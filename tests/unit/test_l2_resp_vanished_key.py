"""A resp L2 key gone between lookup and load is a miss for that load, and the adapter
serves on; so does a Redis that stops answering for a while, or restarts; a Redis it cannot
reach refuses its start (both bases).

LMCache's C++ Redis client (0.5.3's, and 0.5.6's LMCacheRedisClient) reads a GET reply as
the size header it expects: for a key that is gone (evicted, expired, flushed: ``$-1``) it
waits forever for the bytes that never come, and once as many keys as it has connection
workers are gone, every later L2 request of the server waits too. It also has no timeout
and connects each worker once. The patched adapters drive the series' Python RESP2 client
(resp_client).

LMCache's real resp adapter on a real redis-server (fixture ``redis``), one task at a
time. Every wait is bounded: a load that does not complete is a test failure.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("lmcache.v1.distributed.l2_adapters.resp_l2_adapter")

from fs_l2_driver import Buf  # noqa: E402

from hybridfa_gate.l2 import RedisServer  # noqa: E402

pytestmark = pytest.mark.bases("0.5.3", "0.5.6")

SIZE = 64 << 10
WORKERS = 2
TIMEOUT_S = 1.0  # the adapter's: how long a request waits for Redis to answer


def open_adapter(port: int) -> Any:
    """The resp adapter on 127.0.0.1:port (pristine's config ignores timeout_s)."""
    from lmcache.v1.distributed.l2_adapters.resp_l2_adapter import (
        RESPL2AdapterConfig,
        _create_resp_l2_adapter,
    )

    config = {"host": "127.0.0.1", "port": port, "num_workers": WORKERS}
    return _create_resp_l2_adapter(
        RESPL2AdapterConfig.from_dict({**config, "timeout_s": TIMEOUT_S})
    )


@pytest.fixture
def adapter(redis: RedisServer) -> Iterator[Any]:
    adp = open_adapter(redis.port)
    try:
        yield adp
    finally:
        adp.close()


def keys(n: int, first: int = 0) -> list[Any]:
    from lmcache.v1.distributed.api import ObjectKey

    return [
        ObjectKey(chunk_hash=i.to_bytes(4, "big") * 8, model_name="m", kv_rank=0)
        for i in range(first, first + n)
    ]


def payload(key: Any) -> bytes:
    return random.Random(key.chunk_hash).randbytes(SIZE)


def redis_key(key: Any) -> str:
    from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
        _object_key_to_string,
    )

    return _object_key_to_string(key)


def completed(poll: Any, what: str, timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = poll()
        if result is not None:
            return result
        time.sleep(0.01)
    pytest.fail(f"{what} did not complete within {timeout}s")


def store(adapter: Any, stored: list[Any]) -> bool:
    bufs = [Buf(payload(k)) for k in stored]  # alive until the task completes
    task = adapter.submit_store_task(stored, [b.obj for b in bufs])
    result = completed(lambda: adapter.pop_completed_store_tasks().get(task), "a store")
    return bool(result.is_successful())


def lookup(adapter: Any, looked_up: list[Any]) -> list[bool]:
    task = adapter.submit_lookup_and_lock_task(looked_up, {})
    bitmap = completed(lambda: adapter.query_lookup_and_lock_result(task), "a lookup")
    return [bitmap.test(i) for i in range(len(looked_up))]


def load(adapter: Any, loaded: list[Any], timeout: float = 5.0) -> tuple[list[bool], list[Buf]]:
    bufs = [Buf(bytes(SIZE)) for _ in loaded]
    task = adapter.submit_load_task(loaded, [b.obj for b in bufs])
    bitmap = completed(lambda: adapter.query_load_result(task), "a load", timeout)
    return [bitmap.test(i) for i in range(len(loaded))], bufs


def loaded_exactly(adapter: Any, loaded: list[Any]) -> bool:
    hits, bufs = load(adapter, loaded)
    return hits == [True] * len(loaded) and [b.data for b in bufs] == [payload(k) for k in loaded]


@pytest.mark.fix
def test_a_key_deleted_after_its_lookup_is_a_miss_for_its_load(adapter, redis):
    stored = keys(3)
    assert store(adapter, stored)
    assert lookup(adapter, stored) == [True] * 3
    with redis.client() as client:
        client.command("DEL", redis_key(stored[1]))
    hits, bufs = load(adapter, stored)
    assert hits == [True, False, True]
    assert [bufs[0].data, bufs[2].data] == [payload(stored[0]), payload(stored[2])]


@pytest.mark.fix
def test_after_more_vanished_keys_than_workers_later_loads_are_served(adapter, redis):
    stored = keys(2 * WORKERS + 2)
    assert store(adapter, stored)
    gone, kept = stored[: 2 * WORKERS], stored[2 * WORKERS :]
    with redis.client() as client:
        client.command("FLUSHALL")
    for key in gone:  # each its own load: one per connection worker, and more
        assert load(adapter, [key])[0] == [False]
    assert store(adapter, kept)
    assert loaded_exactly(adapter, kept), "the adapter stopped serving after vanished keys"


@pytest.mark.fix
@pytest.mark.redis_maxmemory("2mb")
def test_keys_redis_evicts_between_lookup_and_load_are_misses(adapter, redis):
    first = keys(16)
    store(adapter, first)
    found = [k for k, hit in zip(first, lookup(adapter, first), strict=True) if hit]
    assert found, "redis kept none of the first objects: raise maxmemory"
    for batch in range(4):  # 4 MiB more through a 2 MiB Redis: it evicts
        store(adapter, keys(16, first=100 + 16 * batch))
    with redis.client() as client:
        still = [bool(client.command("EXISTS", redis_key(k))) for k in found]
    assert not all(still), "redis evicted none of the looked-up objects: raise the load"
    hits, bufs = load(adapter, found)
    assert hits == still
    assert all(b.data == payload(k) for k, b, hit in zip(found, bufs, hits, strict=True) if hit)


@pytest.mark.fix
def test_a_load_from_a_redis_that_stopped_answering_is_a_miss_within_the_timeout(adapter, redis):
    stored = keys(2)
    assert store(adapter, stored)
    with redis.client() as client:
        client.command("CLIENT", "PAUSE", 4000, "ALL")
    started = time.monotonic()
    hits, _ = load(adapter, stored, timeout=8.0)
    waited = time.monotonic() - started
    assert hits == [False, False] and waited < 3 * TIMEOUT_S, (
        f"a load from a paused Redis returned {hits} after {waited:.1f}s"
    )
    time.sleep(max(0.0, 4.2 - waited))  # the pause is over
    assert loaded_exactly(adapter, stored), "the adapter did not serve again after the pause"


@pytest.mark.fix
def test_after_a_redis_restart_a_running_adapter_stores_and_loads_again(adapter, redis):
    stored = keys(3)
    assert store(adapter, stored[:1])
    redis.stop()
    redis.start()  # empty: no persistence
    assert store(adapter, stored), "a store after the Redis restart failed"
    assert redis.inventory()["objects"] == len(stored)
    assert loaded_exactly(adapter, stored)


@pytest.mark.fix
def test_connections_redis_closed_while_idle_are_replaced(adapter, redis):
    stored = keys(2 * WORKERS)
    assert store(adapter, stored)  # every worker has its connection
    with redis.client() as client:
        client.command("CONFIG", "SET", "timeout", 1)  # close clients idle for 1 s
        time.sleep(2.5)
    assert loaded_exactly(adapter, stored), "a load on connections redis closed failed"


@pytest.mark.fix
def test_an_adapter_whose_redis_does_not_answer_refuses_to_start() -> None:
    from hybridfa_gate.l2 import free_port

    port = free_port()  # nothing listens there
    try:
        adp = open_adapter(port)
    except RuntimeError as error:
        assert f"127.0.0.1:{port}" in str(error), str(error)
    else:
        adp.close()
        pytest.fail(f"the adapter started on 127.0.0.1:{port}, where no Redis answers")
