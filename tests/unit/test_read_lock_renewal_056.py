"""A prefetched hit stays read-locked until its retrieve, on the lmcache 0.5.6 base.

A lookup read-locks the chunks it found so that L1 cannot evict them before the retrieve.
The locks expire after the L1 read TTL (``--l1-read-ttl-seconds``, 300 s) whatever the
request does; a request that waits longer for its KV blocks finds its chunks evictable,
and its retrieve fails ("Some keys not found during retrieve", or KEY_NOT_READABLE for a
key still in L1 whose lock expired): a load error.

LMCache's server context (real StorageManager with a CPU L1 and a 2 s read TTL), its
LookupModule, and the transfer module's registration of a 3:1 GDN:FA hybrid allocated by
vLLM's own code; the stored objects are written through the storage manager.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

from test_layout_fingerprint_056 import MODEL  # noqa: E402
from vllm_kv_alloc import _Wrapper, build_registration, connector_view  # noqa: E402

pytestmark = pytest.mark.bases("0.5.6")

CHUNK = 16
TTL_S = 2
PAST_TTL_S = 2.5 * TTL_S + 0.5
REQUEST = "req-0"
TOKENS = tuple(range(3 * CHUNK))


class Server:
    """The server's context, transfer module (for the registration) and lookup module."""

    def __init__(self) -> None:
        from lmcache.utils import EngineType
        from lmcache.v1.distributed.config import parse_args
        from lmcache.v1.multiprocess.engine_context import MPCacheServerContext
        from lmcache.v1.multiprocess.modules.lmcache_driven_transfer import (
            LMCacheDrivenTransferModule,
        )
        from lmcache.v1.multiprocess.modules.lookup import LookupModule

        config = parse_args(
            ["--l1-size-gb", "0.05", "--eviction-policy", "LRU"]
            + ["--l1-read-ttl-seconds", str(TTL_S)]
        )
        self.ctx = MPCacheServerContext(config, chunk_size=CHUNK)
        self.transfer = LMCacheDrivenTransferModule(self.ctx)
        edited, infos, hints = connector_view(build_registration(16, 16, "LBNHC"))
        self.transfer.register_kv_cache(
            1, [_Wrapper(t) for t in edited.values()], MODEL, 1, EngineType.VLLM, hints, infos
        )
        self.lookup_module = LookupModule(self.ctx)

    def close(self) -> None:
        self.lookup_module.close()
        self.transfer.close()
        self.ctx.close()

    def ipc_key(self, worker_id: int | None = None) -> Any:
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        return IPCCacheServerKey(
            MODEL, 1, worker_id, TOKENS, 0, len(TOKENS), REQUEST, num_kv_readers=1
        )

    def object_keys(self) -> list[Any]:
        """Every object key of the prompt's chunks, all object groups."""
        from lmcache.v1.distributed.api import ipc_key_to_object_keys

        registry = self.ctx.layout_desc_registry
        groups = registry.find_attn_desc(MODEL, 1).num_object_groups
        hashes = self.ctx.token_hasher.compute_chunk_hashes(list(TOKENS), end=len(TOKENS))
        per_group = ipc_key_to_object_keys(self.ipc_key(), hashes, list(range(groups)))
        return [k for keys in per_group for k in keys]

    def store(self) -> None:
        """The prompt's objects written into L1, as a store leaves them."""
        from lmcache.v1.distributed.api import ipc_key_to_object_keys

        registry = self.ctx.layout_desc_registry
        descs = registry.find_group_layout_descs(MODEL, 1)
        hashes = self.ctx.token_hasher.compute_chunk_hashes(list(TOKENS), end=len(TOKENS))
        storage = self.ctx.storage_manager
        for group, keys in enumerate(ipc_key_to_object_keys(self.ipc_key(), hashes, list(descs))):
            assert len(storage.reserve_write(keys, descs[group])) == len(keys)
            storage.finish_write(keys)

    def lookup(self) -> int:
        self.lookup_module.lookup(self.ipc_key(), 1)
        hit = self.lookup_module.wait_prefetch_status(REQUEST, 10.0)
        assert hit is not None
        return hit

    def read_locked(self, keys: list[Any]) -> list[bool]:
        objects = self.ctx.storage_manager._l1_manager._objects  # noqa: SLF001
        return [k in objects and objects[k].read_lock.is_locked() for k in keys]

    def retrieve_reads(self, keys: list[Any]) -> bool:
        """Read ``keys`` as the transfer module's retrieve does (unsafe_read under the
        lookup's locks, then one lock released per key); True if every key was read."""
        storage = self.ctx.storage_manager
        owners = self.ctx.get_read_owners(REQUEST)
        completion = storage.prepare_read_completion(keys, owners)
        try:
            found, _ = storage.unsafe_read(keys, l1_owners=owners)
        finally:
            storage.finish_read_by_owner(completion)
        return found == keys


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


def _looked_up(server: Server) -> list[Any]:
    """A stored prompt, then a lookup of it; returns the keys the lookup locked (a
    recurrent object group's in-window chunk only, where it has a group of its own)."""
    server.store()
    assert server.lookup() == len(TOKENS) // CHUNK
    keys = server.object_keys()
    locked = [k for k, held in zip(keys, server.read_locked(keys), strict=True) if held]
    assert locked, "the lookup locked nothing"
    return locked


@pytest.mark.fix
def test_a_prefetched_hit_stays_locked_past_the_read_ttl(server: Server) -> None:
    keys = _looked_up(server)
    time.sleep(PAST_TTL_S)  # the request waits for KV blocks longer than the TTL
    assert all(server.read_locked(keys)), "the hit became evictable before its retrieve"
    assert server.retrieve_reads(keys)
    assert not any(server.read_locked(keys)), "the retrieve left locks behind"


@pytest.mark.fix
def test_a_retrieve_whose_locks_expired_reads_what_l1_still_holds(server: Server) -> None:
    keys = _looked_up(server)
    objects = server.ctx.storage_manager._l1_manager._objects  # noqa: SLF001
    for key in keys:
        objects[key].read_lock.reset()  # as a lock whose TTL ran out
    assert server.retrieve_reads(keys), "a retrieve failed on chunks still in L1"
    assert not any(server.read_locked(keys)), "the retrieve left locks behind"


def test_a_retrieve_of_an_evicted_chunk_still_fails(server: Server) -> None:
    keys = _looked_up(server)
    objects = server.ctx.storage_manager._l1_manager._objects  # noqa: SLF001
    objects[keys[0]].read_lock.reset()
    server.ctx.storage_manager.delete_l1_keys([keys[0]])
    assert keys[0] not in objects
    assert not server.retrieve_reads(keys)


@pytest.mark.feature
def test_a_finished_request_s_locks_are_no_longer_renewed(server: Server) -> None:
    keys = _looked_up(server)
    server.lookup_module.end_session(REQUEST)  # e.g. aborted before its retrieve
    time.sleep(PAST_TTL_S)
    assert not any(server.read_locked(keys)), "an ended request's locks never expire"
