"""A request client that answers LMCache 0.5.6's adapter handshake as a server does: its
chunk size, its GET_EXPERIMENTAL reply and the heartbeat's ping (no server runs); and what
LMCache's real adapters need to connect to it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest


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


def connect_to(monkeypatch: pytest.MonkeyPatch, *clients: Any) -> None:
    """LMCache's adapters connect to ``clients``, one per server URL in order (the last one
    answers any further connection)."""
    from lmcache.integration.vllm import vllm_multi_process_adapter as vmpa

    queue = iter(clients)
    monkeypatch.setattr(
        vmpa.RequestClientFactory, "create", lambda *_, **__: next(queue, clients[-1])
    )


def one_gpu(n_servers: int = 1) -> Any:
    """The ParallelStrategy of one engine on one GPU (no TP, no PP)."""
    from lmcache.integration.vllm import vllm_multi_process_adapter as vmpa

    return vmpa.ParallelStrategy(
        mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1,
        n_servers=n_servers,
    )  # fmt: skip


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
