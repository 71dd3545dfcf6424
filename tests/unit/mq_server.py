"""LMCache's real message-queue server, answering a few request types from small handlers."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable
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
