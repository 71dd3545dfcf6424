"""A load from L2 that fails leaves nothing behind: its buffer is never published.

The prefetch controller loads an object into a write-locked L1 buffer and the adapter
checks its tag. For a key whose load failed (a forged object, one gone since its lookup)
pristine 0.5.3 calls ``finish_write`` and then ``delete``: ``finish_write`` makes the
buffer readable and tells the store controller, which stores the buffer back to the tier
(the forged bytes, or stale memory for a vanished key) sealed with a valid tag, and every
later server restores it. Here a failed load is discarded unread: nothing is stored during
a lookup, the tier keeps what it had, and a restarted server still misses.

Real MP servers on CPU (restore_server: the real prefetch and store controllers, the fs or
resp adapter). The store controller is made to win its race with ``delete`` (``delete``
waits until it has stored the key), as it often does on a loaded machine.

What counts on pristine: the store submitted during the lookup (or, where its fs and resp
adapters check no tag at all, the forged object restored).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.bases("0.5.3"), pytest.mark.fix]

pytest.importorskip("vllm.v1.kv_cache_interface")

from restore_server import BASE, N, hit_after_restart, store, tokens  # noqa: E402

STORE_FIRST_S = 2.0


class StoresDuringLookup:
    """Records the keys submitted to an L2 adapter for storing once ``watch()`` is
    called; until then, and while watching, L1's ``delete`` first waits (at most
    STORE_FIRST_S) for the store controller to have stored the keys it deletes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, adapter_cls: Any) -> None:
        from lmcache.v1.distributed.l1_manager import L1Manager

        self.watching = False
        self.keys: list[Any] = []
        submit, delete = adapter_cls.submit_store_task, L1Manager.delete

        def recording_submit(adapter: Any, keys: list[Any], objects: list[Any]) -> Any:
            if self.watching:
                self.keys.extend(keys)
            return submit(adapter, keys, objects)

        def delete_after_the_store(manager: Any, keys: list[Any], *args: Any, **kw: Any) -> Any:
            deadline = time.monotonic() + STORE_FIRST_S
            while self.watching and time.monotonic() < deadline:
                if set(keys) <= set(self.keys):
                    break
                time.sleep(0.01)
            return delete(manager, keys, *args, **kw)

        monkeypatch.setattr(adapter_cls, "submit_store_task", recording_submit)
        monkeypatch.setattr(L1Manager, "delete", delete_after_the_store)

    def watch(self) -> None:
        self.watching = True


def lookup_then_settle(real_servers: Any, l2: Path, setup: Any) -> int:
    """A server on the tier looks the prompt up (a prefetch from L2) and stops after its
    store controller has had time to store anything it was handed: the hit, in chunks."""
    from hybrid_kv import build_hybrid_kv
    from restore_server import NUM_BLOCKS

    kv = build_hybrid_kv(N, setup.page, setup.layout, NUM_BLOCKS, seed=2)
    server = real_servers(kv, setup.chunk, l2, **setup.server_args)
    hit = server.lookup("lookup", tokens()[:-1])
    time.sleep(STORE_FIRST_S + 0.5)
    server.close()
    return hit


def fs_adapter_class() -> Any:
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2Adapter

    return FSL2Adapter


def test_a_forged_fs_object_is_not_stored_back_and_misses_after_a_restart(
    real_servers, tmp_path, monkeypatch
):
    stores = StoresDuringLookup(monkeypatch, fs_adapter_class())
    l2 = tmp_path / "l2"
    store(real_servers, l2, BASE)
    # Every object of the prompt: a restore reads only the last hit chunk's recurrent state.
    forged = {path: random.Random(path.name).randbytes(path.stat().st_size) for path in
              l2.glob("*.data")}  # fmt: skip
    for path, payload in forged.items():
        path.write_bytes(payload)  # the trailer is replaced too
    stores.watch()
    hit = lookup_then_settle(real_servers, l2, BASE)
    assert stores.keys == [], f"a lookup stored {len(stores.keys)} objects back to the tier"
    assert all(p.read_bytes() == b for p, b in forged.items()), "a forged object was rewritten"
    assert hit == 0, "a forged object was restored"
    assert hit_after_restart(real_servers, l2, BASE) == 0


def test_an_fs_object_gone_before_its_load_leaves_no_object_behind(
    real_servers, tmp_path, monkeypatch
):
    adapter_cls = fs_adapter_class()
    stores = StoresDuringLookup(monkeypatch, adapter_cls)
    l2 = tmp_path / "l2"
    store(real_servers, l2, BASE)
    load = adapter_cls.submit_load_task

    def vanish_first(adapter: Any, keys: list[Any], objects: list[Any]) -> Any:
        for path in l2.glob("*.data"):  # purged, evicted, or deleted by another server
            path.unlink()
        return load(adapter, keys, objects)

    monkeypatch.setattr(adapter_cls, "submit_load_task", vanish_first)
    stores.watch()
    hit = lookup_then_settle(real_servers, l2, BASE)
    assert stores.keys == [], f"a lookup stored {len(stores.keys)} unloaded buffers"
    assert not list(l2.glob("*.data")), "an unwritten buffer was stored under a vanished key"
    assert hit == 0
    monkeypatch.setattr(adapter_cls, "submit_load_task", load)
    assert hit_after_restart(real_servers, l2, BASE) == 0


def test_a_forged_resp_value_is_not_stored_back_and_misses_after_a_restart(
    real_servers, redis, tmp_path, monkeypatch
):
    from hybridfa_gate.l2 import RespClient
    from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
        NativeConnectorL2Adapter,
    )

    real_servers.resp_port = redis.port
    stores = StoresDuringLookup(monkeypatch, NativeConnectorL2Adapter)
    setup = BASE.but(l2_adapter="resp")
    l2 = tmp_path / "l2"
    store(real_servers, l2, setup)
    forged = {}
    with RespClient(redis.port) as client:
        for name in client.command("KEYS", "*"):
            forged[name] = random.Random(name).randbytes(len(client.command("GET", name)))
            client.command("SET", name, forged[name])
    stores.watch()
    hit = lookup_then_settle(real_servers, l2, setup)
    assert stores.keys == [], f"a lookup stored {len(stores.keys)} objects back to Redis"
    with RespClient(redis.port) as client:
        kept = all(client.command("GET", n) == v for n, v in forged.items())
    assert kept, "a forged value was rewritten"
    assert hit == 0, "a forged value was restored"
    assert hit_after_restart(real_servers, l2, setup) == 0
