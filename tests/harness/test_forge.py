"""The forged-object step of the gate's forged cases (hybridfa_gate.forge), on fs tier folders
laid out as the patched and the pristine servers write them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hybridfa_gate import forge

pytest.importorskip("blake3")

FA, GDN = 4096, 6144  # payload bytes of a chunk's FA and GDN objects


def _name(chunk: int, group: int) -> str:
    return f"m~hfa-ab@0x01000000@{group:x}@{chunk:04x}.data"


def _write(root: Path, name: str, payload: bytes, trailer: bool, mtime: int) -> None:
    path = root / name
    path.write_bytes(payload + (forge.unkeyed_trailer(payload, name) if trailer else b""))
    os.utime(path, ns=(mtime, mtime))


def _patched_tier(root: Path, prompt_chunks: int, other_chunks: int) -> dict[str, list[int]]:
    """A store of the measured prompt (snapshotted), then of another prompt: each chunk an FA
    object (group 1) and a GDN object (group 0), each with its trailer."""
    root.mkdir(parents=True, exist_ok=True)
    for c in range(prompt_chunks):
        _write(root, _name(c, 1), bytes([c + 1]) * FA, True, 10**9 * (c + 1))
        _write(root, _name(c, 0), bytes([c + 101]) * GDN, True, 10**9 * (c + 1) + 1)
    snap = forge.snapshot(root)
    for c in range(100, 100 + other_chunks):
        _write(root, _name(c, 1), bytes([c]) * FA, True, 10**12 + c)
    return snap


def test_the_snapshot_lists_object_files_with_size_and_write_time(tmp_path: Path) -> None:
    snap = _patched_tier(tmp_path, 4, 0)
    (tmp_path / "x.tmp").write_bytes(b"partial")
    assert len(snap) == 8
    assert snap[_name(2, 1)] == [FA + forge.TRAILER_LEN, 3 * 10**9]


def test_the_middle_fa_object_by_write_time_is_forged_with_another_prompts_kv(
    tmp_path: Path,
) -> None:
    snap = _patched_tier(tmp_path, 4, 2)
    before = (tmp_path / _name(2, 1)).read_bytes()
    got = forge.forge(tmp_path, snap, FA)
    assert {k: v for k, v in got.items() if k != "payload_blake2b"} == {
        "file": _name(2, 1),
        "rank": 2,
        "of": 4,
        "payload_bytes": FA,
        "trailer": "unkeyed (revision 14)",
        "payload_from": _name(100, 1),
    }
    after = (tmp_path / _name(2, 1)).read_bytes()
    assert len(after) == len(before) and after != before
    payload = bytes([100]) * FA
    assert after == payload + forge.unkeyed_trailer(payload, _name(2, 1))
    assert (tmp_path / _name(2, 0)).read_bytes()[:GDN] == bytes([103]) * GDN  # untouched


def test_without_another_object_the_payload_is_inverted(tmp_path: Path) -> None:
    snap = _patched_tier(tmp_path, 4, 0)
    got = forge.forge(tmp_path, snap, FA)
    assert got["payload_from"] == "inverted"
    assert (tmp_path / _name(2, 1)).read_bytes()[:FA] == bytes([3 ^ 0xFF]) * FA


def test_a_pristine_object_is_forged_without_a_trailer(tmp_path: Path) -> None:
    for c in range(3):  # pristine: one object per chunk, its payload alone
        _write(tmp_path, f"m@0x01000000@0@{c:04x}.data", bytes([c + 1]) * 5000, False, c + 1)
    snap = forge.snapshot(tmp_path)
    got = forge.forge(tmp_path, snap, FA)
    assert got["file"] == "m@0x01000000@0@0001.data" and got["trailer"] == "none"
    assert (tmp_path / got["file"]).read_bytes() == bytes([2 ^ 0xFF]) * 5000


def test_a_forged_payload_sealed_anew_is_still_the_forged_payload(tmp_path: Path) -> None:
    got = forge.forge(tmp_path, _patched_tier(tmp_path, 4, 2), FA)
    assert forge.forged_payload_kept(tmp_path, got)
    path = tmp_path / got["file"]
    path.write_bytes(path.read_bytes()[:FA] + b"K" * forge.TRAILER_LEN)  # another server's tag
    assert forge.forged_payload_kept(tmp_path, got)


def test_a_forged_object_replaced_or_removed_is_not_kept(tmp_path: Path) -> None:
    got = forge.forge(tmp_path, _patched_tier(tmp_path, 4, 2), FA)
    path = tmp_path / got["file"]
    path.write_bytes(bytes([3]) * FA + b"K" * forge.TRAILER_LEN)  # the chunk's own KV again
    assert not forge.forged_payload_kept(tmp_path, got)
    path.unlink()
    assert not forge.forged_payload_kept(tmp_path, got)


def test_an_empty_snapshot_cannot_be_forged(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no object"):
        forge.forge(tmp_path, {}, FA)


def test_revision_14s_fs_adapter_accepts_the_forged_object() -> None:
    """The trailer is the one the fs adapter of this series writes and checks (without any
    secret): a forged object passes its check, which is what the forged cases show on GPU."""
    fs = pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_l2_adapter")
    if not hasattr(fs, "_trailer"):
        pytest.skip("this lmcache writes no integrity trailer (pristine)")
    payload, name = os.urandom(FA), _name(5, 1)
    try:
        unkeyed = fs._trailer(payload, name) == forge.unkeyed_trailer(payload, name)
    except TypeError:  # a trailer of more arguments: a key
        unkeyed = False
    if not unkeyed:
        pytest.skip("this lmcache keys its trailer: a forged trailer no longer passes")
    assert fs._payload_is_intact(payload, forge.unkeyed_trailer(payload, name), name, True)
