"""A hybrid model over LMCache's native disk adapter (fs_native) fails closed.

fs_native publishes objects without a check a load can verify (LMCache#4991: failed
stores stay visible and are served; #4492: corrupted answers after a restart), and this
series' trailer and rename cover the Python ``fs`` adapter only. The patched server
therefore stores nothing for a hybrid layout when fs_native is among its L2 adapters,
and its lookups miss; a dense model keeps pristine behaviour. A whole CPU server
(restore_server) with the real FSNativeL2Adapter, stopped and restarted on one folder.
So too on raw_block and nixl_store_dynamic, whose real configs this environment cannot
run (the server's storage manager lists them), and on fault_inject wrapping fs_native;
the error names the adapter configured. The in-memory mock adapter is not refused.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_cache_interface")
pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_native_l2_adapter")

from hybrid_kv import build_fa_only_kv, build_hybrid_kv  # noqa: E402
from log_recorder import Recorder  # noqa: E402
from restore_server import BASE, BLOCKS, restart_and_restore, store  # noqa: E402

N, PAGE, CHUNKS, NUM_BLOCKS = 80, 16, 3, 32


def store_ids() -> list[list[int]]:
    return [[1 + g * CHUNKS + i for i in range(CHUNKS)] for g in range(4)]


def give_each_object_anothers_bytes(folder: Path) -> int:
    """Each object file gets the bytes of another object of its size, as a store torn by a
    crash or another writer of the folder leaves it: the files changed."""
    by_size: dict[int, list[Path]] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        by_size.setdefault(path.stat().st_size, []).append(path)
    changed = 0
    for paths in by_size.values():
        if len(paths) < 2:
            continue
        contents = [p.read_bytes() for p in paths]
        for path, content in zip(paths, contents[1:] + contents[:1], strict=True):
            path.write_bytes(content)
        changed += len(paths)
    return changed


@pytest.mark.fix
def test_a_hybrid_model_never_restores_an_fs_native_object_replaced_on_disk(real_servers, tmp_path):
    """fs_native loads whatever bytes it finds under a key. On FlashAttention's whole-block
    pages, where pristine restores objects it stored byte-exactly, each object is given
    another's bytes before the restart."""
    native = BASE.but(l2_adapter="fs_native", page=N)
    l2 = tmp_path / "l2"
    src = store(real_servers, l2, native)
    give_each_object_anothers_bytes(l2)
    blocks, wrong = restart_and_restore(real_servers, l2, native, src)
    assert not wrong, f"an fs_native object replaced on disk was restored: {wrong[0]}"
    assert blocks in (0, BLOCKS)


@pytest.mark.feature
def test_a_hybrid_model_over_fs_native_stores_nothing(real_servers, tmp_path):
    kv = build_hybrid_kv(N, PAGE, "NHD", NUM_BLOCKS)
    server = real_servers(kv, N, tmp_path / "l2", False, l2_adapter="fs_native")
    tokens = list(range(1000, 1000 + CHUNKS * N + 1))
    assert not server.store("store", tokens, store_ids())
    assert server.lookup("again", tokens[:-1]) == 0


def test_a_dense_model_over_fs_native_keeps_its_hits(real_servers, tmp_path):
    kv = build_fa_only_kv(16, "NHD", num_blocks=NUM_BLOCKS)
    server = real_servers(kv, 16, tmp_path / "l2", False, l2_adapter="fs_native")
    tokens = list(range(1000, 1000 + CHUNKS * 16 + 1))
    assert server.store("store", tokens, [[1, 2, 3]])
    assert server.lookup("again", tokens[:-1]) == CHUNKS


# The other adapters that load persistent objects unchecked: raw_block (slot header and
# payload written apart) and nixl_store_dynamic (files renamed into place without fsync,
# files found on disk served), and fault_inject judged by the adapter it wraps.


