"""lmcache 0.5.6: one real server context (MPCacheServerContext with a real L2 adapter),
its real transfer and lookup modules, and a 3:1 GDN:FA hybrid registered through vLLM's own
allocation and LMCache's connector edits (vllm_kv_alloc)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fs_l2_driver import Buf, wait_for
from vllm_kv_alloc import _Wrapper, build_registration, connector_view

MODEL = "org/hybrid"
TOKENS_PER_BLOCK = 16
CHUNK = 16
NUM_CHUNKS = 4
TOKENS = tuple(range(1, CHUNK * NUM_CHUNKS + 1))


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
        from lmcache.utils import EngineType

        reg = build_registration(TOKENS_PER_BLOCK, TOKENS_PER_BLOCK, "LBNHC")
        edited, infos, hints = connector_view(reg)
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
        return wait_for(lambda: self.lookups.query_prefetch_status(request_id), "the lookup", 10)

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
