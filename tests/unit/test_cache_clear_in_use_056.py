"""lmcache 0.5.6: a cache clear never frees memory that a load still writes.

Pristine 0.5.6's ``POST /cache/clear`` with ``force=true`` frees every L1 object and
every live staging object: an L2 load still writing its staging buffers goes on writing
into memory the next allocation hands to other objects. Here the clear keeps the objects
in use, whatever ``force`` says, and counts them.

One real server context (mp_server_056: the real prefetch and store controllers, the fs
adapter) and its HTTP engine (MPCacheServer with the ManagementModule); the load is held
until the clear and the next allocation are done.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.bases("0.5.6")

pytest.importorskip("vllm.v1.kv_cache_interface")

from fs_l2_driver import HeldLoads  # noqa: E402
from mp_server_056 import MODEL, Server  # noqa: E402

TIMEOUT_S = 10.0


class Loading:
    """A server whose lookup is loading its objects from L2, each read held until
    ``finish()``."""

    def __init__(self, base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.server = Server(base, f'{{"type":"fs","base_path":"{base}"}}')
        self.server.register(hybrid=True)
        self.server.seed_l2(fill=0xA5)
        self.held = HeldLoads(monkeypatch)
        self.lookup = threading.Thread(target=self.server.hit_chunks, args=("loaded",))
        self.lookup.start()
        assert self.held.started.wait(TIMEOUT_S), "no load started"

    def finish(self) -> None:
        self.held.release()
        self.lookup.join(TIMEOUT_S)


@pytest.fixture
def loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Loading]:
    state = Loading(tmp_path / "l2", monkeypatch)
    try:
        yield state
    finally:
        state.finish()
        state.server.close()


def http_clear(server: Server) -> Any:
    """What ``POST /cache/clear`` with ``force=true`` runs: the server's clear."""
    from lmcache.v1.multiprocess.modules.management import ManagementModule
    from lmcache.v1.multiprocess.server import MPCacheServer

    return MPCacheServer(server.ctx, [ManagementModule(server.ctx)]).clear(force=True)


def raw(obj: Any) -> torch.Tensor:
    """An L1 object's bytes, as a uint8 tensor over its memory."""
    return obj.raw_data[: obj.get_size()].view(torch.uint8)


def other_objects(server: Server, fill: int) -> list[Any]:
    """Objects of another model, each of every object group's layout, written with
    ``fill`` and admitted to L1: what the next allocations hold."""
    from lmcache.v1.distributed.api import ObjectKey

    manager = server.ctx.storage_manager
    objects = []
    descs = server.ctx.layout_desc_registry.find_group_layout_descs(MODEL, 1)
    for gid, desc in sorted(descs.items()):
        keys = [
            ObjectKey(chunk_hash=bytes([gid, i]) * 16, model_name="other", kv_rank=0)
            for i in range(8)
        ]
        reserved = manager.reserve_write(keys, desc)
        for obj in reserved.values():
            raw(obj).fill_(fill)
        manager.finish_write(list(reserved))
        objects += list(reserved.values())
    return objects


@pytest.mark.fix
def test_a_forced_clear_during_a_load_leaves_the_next_objects_alone(loading):
    http_clear(loading.server)
    objects = other_objects(loading.server, fill=0x3C)
    assert objects, "nothing was allocated after the clear"
    loading.finish()
    intact = [bool((raw(o) == 0x3C).all()) for o in objects]
    assert all(intact), f"a load wrote into {intact.count(False)} other objects"


@pytest.mark.feature
def test_a_clear_keeps_and_counts_the_objects_a_load_is_writing(loading):
    assert http_clear(loading.server) > 0
