"""A block is written again only after the stores that read it, whatever the heartbeat says
(the heartbeat's health flag no longer decides it).

The worker's heartbeat calls the LMCache server dead when a PING goes unanswered for one
interval. A server whose CPU pool is busy is called dead that way (PING runs on that pool),
yet it still copies the stores it was sent, later. Revision 14 skipped its
store-before-reuse ordering for a server called dead, and on that flag get_finished also
forgot the stores in flight: a block freed (mid-request in align mode, or at the request's
end) went to another request, whose forward wrote it before the server's copy, and the chunk
was stored with the other request's bytes under the first request's keys.

A store is now given up only when the connection to its server has closed without a reply
(the server's process is gone, and a closing server cancels what it had not started), and
the engine stops when a connected server does not answer within mq_timeout.

Real vLLM ``KVCacheManager`` + real scheduler- and worker-side ``LMCacheMPConnector`` +
LMCache's real worker adapter with its real heartbeat, against LMCache's real message-queue
server whose PING handler is stuck behind a busy pool. The server's GPU copy is a fake that
the "busy server" runs on its own schedule, after the engine's next step began.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import zmq
from mq_server import free_url, serve
from vllm_sched_fakes import (
    BLOCK,
    SchedDriver,
    StepResult,
    make_connector,
    make_kv_cache_config,
    make_worker_connector,
)

from lmcache.v1.multiprocess.futures import MessagingFuture
from lmcache.v1.multiprocess.protocol import RequestType

NUM_BLOCKS = 10  # small enough that vLLM hands a just-freed block to the next request
MARKER = {"a": 1.0, "b": 2.0}
HEARTBEAT_S = 0.2
COPY_LATE_S = 1.0  # the busy server copies this long after the engine's next step began
WAIT_S = 10.0  # bound on every wait of these tests


class BusyPoolServer:
    """LMCache's MessageQueueServer whose PING waits behind a busy pool until ``free``."""

    def __init__(self, url: str, ctx: zmq.Context) -> None:
        self.free = threading.Event()

        def get_chunk_size() -> int:
            return BLOCK

        def get_experimental() -> list[str]:
            return []

        def ping(instance_id: int | None) -> bool:
            self.free.wait(WAIT_S)
            return True

        def unregister(instance_id: int) -> None:
            return None

        handlers = {
            RequestType.GET_CHUNK_SIZE: get_chunk_size,
            RequestType.GET_EXPERIMENTAL: get_experimental,
            RequestType.PING: ping,
            RequestType.UNREGISTER_KV_CACHE: unregister,
        }
        self.server = serve(url, ctx, handlers, [RequestType.PING])

    def close(self) -> None:
        self.free.set()
        if not self.server.is_finished.is_set():
            self.server.close()


class LateCopy(MessagingFuture[bool]):
    """A store's future: the server copies the blocks and replies when ``run`` runs."""

    def __init__(self, copy: Callable[[], None]) -> None:
        super().__init__()
        self._copy = copy

    def run(self) -> None:
        if not self.query():
            self._copy()
            self.set_result(True)


class ServerCopies:
    """Transfer context: each store is copied out of ``gpu`` by the server, late."""

    def __init__(self, gpu: torch.Tensor) -> None:
        self.gpu = gpu
        self.futures: list[LateCopy] = []
        self.stored: dict[tuple[str, int], torch.Tensor] = {}

    def submit_store(
        self, request_id: str, key: Any, _instance: int, _kv: Any, block_ids: Any, *_: Any
    ) -> LateCopy:
        ids = [i for group in block_ids for i in group]

        def copy() -> None:
            self.stored[(request_id, key.start)] = self.gpu[ids].clone()

        future = LateCopy(copy)
        self.futures.append(future)
        return future

    def copy_later(self) -> threading.Thread:
        """The busy server gets to its stores COPY_LATE_S from now."""

        def run() -> None:
            time.sleep(COPY_LATE_S)
            for future in self.futures:
                future.run()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


