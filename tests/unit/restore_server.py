"""A whole LMCache MP server on CPU over a persistent fs L2 folder, for restore tests.

Real classes: MPCacheServerContext (StorageManager with its L1 and the real FSL2Adapter,
prefetch and store controllers), the LookupModule and the LMCacheDrivenTransferModule,
registered from the exact vLLM 0.26 hybrid KV tensors of hybrid_kv.build_hybrid_kv.
Stand-ins only where the server needs a GPU: the IPC event backend, and the stream
callbacks (finish_write / finish_read_prefetched), which run at once instead of after
the copy on a CUDA stream. Every object the fs adapter loads is recorded, so a test can
count the bytes a restore reads from disk.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from fs_l2_driver import wait_for
from hybrid_kv import (
    FA_DTYPE,
    FA_LAYERS,
    NUM_LAYERS,
    GDNState,
    HybridKV,
    _NoopDispatcher,
    _NoopEventBackend,
    _Wrapper,
    build_hybrid_kv,
    connector_view,
)
from vllm_engine import Engine, register_through_connector
from vllm_kv_alloc import over_the_queue

from hybridfa_gate import l2 as l2_tiers

MODEL = "hybrid"
TIMEOUT_S = 10.0
# Servers (nodes) share one process: a stream callback runs on the server whose cache
# context owns the stream.
_STREAM_OWNERS: dict[int, Any] = {}


@dataclass
class DiskReads:
    """Objects the fs L2 adapter was asked to load: (key, bytes) in order."""

    loads: list[tuple[Any, int]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.loads)


@dataclass
class RealServer:
    ctx: Any
    lookup_module: Any
    transfer: Any
    engine_group_infos: list[Any]
    l2_dir: Path
    reads: DiskReads
    l2_objects: Callable[[], int]  # objects in the L2 tier (all nodes')
    kv: HybridKV  # the engine's KV tensors it serves
    closed: bool = False
    instance: int = 1  # the engine instance whose stores and retrieves go through it

    def key(
        self,
        tokens: list[int],
        start: int,
        end: int,
        request: str,
        worker: int | None,
        cache_salt: str = "",
    ):
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        return IPCCacheServerKey.from_token_ids(
            MODEL,
            1,
            worker,
            tokens,
            start=start,
            end=end,
            request_id=request,
            cache_salt=cache_salt,
        )

    @property
    def num_object_groups(self) -> int:
        return int(self.ctx.layout_desc_registry.find_attn_desc(MODEL, 1).num_object_groups)

    def block_ids(self, engine_block_ids: list[list[int]]) -> list[list[int]]:
        from lmcache.v1.multiprocess.group_view import expand_engine_block_ids

        return expand_engine_block_ids(self.engine_group_infos, engine_block_ids)

    def store(
        self,
        request: str,
        tokens: list[int],
        engine_block_ids: list[list[int]],
        cache_salt: str = "",
    ) -> bool:
        end = len(tokens) - len(tokens) % self.ctx.chunk_size
        key = self.key(tokens, 0, end, request, 0, cache_salt)
        _, ok = self.transfer.store(key, self.instance, self.block_ids(engine_block_ids), b"")
        return bool(ok)

    def lookup(self, request: str, tokens: list[int], cache_salt: str = "") -> int:
        """The lookup's hit in chunks, once its prefetch (L1 and L2) has completed."""
        key = self.key(tokens, 0, len(tokens), request, None, cache_salt)
        self.lookup_module.lookup(key, 1)
        status = self.lookup_module.query_prefetch_status
        return int(wait_for(lambda: status(request), f"prefetch of {request}", TIMEOUT_S))

    def retrieve(
        self, request: str, tokens: list[int], start: int, end: int, ids: list[list[int]]
    ) -> bool:
        key = self.key(tokens, start, end, request, 0)
        _, ok = self.transfer.retrieve(key, self.instance, self.block_ids(ids), b"", 0)
        return bool(ok)

    def free_lookup_locks(self, request: str, tokens: list[int], start: int, end: int) -> None:
        self.lookup_module.free_lookup_locks(self.key(tokens, start, end, request, None), 1)

    def object_keys(self, tokens: list[int], num_chunks: int) -> list[list[Any]]:
        """The ObjectKeys of the first ``num_chunks`` chunks, per object group."""
        from lmcache.v1.distributed.api import ipc_key_to_object_keys

        hashes = self.ctx.token_hasher.compute_chunk_hashes(tokens)[:num_chunks]
        groups = self.ctx.layout_desc_registry.find_attn_desc(MODEL, 1).num_object_groups
        key = self.key(tokens, 0, len(tokens), "keys", 0)
        return ipc_key_to_object_keys(key, hashes, list(range(groups)))

    def read_locked(self, keys: list[Any]) -> list[bool]:
        """Whether L1 holds a read lock on each key (False for a key not in L1)."""
        objects = self.ctx.storage_manager._l1_manager._objects  # noqa: SLF001
        return [k in objects and objects[k].read_lock.is_locked() for k in keys]

    def wait_l2_objects(self, count: int) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            if self.l2_objects() >= count:
                time.sleep(0.1)  # let the adapter finish the last object
                return
            time.sleep(0.02)
        found = self.l2_objects()
        raise RuntimeError(f"{found} of {count} objects reached the L2 tier in {TIMEOUT_S}s")

    def add_engine(self, kv: HybridKV, instance: int) -> RealServer:
        """Register another engine instance of the same model name on this server;
        the view of the server that engine's stores and retrieves go through."""
        wire = _register(self.transfer, self.ctx, kv, instance, pristine_client=False, engine=None)
        return dataclasses.replace(self, engine_group_infos=wire, kv=kv, instance=instance)

    def unregister(self) -> None:
        """The engine instance stops (UNREGISTER_KV_CACHE)."""
        self.transfer.unregister_kv_cache(self.instance)

    def close(self) -> None:
        """Stop the server (a restart, when a new one opens the same folder)."""
        if self.closed:
            return
        self.closed = True
        self.lookup_module.close()
        self.transfer.close()
        self.ctx.close()


