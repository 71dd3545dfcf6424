"""A prefetched hit stays read-locked until its retrieve.

A lookup read-locks the chunks it found, so L1 cannot evict them before the retrieve. In
0.5.3 the locks expire after the L1 read TTL (``--l1-read-ttl-seconds``, 300 s) whatever
the request does; a request that waits longer for its KV blocks finds its chunks
evictable, and its retrieve fails: a load error, which vLLM 0.26-0.28 cannot recover for
a hybrid model and stops the engine (vllm#50687).

A whole LMCache server on CPU (restore_server: real StorageManager, LookupModule and
transfer module) with a read TTL of 4 s.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hybrid_kv import FA_LAYERS, build_hybrid_kv
from restore_server import (
    BLOCKS,
    FA_GROUP,
    NUM_BLOCKS,
    PAGE,
    N,
    RealServer,
    ServerFactory,
    restore_ids,
    store_ids,
    tokens,
)

TTL_S = 4
PAST_TTL_S = 2.5 * TTL_S + 0.5


def _looked_up(real_servers: ServerFactory, tmp_path: Path) -> tuple[Any, RealServer, int]:
    """A stored prompt, then a lookup of it; returns the source kv, the server, the hit."""
    kv = build_hybrid_kv(N, PAGE, "NHD", NUM_BLOCKS, seed=0)
    server = real_servers(kv, N, tmp_path / "l2", separate=False, read_ttl_seconds=TTL_S)
    assert server.store("store", tokens(), store_ids())
    # The L2 writes read-lock what they copy: let them finish first.
    server.wait_l2_objects(BLOCKS * server.num_object_groups)
    hit = server.lookup("restore", tokens()[:-1])
    assert hit > 0
    return kv, server, hit


def _locked_keys(server: RealServer, hit: int) -> list[Any]:
    keys = [k for group in server.object_keys(tokens(), hit) for k in group]
    locked = [k for k, held in zip(keys, server.read_locked(keys), strict=True) if held]
    assert locked, "the lookup locked nothing"
    return locked


def _restores_fa_bytes(kv: Any, server: RealServer, hit: int) -> bool:
    ids = restore_ids(hit)
    if not server.retrieve("restore", tokens(), 0, hit * N, ids):
        return False
    pairs = zip(ids[FA_GROUP][:hit], store_ids()[FA_GROUP][:hit], strict=True)
    return all(
        torch.equal(kv.block_bytes(layer, dst), kv.block_bytes(layer, src))
        for dst, src in pairs
        for layer in FA_LAYERS
    )


@pytest.mark.fix
def test_a_prefetched_hit_stays_locked_past_the_read_ttl(
    real_servers: ServerFactory, tmp_path: Path
) -> None:
    kv, server, hit = _looked_up(real_servers, tmp_path)
    locked = _locked_keys(server, hit)
    time.sleep(PAST_TTL_S)  # the request waits for KV blocks longer than the TTL
    assert all(server.read_locked(locked)), "the hit became evictable before its retrieve"
    assert _restores_fa_bytes(kv, server, hit)


@pytest.mark.fix
def test_a_retrieve_whose_locks_expired_reads_what_l1_still_holds(
    real_servers: ServerFactory, tmp_path: Path
) -> None:
    kv, server, hit = _looked_up(real_servers, tmp_path)
    objects = server.ctx.storage_manager._l1_manager._objects  # noqa: SLF001
    for key in _locked_keys(server, hit):
        objects[key].read_lock.reset()  # as a lock whose TTL ran out
    assert _restores_fa_bytes(kv, server, hit), "a retrieve failed on chunks still in L1"
    assert not any(server.read_locked(list(objects))), "the retrieve left locks behind"


@pytest.mark.feature
def test_a_finished_request_s_locks_are_no_longer_renewed(
    real_servers: ServerFactory, tmp_path: Path
) -> None:
    _, server, hit = _looked_up(real_servers, tmp_path)
    locked = _locked_keys(server, hit)
    server.lookup_module.end_session("restore")  # e.g. aborted before its retrieve
    time.sleep(PAST_TTL_S)
    assert not any(server.read_locked(locked)), "an ended request's locks never expire"