class Engine:
    """vLLM's scheduler and one worker: each step's GPU work, then its stores."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, adapter: Any) -> None:
        config = make_kv_cache_config(0, num_blocks=NUM_BLOCKS)
        self.driver = SchedDriver(config, make_connector(config, BLOCK, monkeypatch))
        self.worker = make_worker_connector(config, adapter, monkeypatch)
        self.adapter = adapter
        self.server = ServerCopies(torch.zeros(NUM_BLOCKS, 4))
        adapter.transfer_ctx = self.server

    def step(self, num_tokens: dict[str, int]) -> StepResult:
        # vLLM 0.26 GPUModelRunner.execute_model: handle_preemptions first, then the
        # step's GPU work (preprocess_mamba, forward), then wait_for_save's stores.
        result = self.driver.step(num_tokens)
        self.worker.handle_preemptions(result.metadata)
        for req_id, n in num_tokens.items():
            req = self.driver.requests[req_id]
            first = (req.num_computed_tokens - n) // BLOCK
            for group_ids in self.driver.vllm_table(req_id):
                for block_id in group_ids[first : first + n // BLOCK]:
                    self.server.gpu[block_id] = MARKER[req_id]
        stores = [m for m in result.metadata.requests if m.direction == "STORE"]
        self.adapter.batched_submit_store_requests(
            [m.request_id for m in stores], [m.op for m in stores], object()
        )
        return result

    def wait_called_dead(self) -> None:
        deadline = time.monotonic() + WAIT_S
        while self.adapter.is_healthy:
            assert time.monotonic() < deadline, "the heartbeat never called the server dead"
            time.sleep(0.02)

    def stored_as_marked(self, request: str) -> bool:
        stored = self.server.stored.get((request, 0))
        if stored is None:  # the test never reached what it checks: no verdict either way
            raise RuntimeError(
                f"the server never copied {request}'s chunk 0: no store of it reached the"
                f" server, or the server's copies did not end within {WAIT_S}s"
            )
        return torch.equal(stored, torch.full_like(stored, MARKER[request]))


def worker_adapter(url: str, ctx: zmq.Context, mq_timeout: float) -> Any:
    from lmcache.integration.vllm.vllm_multi_process_adapter import (
        LMCacheMPWorkerAdapter,
        ParallelStrategy,
    )

    strategy = ParallelStrategy(
        mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1, n_servers=1
    )
    return LMCacheMPWorkerAdapter(
        url,
        ctx,
        "stub-model",
        BLOCK,
        strategy,
        mq_timeout=mq_timeout,
        heartbeat_interval=HEARTBEAT_S,
    )


@pytest.fixture
def busy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Engine]:
    """An engine whose server's pool is busy: the heartbeat calls the server dead."""
    url = free_url()
    ctx = zmq.Context()
    ctx.linger = 0
    server = BusyPoolServer(url, ctx)
    adapter = worker_adapter(url, ctx, mq_timeout=WAIT_S)
    try:
        yield Engine(monkeypatch, adapter)
    finally:
        server.free.set()
        adapter.transfer_ctx = None
        adapter.shutdown()
        server.close()
        ctx.destroy(linger=0)


@pytest.mark.fix
def test_a_block_reused_mid_request_is_written_after_the_store_of_a_server_called_dead(
    busy: Engine,
) -> None:
    driver = busy.driver
    driver.add_request("a", list(range(100, 100 + 3 * BLOCK)))
    (store,) = busy.step({"a": BLOCK}).stores  # a's chunk 0: one Mamba + one FA block
    a_blocks = {i for group in store.block_ids for i in group}
    busy.wait_called_dead()
    copier = busy.server.copy_later()
    driver.add_request("b", list(range(500, 500 + 3 * BLOCK)))
    busy.step({"a": BLOCK, "b": BLOCK})
    # vLLM frees a's chunk-0 Mamba block (align mode) and hands it to b, whose forward
    # writes it; the server, busy, has not copied a's chunk yet.
    busy.step({"a": BLOCK, "b": BLOCK})
    assert a_blocks & {i for group in driver.vllm_table("b") for i in group}, "no reuse"
    copier.join(WAIT_S)
    assert busy.stored_as_marked("a"), "a's chunk 0 was stored with b's bytes"