def _storage_config(
    l2_dir: Path,
    l2_adapter: str = "fs",
    resp_port: int | None = None,
    read_ttl_seconds: int = 300,
) -> Any:
    from lmcache.v1.distributed.config import (
        EvictionConfig,
        L1ManagerConfig,
        L1MemoryManagerConfig,
        StorageManagerConfig,
    )
    from lmcache.v1.distributed.l2_adapters.config import L2AdaptersConfig

    memory = L1MemoryManagerConfig(
        size_in_bytes=64 << 20, use_lazy=False, init_size_in_bytes=64 << 20, shm_name=""
    )
    return StorageManagerConfig(
        l1_manager_config=L1ManagerConfig(memory_config=memory, read_ttl_seconds=read_ttl_seconds),
        eviction_config=EvictionConfig(eviction_policy="LRU"),
        l2_adapter_config=L2AdaptersConfig([_l2_adapter_config(l2_dir, l2_adapter, resp_port)]),
    )


def _l2_adapter_config(l2_dir: Path, l2_adapter: str, resp_port: int | None) -> Any:
    """LMCache's config of the ``fs`` (Python) or ``fs_native`` (C++) adapter on l2_dir, or of
    the ``resp`` adapter (C++ Redis client) on redis at 127.0.0.1:resp_port, parsed from the
    same ``--l2-adapter`` JSON the GPU gate gives its servers."""
    from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class

    if l2_adapter == "resp":
        if resp_port is None:
            raise ValueError("the resp adapter needs ServerFactory.resp_port (a redis-server)")
        spec = {**l2_tiers.adapter_json("resp", port=resp_port), "num_workers": 2}
    else:
        spec = l2_tiers.adapter_json(l2_adapter, folder=l2_dir)
    return get_l2_adapter_config_class(spec["type"]).from_dict(spec)


