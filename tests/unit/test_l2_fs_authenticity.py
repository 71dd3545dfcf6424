"""Whoever can write the fs L2 folder cannot change what a server restores.

Each object file ends with a tag keyed by the L2 tier's secret (a file only the server's
user can read). Revision 14's trailer was an unkeyed blake3 digest of the payload and the
file name: anyone who can write the folder can compute it for a payload of their own, and
pristine 0.5.3 checks nothing at all. A file whose tag does not verify is a miss, is
logged, and stays on disk until this server stores its key again: a server holding
another secret must not remove the objects of the servers it disagrees with.

Real FSL2Adapter on tmp_path; the host buffers are LMCache's TensorMemoryObj.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.bases("0.5.3", "0.5.6")

pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_l2_adapter")

from fs_l2_driver import load, open_adapter, store  # noqa: E402
from log_recorder import Recorder  # noqa: E402

PAYLOAD = random.Random(1).randbytes(64 << 10)
FORGED = random.Random(2).randbytes(64 << 10)


def key(model: str = "dense") -> Any:
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk_hash=b"\x01" * 16, model_name=model, kv_rank=0)


# A hybrid model's objects live under a layout namespace; a plain model's do not.
MODELS = {"plain": "dense", "namespaced": "hybrid~hfa-0123456789abcdef"}


def object_file(base: Path) -> Path:
    (path,) = base.glob("*.data")
    return path


def unkeyed_trailer(payload: bytes, name: str) -> bytes:
    """Revision 14's unkeyed trailer, as anyone who can write the folder computes it."""
    import blake3

    return b"LMCHFA1\x00" + blake3.blake3(payload + name.encode()).digest()


@pytest.mark.fix
@pytest.mark.parametrize("model", MODELS.values(), ids=MODELS)
def test_a_payload_replaced_with_a_recomputed_unkeyed_trailer_is_a_miss(model, adapter, tmp_path):
    store(adapter, [key(model)], [PAYLOAD])
    path = object_file(tmp_path / "l2")
    path.write_bytes(FORGED + unkeyed_trailer(FORGED, path.name))
    hits, bufs = load(adapter, [key(model)], len(PAYLOAD))
    assert hits == [False], "a forged object with a recomputed trailer was restored"


@pytest.mark.fix
@pytest.mark.parametrize("model", MODELS.values(), ids=MODELS)
def test_a_payload_replaced_without_a_trailer_is_a_miss(model, adapter, tmp_path):
    store(adapter, [key(model)], [PAYLOAD])
    object_file(tmp_path / "l2").write_bytes(FORGED)  # what pristine 0.5.3 writes
    hits, _ = load(adapter, [key(model)], len(PAYLOAD))
    assert hits == [False], "a forged object without a trailer was restored"


@pytest.mark.fix
def test_an_object_written_under_another_secret_is_a_miss_and_logged(tmp_path, monkeypatch):
    from lmcache.v1.distributed.l2_adapters import fs_l2_adapter

    base = tmp_path / "l2"
    other = open_adapter(base, secret_file=str(tmp_path / "other.key"))
    try:
        store(other, [key()], [FORGED])
    finally:
        other.close()
    recorder = Recorder()
    monkeypatch.setattr(fs_l2_adapter, "logger", recorder)
    ours = open_adapter(base, secret_file=str(tmp_path / "ours.key"))
    try:
        hits, _ = load(ours, [key()], len(PAYLOAD))
    finally:
        ours.close()
    assert hits == [False], "an object written under another secret was restored"
    name = object_file(base).name
    assert any(name in w and "another secret" in w for w in recorder.warnings), recorder.warnings


@pytest.mark.fix
def test_a_forged_object_stays_on_disk_and_the_next_store_replaces_it(adapter, tmp_path):
    store(adapter, [key()], [PAYLOAD])
    path = object_file(tmp_path / "l2")
    forged = FORGED + unkeyed_trailer(FORGED, path.name)
    path.write_bytes(forged)
    load(adapter, [key()], len(PAYLOAD))  # the miss
    assert path.read_bytes() == forged, "a load removed a file that failed its check"
    store(adapter, [key()], [PAYLOAD])
    hits, bufs = load(adapter, [key()], len(PAYLOAD))
    assert hits == [True]
    assert bufs[0].data == PAYLOAD, "the store after a rejected file did not replace it"


def test_servers_with_one_secret_file_restore_each_others_objects(tmp_path):
    base, secret = tmp_path / "l2", str(tmp_path / "shared.key")
    first = open_adapter(base, secret_file=secret)
    try:
        store(first, [key()], [PAYLOAD])
    finally:
        first.close()
    second = open_adapter(base, secret_file=secret)
    try:
        hits, bufs = load(second, [key()], len(PAYLOAD))
    finally:
        second.close()
    assert hits == [True]
    assert bufs[0].data == PAYLOAD
