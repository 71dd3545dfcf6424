"""A cache clear (``POST /cache/clear``) or a forced delete (``DELETE /cache/objects``)
never frees memory that a load, a store or a read still uses.

Pristine 0.5.3's HTTP clear force-frees every L1 object, write-locked ones included: an
L2 load still writing its buffers goes on writing into memory the next allocation hands
to another prompt's objects, which then hold the loaded prompt's bytes (a restore of
them restores the wrong prompt). Here the clear keeps the objects in use and counts them.

A whole server on CPU (restore_server: the real prefetch and store controllers, the fs
adapter), its HTTP engine (MPCacheServer with the ManagementModule); the load is held
until the clear and another prompt's store are done.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.bases("0.5.3")

pytest.importorskip("vllm.v1.kv_cache_interface")

from fs_l2_driver import HeldLoads  # noqa: E402
from hybrid_kv import build_hybrid_kv  # noqa: E402
from restore_server import BASE, BLOCKS, NUM_BLOCKS, N, store, store_ids, tokens  # noqa: E402

TIMEOUT_S = 10.0


@dataclass
class Loading:
    server: Any  # its lookup of the stored prompt is loading it from L2, held
    held: HeldLoads
    lookup: threading.Thread

    def finish(self) -> None:
        self.held.release()
        self.lookup.join(TIMEOUT_S)
        assert not self.lookup.is_alive(), "the held lookup did not end"


@pytest.fixture
def loading(real_servers: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    l2 = tmp_path / "l2"
    store(real_servers, l2, BASE)
    held = HeldLoads(monkeypatch)
    kv = build_hybrid_kv(N, BASE.page, BASE.layout, NUM_BLOCKS, seed=3)
    server = real_servers(kv, BASE.chunk, l2, **BASE.server_args)
    lookup = threading.Thread(target=server.lookup, args=("loaded", tokens()[:-1]))
    lookup.start()
    assert held.started.wait(TIMEOUT_S), "no load started"
    state = Loading(server, held, lookup)
    try:
        yield state
    finally:
        held.release()
        lookup.join(TIMEOUT_S)


def http_clear(server: Any) -> Any:
    """What ``POST /cache/clear`` runs: the server's clear."""
    from lmcache.v1.multiprocess.modules.management import ManagementModule
    from lmcache.v1.multiprocess.server import MPCacheServer

    return MPCacheServer(server.ctx, [ManagementModule(server.ctx)]).clear()


def l1_bytes(server: Any, keys: list[Any]) -> list[bytes]:
    objects = server.ctx.storage_manager._l1_manager._objects  # noqa: SLF001
    return [bytes(objects[k].memory_obj.byte_array) for k in keys]


@pytest.mark.fix
def test_a_clear_during_a_load_leaves_the_next_prompt_s_objects_alone(loading):
    server = loading.server
    http_clear(server)
    other = tokens(50_000)
    assert server.store("other", other, store_ids())
    keys = [k for group in server.object_keys(other, BLOCKS * N // BASE.chunk) for k in group]
    before = l1_bytes(server, keys)
    loading.finish()
    assert l1_bytes(server, keys) == before, "a load wrote into another prompt's objects"


@pytest.mark.feature
def test_a_clear_keeps_and_counts_the_objects_a_load_is_writing(loading):
    assert http_clear(loading.server) > 0


@pytest.mark.fix
def test_a_forced_delete_skips_an_object_a_load_is_writing(loading):
    manager = loading.server.ctx.storage_manager
    objects = manager._l1_manager._objects  # noqa: SLF001
    writing = [k for k, e in objects.items() if e.write_lock.is_locked()]
    assert writing, "no object is being loaded"
    deleted, skipped = manager.delete_l1_keys(writing, force=True)
    assert (deleted, skipped) == (0, len(writing)), "a forced delete freed a loading buffer"
