"""A request client that answers LMCache 0.5.6's adapter handshake as a server does: its
chunk size, its GET_EXPERIMENTAL reply and the heartbeat's ping (no server runs)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def answered(value: Any) -> Any:
    """A MessagingFuture that already holds ``value``."""
    from lmcache.v1.multiprocess.futures import MessagingFuture

    future: MessagingFuture[Any] = MessagingFuture()
    future.set_result(value)
    return future


def real_server_experimental() -> list[str]:
    """What the build under test's server (its real ManagementModule) answers to
    GET_EXPERIMENTAL (vllm_sched_fakes.this_build_experimental spells out only the markers)."""
    from types import SimpleNamespace

    from lmcache.v1.multiprocess.modules.management import ManagementModule

    return ManagementModule(SimpleNamespace()).get_experimental()


class HandshakeClient:
    """A server started with ``--chunk-size chunk`` that advertises ``experimental``."""

    def __init__(self, chunk: int, experimental: Iterable[str] = ()) -> None:
        self.chunk = chunk
        self.experimental = list(experimental)
        self.closed = False

    def get_chunk_size(self) -> Any:
        return answered(self.chunk)

    def get_experimental(self) -> Any:
        return answered(self.experimental)

    def ping(self, *_: Any) -> Any:
        return answered(True)

    def close(self) -> None:
        self.closed = True
