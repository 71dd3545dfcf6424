"""A forged fs L2 object: what someone who can write the L2 folder, but knows no deployment
secret, can do between a store and a restore.

The store engine lists the folder's objects right after its measured prompt was stored
(``snapshot``), so the gate knows which objects hold that prompt. With the servers down,
``forge`` rewrites one FA object of them: the middle one by write time (a chunk in the middle
of the hit), its payload replaced by another stored prompt's FA payload of the same size (KV
that looks like KV), ended with the integrity trailer that revision 14 of the series writes
and checks: magic + blake3(payload + file name), keyed by nothing. An object without a trailer
(pristine LMCache writes none) stays without one. A build that keys the trailer with a secret
must treat the object as damaged: the restore misses from that chunk on.

After that restore, ``forged_payload_kept`` says whether the file still holds the forged
payload (whatever its trailer now) or the server replaced it, which decides what a restore
after the next restart must do.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from hybridfa_gate.l2 import parse_file_name

TRAILER_MAGIC = b"LMCHFA1\x00"
TRAILER_LEN = len(TRAILER_MAGIC) + 32
SLACK = 64  # an FA object of N payload bytes is N to N + SLACK bytes with its trailer


def unkeyed_trailer(payload: bytes, filename: str) -> bytes:
    """Revision 14's trailer of ``payload`` stored as ``filename``."""
    import blake3  # lmcache's own dependency; only the forging step needs it

    hasher = blake3.blake3(payload)
    hasher.update(filename.encode())
    return TRAILER_MAGIC + hasher.digest()


def snapshot(root: Path | str) -> dict[str, list[int]]:
    """{path relative to ``root``: [size, mtime_ns]} of the object files of an fs tier."""
    out: dict[str, list[int]] = {}
    for p in Path(root).rglob("*.data"):
        try:
            st = p.stat()
        except FileNotFoundError:  # renamed or removed by a live server meanwhile
            continue
        if parse_file_name(p.name) is not None:
            out[str(p.relative_to(root))] = [st.st_size, st.st_mtime_ns]
    return out


def pick_target(snap: dict[str, list[int]], fa_bytes: int) -> tuple[str, int, int, int]:
    """(file, its rank by write time, of how many, payload bytes): the middle one of the
    snapshot's FA objects (``fa_bytes`` of payload, plus a trailer), or, where no object has
    that size (pristine: one object per chunk, no trailer), of all its objects."""
    fa = {n: v for n, v in snap.items() if fa_bytes <= v[0] <= fa_bytes + SLACK}
    pool = fa or snap
    if not pool:
        raise ValueError("the snapshot holds no object to forge")
    order = sorted(pool, key=lambda n: (pool[n][1], n))
    rank = len(order) // 2
    name = order[rank]
    return name, rank, len(order), fa_bytes if fa else pool[name][0]


def forge(root: Path | str, snap: dict[str, list[int]], fa_bytes: int) -> dict[str, Any]:
    """Rewrite one FA object of ``snap`` under ``root`` (see the module docstring)."""
    root = Path(root)
    name, rank, count, payload_len = pick_target(snap, fa_bytes)
    path = root / name
    data = path.read_bytes()
    trailer = len(data) > payload_len
    size = len(data)
    others = sorted(
        p
        for p in root.rglob("*.data")
        if str(p.relative_to(root)) not in snap and p.stat().st_size == size
    )
    if others:
        payload, source = others[0].read_bytes()[:payload_len], str(others[0].relative_to(root))
    else:
        payload, source = bytes(b ^ 0xFF for b in data[:payload_len]), "inverted"
    if payload == data[:payload_len]:
        payload, source = bytes(b ^ 0xFF for b in payload), "inverted"
    forged = payload + (unkeyed_trailer(payload, path.name) if trailer else b"")
    path.write_bytes(forged)
    return {
        "file": name,
        "rank": rank,
        "of": count,
        "payload_bytes": payload_len,
        "trailer": "unkeyed (revision 14)" if trailer else "none",
        "payload_from": source,
        "payload_blake2b": _digest(payload),
    }


def forged_payload_kept(root: Path | str, forged: dict[str, Any]) -> bool:
    """Whether the object ``forge`` rewrote (its record ``forged``) still begins with the
    forged payload; False where the file is gone."""
    try:
        data = (Path(root) / forged["file"]).read_bytes()
    except FileNotFoundError:
        return False
    return _digest(data[: forged["payload_bytes"]]) == forged["payload_blake2b"]


def _digest(payload: bytes) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()
