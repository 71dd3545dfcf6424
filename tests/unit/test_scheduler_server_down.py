"""The scheduler side of LMCacheMPConnector when the LMCache server dies or is slow.

LMCache's real scheduler adapter talks to LMCache's real message-queue server, which serves
four request types from small handlers. "The server dies" is that server closing its socket:
requests get no reply, as after a SIGKILL.

Pristine 0.5.3 never starts the scheduler's heartbeat (it tests an empty dict against None).
A lookup in flight when the server dies therefore blocks the scheduler, and with it every
request of the engine, for the whole mq_timeout (300 s by default), and the adapter never sees
the server come back.

While a restore's prefetch runs, vLLM asks once per scheduler step whether it
has finished, and pristine blocks that step until the server replies (2.4 ms a call on the
H200 during a 128k restore, 4100 calls). A slow reply must not hold the step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq
from mq_server import free_url, serve

from lmcache.v1.multiprocess.protocol import RequestType
from lmcache.v1.multiprocess.protocols.engine import KeyType

CHUNK = 16
HEARTBEAT_S = 0.5
MQ_TIMEOUT_S = 12.0  # what pristine waits; the patched build must give up after a few heartbeats
GIVE_UP_WITHIN_S = 4.0


class LMCacheServerStub:
    """LMCache's MessageQueueServer answering the requests a scheduler adapter sends."""

    def __init__(
        self,
        url: str,
        ctx: zmq.Context,
        hit_chunks: int,
        status_delay_s: float = 0.0,
        running_replies: int = 0,
    ) -> None:
        self.status_queries = 0

        def get_chunk_size() -> int:
            return CHUNK

        def ping(instance_id: int | None) -> bool:
            return True

        def lookup(key: KeyType, tp_size: int) -> None:
            return None

        def query_prefetch_status(request_id: str) -> int | None:
            self.status_queries += 1
            time.sleep(status_delay_s)
            return None if self.status_queries <= running_replies else hit_chunks

        def get_experimental() -> list[str]:
            return []

        handlers = {
            RequestType.GET_CHUNK_SIZE: get_chunk_size,
            RequestType.GET_EXPERIMENTAL: get_experimental,
            RequestType.PING: ping,
            RequestType.LOOKUP: lookup,
            RequestType.QUERY_PREFETCH_STATUS: query_prefetch_status,
        }
        sync = (RequestType.GET_CHUNK_SIZE, RequestType.GET_EXPERIMENTAL)
        blocking = [rt for rt in handlers if rt not in sync]
        self.server = serve(url, ctx, handlers, blocking)

    def die(self) -> None:
        self.server.close()


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    # Requests to a dead server stay queued in the client's socket; with the default
    # infinite linger, terminating the context would wait for them forever.
    context.linger = 0
    yield context
    context.destroy(linger=0)


def make_adapter(url: str, ctx: zmq.Context, mq_timeout: float):
    from lmcache.integration.vllm.vllm_multi_process_adapter import (
        LMCacheMPSchedulerAdapter,
        ParallelStrategy,
    )

    strategy = ParallelStrategy(
        mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1, n_servers=1
    )
    return LMCacheMPSchedulerAdapter(
        [url],
        ctx,
        "stub-model",
        CHUNK,
        strategy,
        mq_timeout=mq_timeout,
        heartbeat_interval=HEARTBEAT_S,
    )


TOKENS = list(range(100, 100 + 4 * CHUNK))


def poll_lookup(adapter, request_id: str, limit_s: float = 30.0) -> int | None:
    """What vLLM's scheduler does: ask once per step until the answer is not None."""
    deadline = time.monotonic() + limit_s
    while (hit := adapter.check_lookup_result(request_id)) is None:
        if time.monotonic() > deadline:
            return None
        time.sleep(0.001)
    return hit


def test_lookup_round_trip_with_a_live_server(ctx) -> None:
    url = free_url()
    server = LMCacheServerStub(url, ctx, hit_chunks=3)
    adapter = make_adapter(url, ctx, MQ_TIMEOUT_S)
    try:
        adapter.maybe_submit_lookup_request("req-1", TOKENS)
        assert poll_lookup(adapter, "req-1") == 3 * CHUNK
    finally:
        adapter.shutdown()
        server.die()


@pytest.mark.fix
def test_lookup_in_flight_when_the_server_dies_gives_up_within_a_few_heartbeats(ctx) -> None:
    url = free_url()
    server = LMCacheServerStub(url, ctx, hit_chunks=3)
    adapter = make_adapter(url, ctx, MQ_TIMEOUT_S)
    try:
        adapter.maybe_submit_lookup_request("req-1", TOKENS)
        server.die()
        t0 = time.monotonic()
        hit = poll_lookup(adapter, "req-1")
        waited = time.monotonic() - t0
        assert hit == 0, "a dead server must read as a miss"
        assert waited < GIVE_UP_WITHIN_S, (
            f"the scheduler blocked {waited:.1f}s on a dead server (mq_timeout {MQ_TIMEOUT_S}s)"
        )
    finally:
        adapter.shutdown()


@pytest.mark.fix
def test_lookups_resume_when_the_server_comes_back(ctx) -> None:
    url = free_url()
    server = LMCacheServerStub(url, ctx, hit_chunks=2)
    adapter = make_adapter(url, ctx, mq_timeout=2.0)
    try:
        adapter.maybe_submit_lookup_request("req-1", TOKENS)
        server.die()
        assert poll_lookup(adapter, "req-1") == 0
        assert not adapter.is_healthy
        server = LMCacheServerStub(url, ctx, hit_chunks=2)
        deadline = time.monotonic() + 10 * HEARTBEAT_S
        while not adapter.is_healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert adapter.is_healthy, "the adapter never saw the restarted server"
        adapter.maybe_submit_lookup_request("req-2", TOKENS)
        assert poll_lookup(adapter, "req-2") == 2 * CHUNK
    finally:
        adapter.shutdown()
        server.die()


@pytest.mark.feature
def test_a_slow_prefetch_status_reply_does_not_hold_the_scheduler_step(ctx) -> None:
    url = free_url()
    # the prefetch is still running at the first reply; each reply takes 0.3 s
    server = LMCacheServerStub(url, ctx, hit_chunks=3, status_delay_s=0.3, running_replies=1)
    adapter = make_adapter(url, ctx, MQ_TIMEOUT_S)
    try:
        adapter.maybe_submit_lookup_request("req-1", TOKENS)
        calls: list[float] = []
        deadline = time.monotonic() + 10.0
        hit = None
        while hit is None and time.monotonic() < deadline:
            t0 = time.monotonic()
            hit = adapter.check_lookup_result("req-1")
            calls.append(time.monotonic() - t0)
            time.sleep(0.005)  # the rest of a scheduler step
        assert hit == 3 * CHUNK
        assert max(calls) < 0.1, (
            f"a scheduler step waited {max(calls):.2f}s for a prefetch-status reply"
        )
        assert server.status_queries == 2  # one query in flight at a time, not one per call
    finally:
        adapter.shutdown()
        server.die()