class ServerFactory:
    """Starts RealServers (the ``real_servers`` fixture); ``close_all`` stops them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._monkeypatch = monkeypatch
        self._started: list[RealServer] = []
        self.resp_port: int | None = None  # the redis-server of l2_adapter="resp"

    def __call__(
        self,
        kv: HybridKV,
        chunk_size: int,
        l2_dir: Path,
        separate: bool,
        pristine_client: bool = False,
        l2_adapter: str = "fs",
        read_ttl_seconds: int = 300,
        engine: Engine | None = None,
    ) -> RealServer:
        server = start_real_server(
            kv,
            chunk_size,
            l2_dir,
            separate,
            self._monkeypatch,
            pristine_client,
            l2_adapter,
            self.resp_port,
            read_ttl_seconds,
            engine,
        )
        self._started.append(server)
        return server

    def close_all(self) -> None:
        for server in self._started:
            server.close()


def start_real_server(
    kv: HybridKV,
    chunk_size: int,
    l2_dir: Path,
    separate_object_groups: bool,
    monkeypatch: pytest.MonkeyPatch,
    pristine_client: bool = False,
    l2_adapter: str = "fs",
    resp_port: int | None = None,
    read_ttl_seconds: int = 300,
    engine: Engine | None = None,
) -> RealServer:
    """Start a server on ``l2_dir`` (or, for ``resp``, on redis at ``resp_port``) and
    register ``kv`` as LMCacheMPConnector does; with ``pristine_client``, with the group
    infos a pristine 0.5.3 client sends; with ``engine``, through the real worker-side
    connector under that engine's settings."""
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2Adapter
    from lmcache.v1.gpu_connector.kv_format.detectors import vllm as vllm_detector
    from lmcache.v1.multiprocess.engine_context import MPCacheServerContext
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as transfer
    from lmcache.v1.multiprocess.modules.lookup import LookupModule

    # lmcache 0.5.3's detector forces HND on CPU; the GPU path honours the hint.
    monkeypatch.setattr(vllm_detector, "torch_device_type", "cuda")
    monkeypatch.setattr(transfer, "DeviceHostFuncDispatcher", _NoopDispatcher)
    monkeypatch.setattr(transfer, "get_event_ipc_backend", lambda device: _NoopEventBackend())

    reads = DiskReads()
    original_load = FSL2Adapter.submit_load_task

    def recording_load(self: Any, keys: list[Any], objects: list[Any]) -> Any:
        reads.loads.extend((k, o.get_size()) for k, o in zip(keys, objects, strict=True))
        return original_load(self, keys, objects)

    monkeypatch.setattr(FSL2Adapter, "submit_load_task", recording_load)

    l2_dir.mkdir(parents=True, exist_ok=True)
    ctx = MPCacheServerContext(
        _storage_config(l2_dir, l2_adapter, resp_port, read_ttl_seconds),
        chunk_size=chunk_size,
        separate_object_groups=separate_object_groups,
    )

    def run_now(stream: Any, kind: str, keys: list[Any]) -> None:
        getattr(_STREAM_OWNERS[id(stream)].storage_manager, kind)(keys)

    monkeypatch.setattr(transfer, "submit_callback_to_stream", run_now)

    module = transfer.LMCacheDrivenTransferModule(ctx)
    wire = _register(module, ctx, kv, 1, pristine_client, engine)
    return RealServer(
        ctx, LookupModule(ctx), module, wire, l2_dir, reads, _l2_counter(l2_dir, resp_port), kv
    )


def _register(
    module: Any,
    ctx: Any,
    kv: HybridKV,
    instance: int,
    pristine_client: bool,
    engine: Engine | None,
) -> list[Any]:
    """Register ``kv`` as engine ``instance`` of MODEL as LMCacheMPConnector does (with
    ``pristine_client``, with the group infos a pristine 0.5.3 client sends; with
    ``engine``, through the real connector under that engine's settings); the group
    infos that crossed the message queue."""
    from lmcache.utils import EngineType
    from lmcache.v1.multiprocess.group_view import EngineGroupInfo

    hints = {"kv_layout": kv.layout}
    if engine is not None:
        edited, infos = register_through_connector(engine, MODEL, kv)
    else:
        edited, infos = connector_view(kv)
    if pristine_client:
        infos = [
            EngineGroupInfo(
                engine_group_id=i.engine_group_id,
                layer_indices=i.layer_indices,
                tokens_per_block=i.tokens_per_block,
                sw_size_tokens=i.sw_size_tokens,
            )
            for i in infos
        ]
    wire = over_the_queue(infos)
    wrappers = [_Wrapper(t) for t in edited.values()]
    module.register_kv_cache(instance, wrappers, MODEL, 1, EngineType.VLLM, hints, wire)
    for entry in module._cache_contexts.values():  # noqa: SLF001
        _STREAM_OWNERS[id(entry.cache_context.cupy_stream)] = ctx
    return wire


