"""A retrieve the LMCache server reports as failed.

The server answers RETRIEVE with failure when the keys left L1 between lookup and retrieve
(an eviction or lock race), on a block-id underflow, or on any exception in the transfer.
Pristine 0.5.3's worker adapter logs it and reports the load as finished: vLLM never hears
of it and computes on whatever the blocks held before (LMCache#3388). The blocks must be
reported through get_block_ids_with_load_errors, so vLLM fails the request or recomputes
(vLLM 0.26.0 stops the engine instead for a hybrid model, vllm#50687: loud, not wrong).

LMCache's real worker adapter runs against LMCache's real message-queue server (it asks for
the chunk size at start-up, and its heartbeat pings); only the transfer context is a fake.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from mq_server import worker_adapter

from lmcache.v1.multiprocess.futures import MessagingFuture

CHUNK = 16
BLOCK = 16


class FailingRetrieves:
    """A transfer context whose retrieves resolve to what the server answered: ``result``."""

    def __init__(self, result: Any) -> None:
        self.result = result

    def submit_retrieve(self, *args: Any, **kwargs: Any) -> MessagingFuture[Any]:
        future: MessagingFuture[Any] = MessagingFuture()
        future.set_result(self.result)
        return future


class RaisingFuture(MessagingFuture[Any]):
    def __init__(self) -> None:
        super().__init__()
        self.is_done_.set()

    def result(self, timeout: float | None = None) -> Any:
        raise RuntimeError("retrieve reply could not be decoded")


@pytest.fixture
def adapter() -> Iterator[Any]:
    with worker_adapter(CHUNK, BLOCK) as worker:
        yield worker


def _retrieve(worker: Any, request_id: str, block_ids: list[int]) -> None:
    from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

    tokens = list(range(1000, 1000 + len(block_ids) * BLOCK))
    op = LoadStoreOp(token_ids=tokens, block_ids=[block_ids], start=0, end=len(tokens))
    worker.submit_retrieve_request(request_id, op, event=object())


@pytest.mark.fix
def test_a_retrieve_the_server_failed_is_reported_as_load_errors(adapter) -> None:
    adapter.transfer_ctx = FailingRetrieves(False)
    _retrieve(adapter, "req-1", [4, 5, 6])
    _, finished_retrieves = adapter.get_finished(set())
    assert finished_retrieves == {"req-1"}  # vLLM still hears the load ended
    # ...and that its blocks hold nothing it may compute on.
    assert adapter.get_block_ids_with_load_errors() == {4, 5, 6}
    assert adapter.get_block_ids_with_load_errors() == set()  # reported once


def test_a_retrieve_that_succeeded_reports_no_load_errors(adapter) -> None:
    adapter.transfer_ctx = FailingRetrieves(True)
    _retrieve(adapter, "req-1", [4, 5, 6])
    assert adapter.get_finished(set())[1] == {"req-1"}
    assert adapter.get_block_ids_with_load_errors() == set()


def test_a_retrieve_whose_reply_raises_is_a_load_error_not_a_crash(adapter) -> None:
    class Raising(FailingRetrieves):
        def submit_retrieve(self, *args: Any, **kwargs: Any) -> MessagingFuture[Any]:
            return RaisingFuture()

    adapter.transfer_ctx = Raising(None)
    _retrieve(adapter, "req-2", [9])
    assert adapter.get_finished(set())[1] == {"req-2"}
    assert adapter.get_block_ids_with_load_errors() == {9}