def _refusals(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer

    recorder = Recorder()
    monkeypatch.setattr(lmcache_driven_transfer, "logger", recorder)
    return recorder


@pytest.fixture
def nixl_importable(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """LMCache's nixl adapter modules import NIXL's bindings at the top, which this
    environment lacks: a stand-in module lets the real config classes load, into copies of
    LMCache's adapter registries; both are gone after the test."""
    from lmcache.v1.distributed.l2_adapters import config, factory

    api = types.ModuleType("nixl._api")
    api.__getattr__ = lambda name: type(name, (), {})  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "nixl", types.ModuleType("nixl"))
    monkeypatch.setitem(sys.modules, "nixl._api", api)
    registry = config._L2_ADAPTER_CONFIG_REGISTRY  # noqa: SLF001
    monkeypatch.setattr(config, "_L2_ADAPTER_CONFIG_REGISTRY", dict(registry))
    factories = factory._L2_ADAPTER_FACTORY_REGISTRY  # noqa: SLF001
    monkeypatch.setattr(factory, "_L2_ADAPTER_FACTORY_REGISTRY", dict(factories))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if "nixl" in name:
            del sys.modules[name]


def _raw_block(tmp_path: Path) -> Any:
    from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class

    device = tmp_path / "raw-block-device"
    spec = {"type": "raw_block", "device_path": str(device), "slot_bytes": 1 << 20}
    return get_l2_adapter_config_class("raw_block").from_dict(spec)


def _nixl_store_dynamic(tmp_path: Path) -> Any:
    importlib.import_module("lmcache.v1.distributed.l2_adapters.nixl_store_dynamic_l2_adapter")
    from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class

    params = {"file_path": str(tmp_path), "use_direct_io": "false"}
    spec = {"type": "nixl_store_dynamic", "backend": "POSIX", "backend_params": params}
    return get_l2_adapter_config_class("nixl_store_dynamic").from_dict(spec)


def _listed_as(monkeypatch: pytest.MonkeyPatch, config: Any) -> None:
    """The server's storage manager lists ``config`` for the adapter it runs (fs_native),
    as a server configured with that adapter lists it."""
    import dataclasses

    from lmcache.v1.distributed.storage_manager import StorageManager

    listed = StorageManager.l2_adapters

    def l2_adapters(self: Any) -> list[tuple[Any, Any]]:
        return [(dataclasses.replace(d, config=config), a) for d, a in listed(self)]

    monkeypatch.setattr(StorageManager, "l2_adapters", l2_adapters)


def _hybrid_server(real_servers: Any, tmp_path: Path, l2_adapter: str = "fs_native") -> Any:
    kv = build_hybrid_kv(N, PAGE, "NHD", NUM_BLOCKS)
    return real_servers(kv, N, tmp_path / "l2", False, l2_adapter=l2_adapter)


@pytest.mark.fix
def test_a_hybrid_model_is_refused_on_raw_block(real_servers, tmp_path, monkeypatch):
    _listed_as(monkeypatch, _raw_block(tmp_path))
    recorder = _refusals(monkeypatch)
    _hybrid_server(real_servers, tmp_path)
    refusals = [e for e in recorder.errors if "raw_block" in e]
    assert len(refusals) == 1, recorder.errors
    assert "fs_native" not in refusals[0] and '"type":"fs"' in refusals[0]


@pytest.mark.fix
def test_a_hybrid_model_is_refused_on_nixl_store_dynamic(
    real_servers, tmp_path, monkeypatch, nixl_importable
):
    _listed_as(monkeypatch, _nixl_store_dynamic(tmp_path))
    recorder = _refusals(monkeypatch)
    _hybrid_server(real_servers, tmp_path)
    refusals = [e for e in recorder.errors if "nixl_store_dynamic" in e]
    assert len(refusals) == 1, recorder.errors
    assert "fs_native" not in refusals[0] and '"type":"fs"' in refusals[0]


@pytest.mark.fix
def test_a_refused_hybrid_model_on_raw_block_stores_nothing(real_servers, tmp_path, monkeypatch):
    _listed_as(monkeypatch, _raw_block(tmp_path))
    server = _hybrid_server(real_servers, tmp_path)
    tokens = list(range(1000, 1000 + CHUNKS * N + 1))
    assert not server.store("store", tokens, store_ids())


@pytest.mark.fix
def test_a_hybrid_model_is_refused_on_fault_inject_wrapping_fs_native(
    real_servers, tmp_path, monkeypatch
):
    import restore_server

    from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class

    def fault_inject(l2_dir: Path, *_: Any) -> Any:
        inner = {"type": "fs_native", "base_path": str(l2_dir)}
        spec = {"type": "fault_inject", "rate": 0.0, "inner": inner}
        return get_l2_adapter_config_class("fault_inject").from_dict(spec)

    monkeypatch.setattr(restore_server, "_l2_adapter_config", fault_inject)
    recorder = _refusals(monkeypatch)
    _hybrid_server(real_servers, tmp_path)
    assert [e for e in recorder.errors if "fault_inject(fs_native)" in e], recorder.errors


def test_a_hybrid_model_keeps_its_hits_on_the_in_memory_mock_adapter(
    real_servers, tmp_path, monkeypatch
):
    import restore_server

    from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class

    def mock(*_: Any) -> Any:
        spec = {"type": "mock", "max_size_gb": 0.25, "mock_bandwidth_gb": 100}
        return get_l2_adapter_config_class("mock").from_dict(spec)

    monkeypatch.setattr(restore_server, "_l2_adapter_config", mock)
    recorder = _refusals(monkeypatch)
    server = _hybrid_server(real_servers, tmp_path)
    tokens = list(range(1000, 1000 + CHUNKS * N + 1))
    assert server.store("store", tokens, store_ids())
    assert server.lookup("again", tokens[:-1]) == CHUNKS
    assert recorder.errors == []
