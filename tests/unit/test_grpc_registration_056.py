"""lmcache 0.5.6 over gRPC (``lmcache server --transport grpc``): a hybrid engine's KV cache
registration reaches the server with the layout it declares, and the server keys it as it
keys the same registration over ZMQ.

The series' EngineGroupInfo carries each engine group's layout format, state layout and the
engine's identity (0005). 0.5.6's gRPC transport mirrors that struct field by field in its
EngineGroupInfo message: without those fields there no gRPC request server could be built
("no structural codec"), so a server started with --transport grpc served nothing.

A real gRPC server and client (127.0.0.1) carry the registration of the KV cache vLLM
allocates for a 3:1 GDN:FA hybrid, with the connector's edits and group infos
(vllm_kv_alloc), to LMCache's real LMCacheDrivenTransferModule over a real server context
(mp_server_056). The tensors stay in this process: the server side hands the module the
same views (their IPC wrappers are the transport's own, which the series does not change).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.bases("0.5.6")

pytest.importorskip("vllm.v1.kv_cache_interface")
# The lmcache 0.5.3 base imports this file too (its tests skip here), and has no such module.
pytest.importorskip("lmcache.v1.multiprocess.request_handler", reason="an lmcache 0.5.6 module")

from mp_server_056 import MODEL, TOKENS_PER_BLOCK, Server  # noqa: E402
from vllm_kv_alloc import _Wrapper, build_registration, connector_view  # noqa: E402

from lmcache.utils import EngineType  # noqa: E402
from lmcache.v1.gpu_connector.utils import LayoutHints  # noqa: E402
from lmcache.v1.multiprocess.custom_types import KVCache  # noqa: E402
from lmcache.v1.multiprocess.group_view import EngineGroupInfo  # noqa: E402
from lmcache.v1.multiprocess.request_handler import request_handler  # noqa: E402

TIMEOUT_S = 10.0
IDENTITY = "0123456789abcdef"


def _registration() -> tuple[list[_Wrapper], list[EngineGroupInfo], dict[str, str]]:
    reg = build_registration(TOKENS_PER_BLOCK, TOKENS_PER_BLOCK, "LBNHC")
    edited, infos, hints = connector_view(reg, engine_identity=IDENTITY)
    return [_Wrapper(t) for t in edited.values()], infos, hints


def _fingerprint(server: Server) -> Any:
    return server.ctx.layout_desc_registry._registry[(MODEL, 1)].fingerprint


class _Received:
    """The server's side of REGISTER_KV_CACHE: what arrived, handed to the real module
    with this process's views of the tensors."""

    def __init__(self, server: Server, wrappers: list[_Wrapper]) -> None:
        self.server, self.wrappers = server, wrappers
        self.infos: list[EngineGroupInfo] = []

    @request_handler()
    def register_kv_cache(
        self,
        instance_id: int,
        kv_caches: KVCache,
        model_name: str,
        world_size: int,
        engine_type: EngineType,
        layout_hints: LayoutHints,
        engine_group_infos: list[EngineGroupInfo],
    ) -> None:
        self.infos = list(engine_group_infos)
        self.server.transfer.register_kv_cache(
            instance_id, self.wrappers, model_name, world_size, engine_type,  # type: ignore[arg-type]
            layout_hints, engine_group_infos,
        )  # fmt: skip


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[Server, Server]]:
    made: list[Server] = []
    for name in ("grpc", "zmq"):
        base = tmp_path / name
        made.append(Server(base, f'{{"type":"fs","base_path":"{base}"}}'))
    yield made[0], made[1]
    for server in made:
        server.close()


@pytest.mark.feature
def test_a_hybrid_registered_over_grpc_is_keyed_as_over_zmq(
    servers: tuple[Server, Server],
) -> None:
    from lmcache.v1.multiprocess.transport.grpc_impl.client import GrpcMultiprocessClient
    from lmcache.v1.multiprocess.transport.grpc_impl.server import GrpcMultiprocessServer

    over_grpc, over_zmq = servers
    wrappers, infos, hints = _registration()
    assert any(i.recurrent_state for i in infos) and all(i.layout_format for i in infos)

    received = _Received(over_grpc, wrappers)
    grpc_server = GrpcMultiprocessServer(
        "grpc://127.0.0.1:0", max_cpu_workers=2, max_gpu_workers=1, grpc_server_workers=2
    )
    grpc_server.add_modules([received])
    grpc_server.start()
    client = GrpcMultiprocessClient(f"grpc://127.0.0.1:{grpc_server.bound_port}")  # type: ignore[abstract]
    try:
        client.register_kv_cache(1, [], MODEL, 1, EngineType.VLLM, hints, infos).result(TIMEOUT_S)
    finally:
        client.close()
        grpc_server.close()
    over_zmq.transfer.register_kv_cache(1, wrappers, MODEL, 1, EngineType.VLLM, hints, infos)

    assert received.infos == infos
    assert [i.engine_identity for i in received.infos] == [IDENTITY] * len(infos)
    assert _fingerprint(over_grpc) is not None
    assert _fingerprint(over_grpc) == _fingerprint(over_zmq)
