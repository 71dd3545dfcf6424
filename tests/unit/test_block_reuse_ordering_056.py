"""No block is written again before the store that reads it has finished (0.5.6 base).

The LMCache server copies a store's blocks out of GPU memory on its own stream after
``wait_for_save`` returned. vLLM frees Mamba blocks mid-request (align mode), a preempted
request's blocks, and a finished request's blocks once the connector reports
``finished_sending``; a freed block handed to another request is written by the next step.
If that happens before the server's copy, the stored chunk holds the other request's bytes
under the first request's chunk hash. Pristine 0.5.6 flushes in-flight stores only on a
preemption and only while the heartbeat calls the server healthy, and tracks one store
future per request.

Real vLLM ``KVCacheManager`` + real scheduler- and worker-side ``LMCacheMPConnector`` +
LMCache's real worker adapter over a request client that answers its handshake; the
server's copy is a fake that runs when the engine waits for it, or when the test lets it
run: as if the server were slow unless waited on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

from handshake_client import HandshakeClient, connect_to, one_gpu  # noqa: E402
from vllm_sched_fakes import (  # noqa: E402
    BLOCK,
    SchedDriver,
    StepResult,
    make_connector,
    make_kv_cache_config,
    make_worker_connector,
)

from lmcache.v1.multiprocess.futures import MessagingFuture  # noqa: E402

pytestmark = pytest.mark.bases("0.5.6")

NUM_BLOCKS = 10  # small enough that vLLM hands a just-freed block to the next request
MARKER = {"a": 1.0, "b": 2.0}
B_BLOCKS = 7  # b's prompt: its blocks and its last state block outnumber the unused ones


class CopyWhenWaited(MessagingFuture[bool]):
    """A store's future whose GPU copy runs when someone waits for it (or ``run``)."""

    def __init__(self, copy: Callable[[], None]) -> None:
        super().__init__()
        self._copy = copy

    def run(self) -> None:
        if not self.query():
            self._copy()
            self.set_result(True)

    def wait(self, timeout: float | None = None) -> bool:
        self.run()
        return True


class ServerCopies:
    """Transfer context: a store copies its blocks out of ``gpu`` only when it runs."""

    def __init__(self, gpu: torch.Tensor) -> None:
        self.gpu = gpu
        self.futures: list[CopyWhenWaited] = []
        self.stored: dict[tuple[str, int], torch.Tensor] = {}

    def submit_store(
        self, request_id: str, key: Any, _kv: Any, block_ids: Any, *_: Any
    ) -> CopyWhenWaited:
        ids = [i for group in block_ids for i in group]

        def copy() -> None:
            self.stored[(request_id, key.start)] = self.gpu[ids].clone()

        future = CopyWhenWaited(copy)
        self.futures.append(future)
        return future

    def run_server(self) -> None:
        for future in self.futures:
            future.run()

    # LMCacheDrivenTransferContext.flush_inflight_stores: wait for every store.
    flush_inflight_stores = run_server


