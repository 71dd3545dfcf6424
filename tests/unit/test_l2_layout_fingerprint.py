"""The disk tier after an upgrade from pristine LMCache 0.5.3.

An fs L2 folder written by pristine 0.5.3 holds, for a hybrid model, objects with one
kernel page per full-attention block: the wrong page. The patched server must never
restore them (it keys multi-page layouts in a layout namespace), and damaged object
files must be a miss, never wrong KV and never an exception. Objects of non-hybrid
models, whose layout did not change, keep pristine's keys (files pristine wrote lack the
keyed trailer, so they are a miss until stored again: test_l2_fs_authenticity.py).

Real classes throughout: the connector's group discovery and the server's transfer
module (hybrid_kv.start_server), LMCache's key derivation (ipc_key_to_object_keys) and
the real FSL2Adapter on tmp_path; the host buffers are the only stand-in.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_cache_interface")
pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_l2_adapter")

from fs_l2_driver import arm_env, load, lookup, open_adapter, store  # noqa: E402
from hybrid_kv import build_fa_only_kv, build_hybrid_kv, layout_nbytes, start_server  # noqa: E402

MODEL = "hybrid"  # the model name hybrid_kv.start_server registers
HASHES = [bytes([i]) * 16 for i in range(1, 4)]
PAYLOAD = bytes(range(256)) * 64


def server_keys(hashes: list[bytes]) -> list[Any]:
    """Object keys the MP server derives for a worker-0 store or retrieve."""
    from lmcache.v1.distributed.api import ipc_key_to_object_keys
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

    ipc_key = IPCCacheServerKey.from_token_ids(MODEL, 1, 0, [])
    return ipc_key_to_object_keys(ipc_key, hashes, [0])[0]


def pristine_keys(hashes: list[bytes]) -> list[Any]:
    """Object keys exactly as pristine 0.5.3 names them (worker 0 of 1)."""
    from lmcache.v1.distributed.api import ObjectKey

    rank = ObjectKey.ComputeKVRank(1, 0, 1, 0)
    return [ObjectKey(chunk_hash=h, model_name=MODEL, kv_rank=rank) for h in hashes]


def registered_layouts(server: Any) -> dict[int, Any]:
    return server.ctx.layout_desc_registry.find_group_layout_descs(MODEL, 1)


def one_object_file(base: Path) -> Path:
    (path,) = [p for p in base.iterdir() if p.name.endswith(".data")]
    return path


class _Recorder:
    """Stands in for the fs adapter module's logger; keeps the warnings."""

    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warning(self, msg: str, *args: object) -> None:
        self.warnings.append(msg % args if args else msg)

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


# ---------------------------------------------------------------------------------
# (a) objects written by pristine 0.5.3 for a multi-page layout never hit


@pytest.mark.fix
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_pristine_objects_of_a_hybrid_model_are_a_miss_after_the_upgrade(
    layout, adapter, monkeypatch
):
    n, page = 80, 16
    kv = build_hybrid_kv(n, page, layout)
    # What pristine 0.5.3 stored per chunk: 6 whole GDN pages, 1 kernel page per FA layer.
    pristine_size = 6 * kv.page_bytes + 2 * (kv.page_bytes // kv.ratio)
    # Distinct non-zero bytes: the fake loader zero-fills, so a load would show them.
    store(adapter, pristine_keys(HASHES), [bytes([0x5A]) * pristine_size] * len(HASHES))

    server = start_server(kv, chunk_size=n, monkeypatch=monkeypatch)
    keys = server_keys(HASHES)
    layouts = registered_layouts(server)

    assert lookup(adapter, keys, layouts) == [False] * len(keys), (
        "the L2 lookup finds objects written under pristine 0.5.3's one-page layout"
    )
    hits, bufs = load(adapter, keys, layout_nbytes(layouts[0]))
    assert hits == [False] * len(keys)
    assert all(not any(b.data) for b in bufs), "bytes of a foreign-layout object were loaded"


@pytest.mark.feature
def test_one_warning_per_foreign_layout(adapter, monkeypatch):
    from lmcache.v1.distributed.l2_adapters import fs_l2_adapter

    kv = build_hybrid_kv(80, 16, "HND")
    store(adapter, pristine_keys(HASHES), [PAYLOAD] * len(HASHES))
    server = start_server(kv, chunk_size=80, monkeypatch=monkeypatch)
    recorder = _Recorder()
    monkeypatch.setattr(fs_l2_adapter, "logger", recorder)

    for _ in range(3):
        lookup(adapter, server_keys(HASHES), registered_layouts(server))
    deadline = time.monotonic() + 5.0
    while not recorder.warnings and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # a second warning, if any, would come from the same scan

    foreign = [w for w in recorder.warnings if "another KV layout" in w]
    assert len(foreign) == 1, f"expected one foreign-layout warning, got {recorder.warnings}"
    assert f"{len(HASHES)} objects of model {MODEL}" in foreign[0]


@pytest.mark.feature
def test_purge_command_removes_only_the_stale_objects(tmp_path, monkeypatch):
    base = tmp_path / "l2"
    kv = build_hybrid_kv(80, 16, "HND")
    adp = open_adapter(base)
    try:
        store(adp, pristine_keys(HASHES), [PAYLOAD] * len(HASHES))
        start_server(kv, chunk_size=80, monkeypatch=monkeypatch)
        current = server_keys(HASHES[:1])
        store(adp, current, [PAYLOAD])
    finally:
        adp.close()
    keep = current[0].model_name.rpartition("~hfa-")[2]
    an_hour_ago = time.time() - 3600  # not a layout a live server may be writing
    for path in base.glob("*.data"):
        os.utime(path, (an_hour_ago, an_hour_ago))

    cmd = [sys.executable, "-m", "lmcache.v1.distributed.l2_adapters.fs_layout_purge"]
    # the stale objects here are pristine's, without a layout fingerprint
    args = [str(base), "--model", MODEL, "--keep", keep, "--include-unnamespaced"]
    run = {"capture_output": True, "text": True, "env": arm_env(), "cwd": tmp_path}
    dry = subprocess.run(cmd + args, **run)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert len(list(base.glob("*.data"))) == len(HASHES) + 1, "a dry run removed files"

    real = subprocess.run(cmd + args + ["--delete"], **run)
    assert real.returncode == 0, real.stderr[-2000:]
    (left,) = base.glob("*.data")
    assert "~hfa-" in left.name


# ---------------------------------------------------------------------------------
# (b) damaged object files are a miss, never wrong KV, never an exception


def _damage_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: len(PAYLOAD) // 2])


def _damage_empty(path: Path) -> None:
    path.write_bytes(b"")


def _damage_bitflip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(PAYLOAD) // 3] ^= 0x10
    path.write_bytes(bytes(data))


def _damage_oversize(path: Path) -> None:
    """An object of a larger layout under the same name (e.g. read after a downgrade)."""
    path.write_bytes(PAYLOAD * 2)


def _plain_key() -> Any:
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk_hash=HASHES[0], model_name="dense", kv_rank=0)


