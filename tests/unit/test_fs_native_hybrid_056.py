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

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.bases("0.5.6")

pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_native_l2_adapter")

from fs_l2_driver import Buf, wait_for  # noqa: E402
from vllm_kv_alloc import _Wrapper, build_registration  # noqa: E402

MODEL = "org/hybrid"
TOKENS_PER_BLOCK = 16
CHUNK = 16
NUM_CHUNKS = 4
TOKENS = tuple(range(1, CHUNK * NUM_CHUNKS + 1))


class Recorder:
    """Stands in for a module's logger; keeps the errors."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def error(self, msg: str, *args: object) -> None:
        self.errors.append(msg % args if args else msg)

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


class Server:
    """One server context over an fs_native L2 folder, with its transfer and lookup modules."""

    def __init__(self, base: Path, l2_adapter: str | None = None) -> None:
        from lmcache.v1.distributed.config import parse_args
        from lmcache.v1.multiprocess.engine_context import MPCacheServerContext
        from lmcache.v1.multiprocess.modules.lmcache_driven_transfer import (
            LMCacheDrivenTransferModule,
        )
        from lmcache.v1.multiprocess.modules.lookup import LookupModule

        config = parse_args(
            [
                "--l1-size-gb",
                "0.25",
                "--eviction-policy",
                "LRU",
                "--l2-adapter",
                l2_adapter or f'{{"type":"fs_native","base_path":"{base}"}}',
            ]  # fmt: skip
        )
        self.base = base
        self.ctx = MPCacheServerContext(config, chunk_size=CHUNK)
        self.transfer = LMCacheDrivenTransferModule(self.ctx)
        self.lookups = LookupModule(self.ctx)
        self.l2 = self.ctx.storage_manager.l2_adapters()[0][1]

    def register(self, hybrid: bool) -> None:
        from lmcache.integration.vllm.kv_cache_group_edits import apply_kv_cache_group_edits
        from lmcache.integration.vllm.kv_cache_groups import create_engine_group_infos_from_vllm
        from lmcache.integration.vllm.utils import translate_vllm_kv_cache_layout
        from lmcache.utils import EngineType

        reg = build_registration(TOKENS_PER_BLOCK, TOKENS_PER_BLOCK, "LBNHC")
        hints = {"kv_layout": translate_vllm_kv_cache_layout(reg.layout)}
        edited = apply_kv_cache_group_edits(reg.config, dict(reg.kv_caches), layout_hints=hints)
        infos = create_engine_group_infos_from_vllm(reg.config, edited, layout_hints=hints)
        if not hybrid:  # the FA group alone: what a dense model registers
            fa = [i for i in infos if not i.recurrent_state]
            names = list(edited)
            edited = {names[j]: edited[names[j]] for i in fa for j in i.layer_indices}
            infos = [
                type(i)(engine_group_id=0, layer_indices=tuple(range(len(edited))),
                        tokens_per_block=i.tokens_per_block)
                for i in fa[:1]
            ]  # fmt: skip
        self.transfer.register_kv_cache(
            1,
            [_Wrapper(t) for t in edited.values()],
            MODEL,
            1,
            EngineType.VLLM,
            hints,
            infos,
        )

    def key(self, request_id: str, worker_id: int | None = None) -> Any:
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        return IPCCacheServerKey(
            model_name=MODEL,
            world_size=1,
            worker_id=worker_id,
            token_ids=TOKENS,
            start=0,
            end=len(TOKENS),
            request_id=request_id,
            num_kv_readers=1,
        )

    def seed_l2(self, fill: int) -> int:
        """Writes an object of the registered layout's size, every byte ``fill``, under
        each key a lookup of TOKENS asks for: what a torn or replaced store leaves. The
        number of objects."""
        registry = self.ctx.layout_desc_registry
        descs = registry.find_group_layout_descs(MODEL, 1)
        keys = self._layout_keys(sorted(descs))
        bufs, flat = [], []
        for gid, group_keys in enumerate(keys):
            nbytes = sum(
                _numel(shape) * dtype.itemsize
                for shape, dtype in zip(descs[gid].shapes, descs[gid].dtypes, strict=True)
            )
            for k in group_keys:
                bufs.append(Buf(bytes([fill]) * nbytes))
                flat.append(k)
        # The server's store controller consumes the adapter's completions: wait for
        # the files instead.
        self.l2.submit_store_task(flat, [b.obj for b in bufs])
        wait_for(lambda: self._files() >= len(flat) or None, "seeding the fs_native folder")
        return len(flat)

    def _layout_keys(self, group_ids: list[int]) -> Any:
        """The keys of TOKENS as the registered layout keys them: under its layout
        fingerprint where the build has one (what any other server or an earlier run of
        this layout stores), not the namespace of a refusal."""
        seed = self.key("seed", worker_id=0)
        try:
            from lmcache.v1.distributed import layout_namespace as ns
        except ImportError:  # pristine: no layout namespace
            return self.ctx.resolve_obj_keys(seed, group_ids)
        registry = self.ctx.layout_desc_registry
        previous = ns.split_model_name(ns.namespaced_model_name(MODEL, 1))[1]
        ns.set_layout_namespace(MODEL, 1, registry._registry[(MODEL, 1)].fingerprint)
        try:
            return self.ctx.resolve_obj_keys(seed, group_ids)
        finally:
            ns.set_layout_namespace(MODEL, 1, previous)

    def _files(self) -> int:
        return sum(1 for p in self.base.rglob("*") if p.is_file() and ".tmp" not in p.name)

    def hit_chunks(self, request_id: str) -> int:
        self.lookups.lookup(self.key(request_id), 1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            n = self.lookups.query_prefetch_status(request_id)
            if n is not None:
                return n
            time.sleep(0.02)
        raise RuntimeError("the lookup did not complete")

    def close(self) -> None:
        for closer in (self.lookups.close, self.transfer.close, self.ctx.close):
            try:
                closer()
            except Exception:
                pass


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


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