@pytest.fixture
def adapter(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """LMCache's real LMCacheMPWorkerAdapter; its heartbeat is the test's to drive."""
    import zmq

    from lmcache.integration.vllm import vllm_multi_process_adapter as vmpa

    connect_to(monkeypatch, HandshakeClient(BLOCK))
    ctx = zmq.Context()
    worker = vmpa.LMCacheMPWorkerAdapter(
        "tcp://127.0.0.1:1", ctx, "stub-model", BLOCK, one_gpu(), mq_timeout=5.0
    )
    monkeypatch.setattr(worker, "_ensure_heartbeat_started", lambda: None)
    yield worker
    worker.transfer_ctx = None
    ctx.destroy(linger=0)


def call_server_dead(adapter: Any) -> None:
    """What the heartbeat does when a PING is not answered in time (a busy server)."""
    adapter._health_event.clear()  # noqa: SLF001
    assert not adapter.is_healthy


class Engine:
    """vLLM's scheduler and one worker: each step's GPU work, then its stores."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, adapter: Any) -> None:
        config = make_kv_cache_config(0, num_blocks=NUM_BLOCKS)
        self.driver = SchedDriver(config, make_connector(config, BLOCK, monkeypatch))
        self.worker = make_worker_connector(config, adapter, monkeypatch)
        self.adapter = adapter
        self.server = ServerCopies(torch.zeros(NUM_BLOCKS, 4))
        adapter.transfer_ctx = self.server

    def step(self, num_tokens: dict[str, int], preempted: bool = False) -> StepResult:
        # GPUModelRunner.execute_model: handle_preemptions first, then the step's GPU
        # work (preprocess_mamba, forward), then wait_for_save's stores.
        result = self.driver.step(num_tokens)
        if preempted:  # the scheduler saw preempted_req_ids this step
            result.metadata.need_flush_before_forward = True
        self.worker.handle_preemptions(result.metadata)
        for req_id, n in num_tokens.items():
            req = self.driver.requests[req_id]
            first = (req.num_computed_tokens - n) // BLOCK
            for group_ids in self.driver.vllm_table(req_id):
                for block_id in group_ids[first : first + n // BLOCK]:
                    self.server.gpu[block_id] = MARKER[req_id]
        stores = [m for m in result.metadata.requests if m.direction == "STORE"]
        if stores:
            self.adapter.batched_submit_store_requests(
                [m.request_id for m in stores], [m.op for m in stores], object()
            )
        return result


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch, adapter: Any) -> Engine:
    return Engine(monkeypatch, adapter)


def _store_a_chunk(engine: Engine) -> set[int]:
    """a's chunk 0 stored (its store in flight); returns the blocks it reads."""
    engine.driver.add_request("a", list(range(100, 100 + 3 * BLOCK)))
    first = engine.step({"a": BLOCK})  # stores a's chunk 0: one Mamba + one FA block
    (store,) = first.stores
    return {i for group in store.block_ids for i in group}


def _schedule_b_over_the_pool(engine: Engine, preempted: bool = False) -> StepResult:
    """b's whole prompt, which takes nearly every block of the pool."""
    engine.driver.add_request("b", list(range(500, 500 + B_BLOCKS * BLOCK)))
    return engine.step({"b": B_BLOCKS * BLOCK}, preempted=preempted)


def _assert_a_stored_its_own_bytes(engine: Engine) -> None:
    engine.server.run_server()
    stored = engine.server.stored[("a", 0)]
    assert torch.equal(stored, torch.full_like(stored, MARKER["a"])), (
        "a's chunk 0 was stored with b's bytes in a block vLLM reused"
    )


@pytest.mark.fix
def test_a_stored_block_freed_mid_request_is_written_after_the_copy(engine: Engine) -> None:
    a_blocks = _store_a_chunk(engine)
    driver = engine.driver
    driver.add_request("b", list(range(500, 500 + 3 * BLOCK)))
    engine.step({"a": BLOCK, "b": BLOCK})
    # Next step: vLLM frees a's chunk-0 Mamba block (align mode keeps the last state
    # block) and hands it to b, whose forward writes it.
    engine.step({"a": BLOCK, "b": BLOCK})
    reused = a_blocks & {i for group in driver.vllm_table("b") for i in group}
    assert reused, "the pool did not hand a's stored block to b"
    _assert_a_stored_its_own_bytes(engine)


@pytest.mark.fix
def test_a_preempted_request_s_blocks_wait_for_its_copy_when_the_server_is_called_dead(
    engine: Engine,
) -> None:
    a_blocks = _store_a_chunk(engine)
    call_server_dead(engine.adapter)  # a busy server: it still copies a's chunk later
    engine.driver.preempt("a")
    _schedule_b_over_the_pool(engine, preempted=True)
    reused = a_blocks & {i for group in engine.driver.vllm_table("b") for i in group}
    assert reused, "the pool did not hand a's stored block to b"
    _assert_a_stored_its_own_bytes(engine)


@pytest.mark.fix
def test_a_finished_request_s_blocks_wait_for_its_copy_when_the_server_is_called_dead(
    engine: Engine,
) -> None:
    a_blocks = _store_a_chunk(engine)
    call_server_dead(engine.adapter)
    # The worker reports a's sending done while its server is called dead; vLLM frees
    # a's blocks and hands them to b.
    sending, _ = engine.adapter.get_finished({"a"})
    assert sending == {"a"}
    engine.driver.finish("a")
    _schedule_b_over_the_pool(engine)
    reused = a_blocks & {i for group in engine.driver.vllm_table("b") for i in group}
    assert reused, "the pool did not hand a's stored block to b"
    _assert_a_stored_its_own_bytes(engine)


@pytest.mark.fix
def test_a_finished_request_s_blocks_are_freed_after_all_its_stores(engine: Engine) -> None:
    from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

    tokens = list(range(100, 100 + 2 * BLOCK))
    for start, block_id in ((0, 1), (BLOCK, 2)):
        op = LoadStoreOp(token_ids=tokens, block_ids=[[block_id]], start=start, end=start + BLOCK)
        engine.adapter.submit_store_request("a", op, object())
    engine.server.futures[1].run()  # the latest store is done, the first is not
    sending, _ = engine.adapter.get_finished({"a"})
    assert "a" not in (sending or set()), "blocks freed while a store still reads them"
    engine.server.run_server()
    sending, _ = engine.adapter.get_finished(set())
    assert sending == {"a"}


def test_a_store_reading_no_handed_out_block_delays_nothing(engine: Engine) -> None:
    engine.driver.add_request("a", list(range(100, 100 + 3 * BLOCK)))
    engine.step({"a": BLOCK})
    engine.step({"a": BLOCK})  # a's new blocks only; chunk 0's store still in flight
    assert not engine.server.futures[0].query()


@pytest.mark.feature
def test_a_silent_server_that_answers_the_heartbeat_stops_the_engine(
    engine: Engine,
) -> None:
    class NeverCopies(MessagingFuture[bool]):
        def wait(self, timeout: float | None = None) -> bool:
            return False

    engine.adapter._mq_timeout = 0.1  # noqa: SLF001
    engine.server.submit_store = lambda *_: NeverCopies()
    a_blocks = _store_a_chunk(engine)
    engine.driver.preempt("a")
    with pytest.raises(RuntimeError, match="Stopping the engine"):
        _schedule_b_over_the_pool(engine, preempted=True)
    assert a_blocks


@pytest.mark.feature
def test_a_store_of_a_server_answering_nothing_is_given_up_once(engine: Engine) -> None:
    waits: list[float | None] = []

    class NeverCopies(MessagingFuture[bool]):
        def wait(self, timeout: float | None = None) -> bool:
            waits.append(timeout)
            return False

    engine.adapter._mq_timeout = 0.1  # noqa: SLF001
    engine.server.submit_store = lambda *_: NeverCopies()
    _store_a_chunk(engine)
    call_server_dead(engine.adapter)  # it answers neither the store nor the heartbeat
    engine.driver.preempt("a")
    step = _schedule_b_over_the_pool(engine, preempted=True)
    assert len(waits) == 1
    engine.worker.handle_preemptions(step.metadata)  # the same blocks again
    assert len(waits) == 1, "a given-up store delays every later step"