@pytest.mark.parametrize("damage", [_damage_truncate, _damage_empty], ids=["truncated", "empty"])
def test_short_object_file_is_a_miss(damage, adapter, tmp_path):
    key = _plain_key()
    store(adapter, [key], [PAYLOAD])
    damage(one_object_file(tmp_path / "l2"))
    hits, _ = load(adapter, [key], len(PAYLOAD))
    assert hits == [False]


@pytest.mark.fix
@pytest.mark.parametrize(
    "damage", [_damage_bitflip, _damage_oversize], ids=["bit-flipped", "oversized"]
)
def test_corrupted_object_file_is_a_miss(damage, adapter, tmp_path):
    key = _plain_key()
    store(adapter, [key], [PAYLOAD])
    damage(one_object_file(tmp_path / "l2"))
    hits, _ = load(adapter, [key], len(PAYLOAD))
    assert hits == [False], "a damaged object file was loaded as a hit"


@pytest.mark.fix
def test_damaged_object_is_rewritten_by_the_next_store(adapter, tmp_path):
    key = _plain_key()
    store(adapter, [key], [PAYLOAD])
    _damage_truncate(one_object_file(tmp_path / "l2"))
    load(adapter, [key], len(PAYLOAD))  # the miss
    store(adapter, [key], [PAYLOAD])
    hits, bufs = load(adapter, [key], len(PAYLOAD))
    assert hits == [True], "a damaged file stays in place and blocks every later store"
    assert bytes(bufs[0].data) == PAYLOAD


def test_intact_object_round_trips(adapter):
    key = _plain_key()
    store(adapter, [key], [PAYLOAD])
    hits, bufs = load(adapter, [key], len(PAYLOAD))
    assert hits == [True]
    assert bytes(bufs[0].data) == PAYLOAD


# ---------------------------------------------------------------------------------
# (c) non-hybrid models: the layout is pristine's, and so are their object keys


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_pristine_objects_of_a_non_hybrid_model_keep_hitting(layout, adapter, monkeypatch):
    kv = build_fa_only_kv(16, layout)
    server = start_server(kv, chunk_size=16, monkeypatch=monkeypatch)
    layouts = registered_layouts(server)
    size = layout_nbytes(layouts[0])
    payloads = [bytes([i + 1]) * size for i in range(len(HASHES))]
    store(adapter, pristine_keys(HASHES), payloads)

    keys = server_keys(HASHES)
    assert keys == pristine_keys(HASHES)
    assert lookup(adapter, keys, layouts) == [True] * len(keys)
    hits, bufs = load(adapter, keys, size)
    assert hits == [True] * len(keys)
    assert [bytes(b.data) for b in bufs] == payloads


# ---------------------------------------------------------------------------------
# (d) a namespaced object is written only with its trailer, and only when complete


def _namespaced_key() -> Any:
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk_hash=HASHES[0], model_name=f"{MODEL}~hfa-0123456789abcdef", kv_rank=0)


@pytest.mark.fix
def test_a_namespaced_object_without_its_trailer_is_a_miss(adapter, tmp_path):
    key = _namespaced_key()
    store(adapter, [key], [PAYLOAD])
    path = one_object_file(tmp_path / "l2")
    path.write_bytes(path.read_bytes()[: len(PAYLOAD)])  # the payload alone, no trailer
    hits, _ = load(adapter, [key], len(PAYLOAD))
    assert hits == [False], "a namespaced object without its trailer was loaded"


@pytest.mark.fix
def test_an_object_is_on_disk_before_its_name_appears(adapter, tmp_path, monkeypatch):
    import os

    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        events.append(("rename", os.path.realpath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    store(adapter, [_plain_key()], [PAYLOAD])
    base = (tmp_path / "l2").resolve()
    final = str(one_object_file(base))
    assert events[:1] == [("fsync", final[: -len(".data")] + ".tmp")], (
        f"the object was not synced under its temporary name first: {events}"
    )
    assert events[1:] == [("rename", final), ("fsync", str(base))], (
        f"the rename was not followed by a sync of the folder: {events}"
    )
