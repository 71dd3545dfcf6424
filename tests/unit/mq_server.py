"""LMCache's real message-queue server, answering a few request types from small handlers."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import zmq

from lmcache.v1.multiprocess.mq import MessageQueueServer
from lmcache.v1.multiprocess.protocol import RequestType, get_handler_type, get_payload_classes


def free_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def serve(
    url: str,
    ctx: zmq.Context,
    handlers: dict[RequestType, Callable[..., Any]],
    blocking: Iterable[RequestType],
) -> MessageQueueServer:
    """Start a server on ``url``; ``blocking`` request types run in a thread pool."""
    server = MessageQueueServer(url, ctx)
    for rt, fn in handlers.items():
        server.add_handler(rt, get_payload_classes(rt), get_handler_type(rt), fn)
    server.add_normal_thread_pool(list(blocking), max_workers=4)
    server.start()
    return server


class ControlServer:
    """LMCache's MessageQueueServer answering what a worker adapter asks outside transfers."""

    def __init__(self, url: str, ctx: zmq.Context, chunk: int) -> None:
        def get_chunk_size() -> int:
            return chunk

        def get_experimental() -> list[str]:
            return []

        def ping(instance_id: int | None) -> bool:
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


@contextmanager
def worker_adapter(chunk: int, block: int) -> Iterator[Any]:
    """LMCache's real LMCacheMPWorkerAdapter against a ControlServer; set its transfer_ctx."""
    from lmcache.integration.vllm.vllm_multi_process_adapter import (
        LMCacheMPWorkerAdapter,
        ParallelStrategy,
    )

    url = free_url()
    ctx = zmq.Context()
    ctx.linger = 0
    server = ControlServer(url, ctx, chunk)
    strategy = ParallelStrategy(
        mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1, n_servers=1
    )
    worker = LMCacheMPWorkerAdapter(url, ctx, "stub-model", block, strategy, mq_timeout=5.0)
    try:
        yield worker
    finally:
        worker.transfer_ctx = None
        worker.shutdown()
        server.server.close()
        ctx.destroy(linger=0)