def _l2_counter(l2_dir: Path, resp_port: int | None) -> Callable[[], int]:
    """Counts the objects of the L2 tier: complete files in the folder, or redis keys."""
    if resp_port is None:
        return lambda: len(list(l2_dir.glob("*.data")))
    from hybridfa_gate.l2 import RespClient

    def dbsize() -> int:
        with RespClient(resp_port) as client:
            return int(client.command("DBSIZE"))

    return dbsize


# ---------------------------------------------------------------------------------------
# Store under one setting, restart, restore under another (the transition matrix)

N, PAGE = 80, 16  # vLLM block of 5 FlashInfer kernel pages
BLOCKS = 12  # the prompt: 12 blocks, a whole number of chunks at N, 2N and 3N
NUM_BLOCKS = 64
FA_GROUP = 3  # engine group order: Mamba groups 0-2, FA group 3


@dataclass(frozen=True)
class Setup:
    layout: str = "NHD"
    page: int = PAGE  # FlashInfer's kernel page; N is FlashAttention (page = block)
    chunk: int = N
    separate: bool = False  # lmcache server --separate-object-groups
    gdn: GDNState = GDNState()
    pristine_client: bool = False  # the group infos a pristine 0.5.3 client sends
    l2_adapter: str = "fs"  # or fs_native, or resp (on ServerFactory.resp_port)
    engine: Engine | None = None  # registered through the real connector under it

    def but(self, **changes: Any) -> Setup:
        return dataclasses.replace(self, **changes)

    @property
    def server_args(self) -> dict[str, Any]:
        return {
            "separate": self.separate,
            "pristine_client": self.pristine_client,
            "l2_adapter": self.l2_adapter,
            "engine": self.engine,
        }

    @property
    def fa_dtype(self) -> torch.dtype:
        return self.engine.fa_dtype if self.engine else FA_DTYPE


BASE = Setup()


def tokens(first: int = 1000) -> list[int]:
    return list(range(first, first + BLOCKS * N + 1))


def store_ids(chunk: int = N, nulled: bool = False) -> list[list[int]]:
    """Block ids of the stored prompt; ``nulled``: as vLLM's align mode leaves them
    after multi-block steps, every Mamba slot but each chunk's last one null."""
    ids = [[1 + g * BLOCKS + i for i in range(BLOCKS)] for g in range(4)]
    if nulled:
        per_chunk = chunk // N
        for g in range(3):
            ids[g] = [b if (i + 1) % per_chunk == 0 else 0 for i, b in enumerate(ids[g])]
    return ids


def restore_ids(blocks: int) -> list[list[int]]:
    """vLLM's allocation for an external hit in align mode: FA blocks from the pool,
    Mamba slots null-padded but the last."""
    fa = [NUM_BLOCKS - 1 - i for i in range(blocks)]
    return [[0] * (blocks - 1) + [2 + g] for g in range(3)] + [fa]


