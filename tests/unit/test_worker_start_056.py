"""The worker-side connector starts and registers a hybrid's KV cache under vLLM's own
engine config (0.5.6 base).

vLLM's worker builds the connector from its engine config, resolves the KV cache layout,
allocates the KV cache and hands it to ``register_kv_caches``; the connector edits the
views, declares its groups and identity, and LMCache's worker adapter sends them to the
server. Here the engine config is vLLM's own (EngineArgs of a tiny OlmoHybrid on vLLM's
CPU platform), the KV cache is allocated by vLLM's own code, the connector and worker
adapter are LMCache's, and the server is a real server context (mp_server_056). Only the
message queue is stood in for: a request client that answers the handshake, and a
transfer context that hands the registration to the server as the queue would (IPC
handles need a GPU).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

from handshake_client import HandshakeClient, connect_to, real_server_experimental  # noqa: E402
from log_recorder import Recorder  # noqa: E402
from mp_server_056 import CHUNK, TOKENS_PER_BLOCK, Server  # noqa: E402
from vllm_cpu_engine import engine_config  # noqa: E402
from vllm_kv_alloc import _Wrapper, build_registration, over_the_queue  # noqa: E402

pytestmark = pytest.mark.bases("0.5.6")


class QueueToServer:
    """A worker transfer context whose registration crosses to ``server`` as LMCache's
    message queue carries it (msgpack), with each tensor as its IPC handle's stand-in."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.model_name = ""
        self.layout_hints: dict[str, Any] = {}

    def register(
        self,
        kv_caches: dict[str, Any],
        model_name: str,
        world_size: int,
        _blocks_in_chunk: int,
        _mq_timeout: float,
        layout_hints: Any = None,
        engine_group_infos: Any = (),
        engine_type: Any = None,
    ) -> None:
        self.model_name = model_name
        self.layout_hints = dict(layout_hints or {})
        self.server.transfer.register_kv_cache(
            1,
            [_Wrapper(t) for t in kv_caches.values()],
            model_name,
            world_size,
            engine_type,
            self.layout_hints,
            over_the_queue(engine_group_infos),
        )

    def close(self) -> None:
        pass


@pytest.mark.parametrize("layout, name", [("LBNHC", "NHD"), ("LBHNC", "HND")], ids=["NHD", "HND"])
def test_a_hybrid_engine_s_worker_registers_its_kv_cache(tmp_path, monkeypatch, layout, name):
    from hybridfa_gate.models import MODELS, write_model_dir
    from lmcache.integration.vllm import lmcache_mp_connector as mpc
    from lmcache.integration.vllm import vllm_multi_process_adapter as vmpa
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer

    model_dir = write_model_dir(MODELS["olmo-r5"], tmp_path)
    config = engine_config(model_dir, TOKENS_PER_BLOCK, monkeypatch)
    # What vLLM's set_kv_cache_layout RPC leaves on the worker's config.
    config.cache_config.kv_cache_layout = layout
    # Full attention subpaged: two kernel pages per block, as FlashInfer pages a hybrid.
    reg = build_registration(TOKENS_PER_BLOCK, TOKENS_PER_BLOCK // 2, layout)
    base = tmp_path / "l2"
    server = Server(base, f'{{"type":"fs","base_path":"{base}"}}')
    queue = QueueToServer(server)
    connect_to(monkeypatch, HandshakeClient(CHUNK, real_server_experimental()))
    monkeypatch.setattr(vmpa, "create_transfer_context", lambda *_, **__: queue)
    server_log = Recorder()
    monkeypatch.setattr(lmcache_driven_transfer, "logger", server_log)
    try:
        connector = mpc.LMCacheMPConnector(config, mpc.KVConnectorRole.WORKER, reg.config)
        assert type(connector.worker_adapter).__name__ == "LMCacheMPWorkerAdapter"
        connector.register_kv_caches(dict(reg.kv_caches))
        descs = server.ctx.layout_desc_registry.find_group_layout_descs(queue.model_name, 1)
    finally:
        server.close()
    assert queue.model_name == str(model_dir)
    assert queue.layout_hints == {"kv_layout": name}, "not the layout vLLM resolved"
    assert descs, "the server holds no layout for the engine's registration"
    assert server_log.errors == [], "the server refused the engine's registration"
