"""lmcache 0.5.6: a hybrid model is refused on an L2 tier with an unverified persistent adapter.

fs_native (LMCache's C++ disk connector) publishes an object with nothing a load can check:
a torn, failed or replaced object file of the right size is served as KV; so do hf3fs,
nixl_native, nixl_store_dynamic and raw_block (patch 0008 lists why). Pristine 0.5.6
restores whatever bytes it finds there. The patched server logs one error naming the
adapter configured and the fs adapter, stores nothing for the hybrid model and answers its
lookups with a miss; a dense model keeps pristine behaviour, and an in-memory adapter
does not refuse a hybrid.

A real server context (MPCacheServerContext with a real L2 adapter on tmp_path), its real
transfer and lookup modules, and a 3:1 GDN:FA hybrid registered through vLLM's own
allocation and LMCache's connector edits (vllm_kv_alloc).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.bases("0.5.6")

pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_native_l2_adapter")

from log_recorder import Recorder  # noqa: E402
from mp_server_056 import MODEL, Server  # noqa: E402


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path / "l2")
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Any]:
    """Servers over an L2 adapter spec; ``{base}`` in it is a fresh folder of tmp_path."""
    servers: list[Server] = []

    def make(spec: str) -> Server:
        base = tmp_path / f"l2-{len(servers)}"
        base.mkdir()
        servers.append(Server(base, spec.replace("{base}", str(base))))
        return servers[-1]

    yield make
    for srv in servers:
        srv.close()


def _refusals(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer

    recorder = Recorder()
    monkeypatch.setattr(lmcache_driven_transfer, "logger", recorder)
    return recorder


@pytest.mark.fix
def test_a_hybrid_model_never_restores_an_unverified_fs_native_object(server):
    server.register(hybrid=True)
    assert server.seed_l2(0xA5) > 0
    assert server.hit_chunks("r1") == 0, "a hybrid model restored fs_native objects nobody verified"


@pytest.mark.fix
def test_the_refusal_is_one_error_naming_the_adapter_and_the_safe_one(server, monkeypatch):
    recorder = _refusals(monkeypatch)
    server.register(hybrid=True)
    refusals = [e for e in recorder.errors if "fs_native" in e]
    assert len(refusals) == 1, recorder.errors
    assert MODEL in refusals[0] and '"type":"fs"' in refusals[0]


# The refused adapters this environment cannot run (each needs a native extension or a
# mount), as a load would meet them: the real config the server parses, listed by its
# storage manager beside the fs_native adapter it runs.
UNBUILT = {
    "hf3fs": lambda base: {"mount_point": str(base), "base_paths": str(base / "a")},
    "nixl_native": lambda base: {"backend": "POSIX", "backend_params": {}},
    "raw_block": lambda base: {"device_path": str(base / "dev"), "slot_bytes": 1 << 20},
}


@pytest.mark.fix
@pytest.mark.parametrize("adapter", sorted(UNBUILT))
def test_the_refusal_names_each_unverified_adapter_configured(
    server, adapter, tmp_path, monkeypatch
):
    from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class
    from lmcache.v1.distributed.storage_controllers.utils import L2AdapterDescriptor

    (tmp_path / "a").mkdir()
    config = get_l2_adapter_config_class(adapter).from_dict(UNBUILT[adapter](tmp_path))
    _fs_native, running = server.ctx.storage_manager.l2_adapters()[0]
    monkeypatch.setattr(
        server.ctx.storage_manager,
        "l2_adapters",
        lambda: [(L2AdapterDescriptor(index=0, config=config), running)],
    )
    recorder = _refusals(monkeypatch)
    server.register(hybrid=True)
    refusals = [e for e in recorder.errors if adapter in e]
    assert len(refusals) == 1, recorder.errors
    assert "fs_native" not in refusals[0] and '"type":"fs"' in refusals[0]


@pytest.mark.fix
def test_the_refusal_names_the_adapter_a_fault_injector_wraps(make_server, monkeypatch):
    server = make_server(
        '{"type":"fault_inject","rate":0.0,"inner":{"type":"fs_native","base_path":"{base}"}}'
    )
    recorder = _refusals(monkeypatch)
    server.register(hybrid=True)
    assert [e for e in recorder.errors if "fault_inject(fs_native)" in e], recorder.errors


def test_a_hybrid_model_is_not_refused_on_the_in_memory_mock_adapter(make_server, monkeypatch):
    server = make_server('{"type":"mock","max_size_gb":0.25,"mock_bandwidth_gb":100}')
    recorder = _refusals(monkeypatch)
    server.register(hybrid=True)
    assert recorder.errors == []
    assert not getattr(server.transfer._cache_contexts[1], "refused", False)