@pytest.mark.fix
def test_a_finished_request_s_blocks_are_written_after_its_store_to_a_server_called_dead(
    busy: Engine,
) -> None:
    driver = busy.driver
    driver.add_request("a", list(range(100, 100 + 2 * BLOCK)))
    (store,) = busy.step({"a": BLOCK}).stores
    a_blocks = {i for group in store.block_ids for i in group}
    busy.wait_called_dead()
    # a ends; vLLM frees its blocks once the connector reports it finished_sending,
    # which the adapter does at once for a server called dead.
    delay_free = driver.connector.request_finished(driver.requests["a"], [])
    sending, _ = busy.adapter.get_finished({"a"})
    assert not delay_free or "a" in (sending or set())
    driver.manager.free(driver.requests["a"])
    driver.running.discard("a")
    driver.add_request("b", list(range(500, 500 + 8 * BLOCK)))
    copier = busy.server.copy_later()
    busy.step({"b": 8 * BLOCK})  # takes the whole pool, a's blocks last
    assert a_blocks & {i for group in driver.vllm_table("b") for i in group}, "no reuse"
    copier.join(WAIT_S)
    assert busy.stored_as_marked("a"), "a's chunk 0 was stored with b's bytes"


def _submit_store(adapter: Any, futures: list[MessagingFuture[bool]]) -> None:
    from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

    class NeverCopied:
        def submit_store(self, *_: Any) -> MessagingFuture[bool]:
            futures.append(MessagingFuture())
            return futures[-1]

    adapter.transfer_ctx = NeverCopied()
    op = LoadStoreOp(token_ids=list(range(BLOCK)), block_ids=[[5]], start=0, end=BLOCK)
    adapter.submit_store_request("a", op, object())


@pytest.mark.feature
def test_the_engine_stops_when_a_connected_server_never_answers_a_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = free_url()
    ctx = zmq.Context()
    ctx.linger = 0
    server = BusyPoolServer(url, ctx)
    adapter = worker_adapter(url, ctx, mq_timeout=1.0)
    futures: list[MessagingFuture[bool]] = []
    try:
        _submit_store(adapter, futures)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="did not answer the store of request a"):
            adapter.wait_for_stores_reading({5})
        assert time.monotonic() - started < WAIT_S
    finally:
        server.free.set()
        adapter.transfer_ctx = None
        adapter.shutdown()
        server.close()
        ctx.destroy(linger=0)


@pytest.mark.feature
def test_a_store_whose_server_closed_its_connection_unanswered_delays_nothing() -> None:
    url = free_url()
    ctx = zmq.Context()
    ctx.linger = 0
    server = BusyPoolServer(url, ctx)
    adapter = worker_adapter(url, ctx, mq_timeout=WAIT_S * 3)
    futures: list[MessagingFuture[bool]] = []
    try:
        _submit_store(adapter, futures)
        server.close()  # the server's process is gone: its socket closes, no reply
        started = time.monotonic()
        adapter.wait_for_stores_reading({5})
        assert time.monotonic() - started < WAIT_S
        assert not futures[0].query()
        started = time.monotonic()
        adapter.wait_for_stores_reading({5})  # given up for good: no second wait
        assert time.monotonic() - started < 0.5
    finally:
        server.close()
        adapter.transfer_ctx = None
        adapter._mq_timeout = 0.5  # noqa: SLF001 - no server answers the unregister
        adapter.shutdown()
        ctx.destroy(linger=0)


@pytest.mark.fix
def test_a_closing_server_runs_no_request_it_had_not_started() -> None:
    from lmcache.v1.multiprocess.mq import MessageQueueClient, MessageQueueServer
    from lmcache.v1.multiprocess.protocol import get_handler_type, get_payload_classes

    url = free_url()
    ctx = zmq.Context()
    ctx.linger = 0
    started, release = threading.Event(), threading.Event()
    ran: list[int | None] = []

    def ping(instance_id: int | None) -> bool:
        ran.append(instance_id)
        started.set()
        release.wait(WAIT_S)
        return True

    server = MessageQueueServer(url, ctx)
    rt = RequestType.PING
    server.add_handler(rt, get_payload_classes(rt), get_handler_type(rt), ping)
    server.add_normal_thread_pool([rt], max_workers=1)
    server.start()
    client = MessageQueueClient(url, ctx)
    try:
        client.submit_request(rt, [1], bool)
        assert started.wait(WAIT_S)
        client.submit_request(rt, [2], bool)  # queued behind the first
        deadline = time.monotonic() + WAIT_S
        while not any(f._work_queue.qsize() for f in server.extra_pools):  # noqa: SLF001
            assert time.monotonic() < deadline, "the second request never reached the pool"
            time.sleep(0.01)
        server.close()
        release.set()
        time.sleep(0.5)  # a queued handler would run now
        assert ran == [1], "the closed server ran a request it had not started"
    finally:
        release.set()
        client.close()
        ctx.destroy(linger=0)
