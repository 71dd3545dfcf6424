"""Marker module of the hybrid-FA patched LMCache build.

The wheel factory copies this file into the wheel as ``lmcache/_hybridfa.py`` with the
``@...@`` placeholders filled in. ``python -m lmcache._hybridfa`` reports what is installed
and whether the installed files still match the wheel's RECORD.
"""

from __future__ import annotations

import base64
import hashlib
import sys
from importlib import metadata
from pathlib import Path

BASE_VERSION = "@BASE_VERSION@"
REVISION = "@REVISION@"
VERSION = "@VERSION@"
SERIES_SHA256 = "@SERIES_SHA256@"
TREE_SHA256 = "@TREE_SHA256@"
PATCHES = tuple("@PATCHES@".split(",")) if "@PATCHES@" else ()
KERNELS = "@KERNELS@"  # what --kernels built them against; empty: the base wheel's own


def _record_mismatches(dist: metadata.Distribution) -> list[str]:
    problems: list[str] = []
    for entry in dist.files or ():
        if entry.hash is None or entry.hash.mode != "sha256":
            continue
        path = Path(str(entry.locate()))
        if not path.is_file():
            problems.append(f"missing: {entry}")
            continue
        digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest())
        if digest.rstrip(b"=").decode() != entry.hash.value:
            problems.append(f"modified: {entry}")
    return problems


def report() -> tuple[list[str], bool]:
    """Return the report lines and whether the install is intact."""
    lines = [
        "lmcache hybrid-FA build: PATCHED",
        f"  version        {VERSION}",
        f"  base           lmcache {BASE_VERSION}",
        f"  revision       {REVISION}",
        f"  series sha256  {SERIES_SHA256}",
        f"  tree sha256    {TREE_SHA256}",
        f"  patches        {', '.join(PATCHES) or '(none)'}",
        f"  kernels        {f'built against {KERNELS}' if KERNELS else 'as in the base wheel'}",
        f"  module         {Path(__file__).resolve().parent}",
    ]
    try:
        lines.append(f"  vllm           {metadata.version('vllm')}")
    except metadata.PackageNotFoundError:
        lines.append("  vllm           not installed")
    intact = True
    try:
        dist = metadata.distribution("lmcache")
    except metadata.PackageNotFoundError:
        lines.append("  RECORD         no lmcache distribution metadata found")
        return lines, False
    if dist.version != VERSION:
        lines.append(
            f"  RECORD         !!! installed lmcache metadata says {dist.version}, "
            f"this marker belongs to {VERSION}: another lmcache was installed over "
            "this build. Reinstall the hybrid-FA wheel."
        )
        return lines, False
    problems = _record_mismatches(dist)
    if problems:
        intact = False
        lines.append(
            f"  RECORD         !!! {len(problems)} installed file(s) differ from the "
            "wheel: something overwrote this build. Reinstall the hybrid-FA wheel."
        )
        lines.extend(f"                 {p}" for p in problems[:20])
    else:
        lines.append(
            f"  RECORD         ok ({sum(1 for f in dist.files or () if f.hash)} hashed files match)"
        )
    return lines, intact


def main() -> int:
    lines, intact = report()
    print("\n".join(lines))
    return 0 if intact else 1


if __name__ == "__main__":
    sys.exit(main())