def store(
    real_servers: ServerFactory, l2: Path, setup: Setup, ids: list[list[int]] | None = None
) -> HybridKV:
    kv = build_hybrid_kv(
        N, setup.page, setup.layout, NUM_BLOCKS, seed=0, gdn=setup.gdn, fa_dtype=setup.fa_dtype
    )
    server = real_servers(kv, setup.chunk, l2, **setup.server_args)
    stored = server.store("store", tokens(), ids or store_ids())
    if setup.l2_adapter == "fs_native":
        time.sleep(1.0)  # fs_native writes in its own threads: let them finish
    elif stored or not setup.pristine_client:
        assert stored
        server.wait_l2_objects(BLOCKS * N // setup.chunk * server.num_object_groups)
    server.close()
    return kv


def restored_blocks(
    real_servers: ServerFactory,
    tmp_path: Path,
    a: Setup,
    b: Setup,
    stored: list[list[int]] | None = None,
) -> int:
    """Store under ``a`` (from block ids ``stored``), restart under ``b`` on the same
    folder, and restore what the lookup hits: the blocks restored (0 for a miss). A hit
    must bring back every stored byte, or the test fails here."""
    l2 = tmp_path / "l2"
    stored = stored or store_ids()
    src = store(real_servers, l2, a, stored)
    return restore_compared(real_servers, l2, b, src, stored)


def restore_compared(
    real_servers: ServerFactory,
    l2: Path,
    b: Setup,
    src: HybridKV,
    stored: list[list[int]] | None = None,
    prompt: list[int] | None = None,
) -> int:
    """Start a server under ``b`` on ``l2`` (a node with an empty L1), restore what its
    lookup of ``prompt`` hits and compare it with the blocks ``stored`` from ``src``: the
    blocks restored (0 for a miss); a restored byte that differs fails here."""
    blocks, wrong = restart_and_restore(real_servers, l2, b, src, stored, prompt)
    assert not wrong, wrong[0]
    return blocks


def restart_and_restore(
    real_servers: ServerFactory,
    l2: Path,
    b: Setup,
    src: HybridKV,
    stored: list[list[int]] | None = None,
    prompt: list[int] | None = None,
) -> tuple[int, list[str]]:
    """restore_compared without its assertion: the blocks restored and the restored blocks
    whose bytes differ (restored_and_wrong)."""
    kv = build_hybrid_kv(N, b.page, b.layout, NUM_BLOCKS, seed=1, gdn=b.gdn, fa_dtype=b.fa_dtype)
    server = real_servers(kv, b.chunk, l2, **b.server_args)
    return restored_and_wrong(server, src, stored, prompt)


def restore_through(
    server: RealServer,
    src: HybridKV,
    stored: list[list[int]] | None = None,
    prompt: list[int] | None = None,
    request: str = "restore",
) -> int:
    """Restore what ``server``'s lookup of ``prompt`` hits into its engine and compare
    it with the blocks ``stored`` from ``src``: the blocks restored (0 for a miss); a
    restored byte that differs fails here."""
    blocks, wrong = restored_and_wrong(server, src, stored, prompt, request)
    assert not wrong, wrong[0]
    return blocks


def restored_and_wrong(
    server: RealServer,
    src: HybridKV,
    stored: list[list[int]] | None = None,
    prompt: list[int] | None = None,
    request: str = "restore",
) -> tuple[int, list[str]]:
    """restore_through without its assertion: the blocks restored (0 for a miss) and one
    line per restored block whose bytes differ from the stored block's, for a test that
    asserts on them itself."""
    stored = stored or store_ids()
    prompt = prompt or tokens()
    chunk = server.ctx.chunk_size
    hit = server.lookup(request, prompt[:-1])
    if hit == 0:
        return 0, []
    blocks = hit * chunk // N
    ids = restore_ids(blocks)
    assert server.retrieve(request, prompt, 0, hit * chunk, ids)
    wrong = []
    for layer in range(NUM_LAYERS):
        if layer in FA_LAYERS:
            pairs = [(ids[FA_GROUP][i], stored[FA_GROUP][i]) for i in range(blocks)]
        else:
            g = layer % 4
            pairs = [(ids[g][-1], stored[g][blocks - 1])]
        wrong += [
            f"layer {layer}: block {dst} restored other bytes than stored block {s}"
            for dst, s in pairs
            if not torch.equal(server.kv.block_bytes(layer, dst), src.block_bytes(layer, s))
        ]
    return blocks, wrong


def hit_after_restart(
    real_servers: ServerFactory, l2: Path, b: Setup, prompt: list[int] | None = None
) -> int:
    """Start a server under ``b`` on ``l2`` (an empty L1): the blocks its lookup of
    ``prompt`` hits, nothing restored."""
    kv = build_hybrid_kv(N, b.page, b.layout, NUM_BLOCKS, seed=1, gdn=b.gdn, fa_dtype=b.fa_dtype)
    server = real_servers(kv, b.chunk, l2, **b.server_args)
    return server.lookup("restore", (prompt or tokens())[:-1]) * b.chunk // N


def hit_blocks(real_servers: ServerFactory, tmp_path: Path, a: Setup, b: Setup) -> int:
    """Store under ``a``, restart under ``b`` on the same folder: the blocks its lookup
    hits (0 for a miss). A test of a miss asserts on this, before any restore."""
    l2 = tmp_path / "l2"
    store(real_servers, l2, a)
    return hit_after_restart(real_servers, l2, b)
