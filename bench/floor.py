"""The restore bench's evidence and floor, stdlib only: page-cache residency per file
(mincore), a process's bytes read from storage (/proc/<pid>/io), when an L2 folder is quiet,
the device's read ceiling with many reads in flight, floor = bytes / ceiling + fixed cost."""

from __future__ import annotations

import ctypes
import mmap
import os
import statistics
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

GB = 1e9
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache: mincore over a shared read-only mapping."""
    size = path.stat().st_size
    if not size:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            vec = (ctypes.c_ubyte * ((size + PAGE - 1) // PAGE))()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    flags = bytes(vec)  # bit 0: resident; the other bits are reserved (zero)
    return min((len(flags) - flags.count(0)) * PAGE, size)


def residency(paths: Iterable[Path]) -> dict[str, int]:
    """Over files, one by one: how many and their bytes, how many had any page in the page
    cache and those pages' bytes, how many were missing."""
    out = dict.fromkeys(("files", "bytes", "resident_files", "resident_bytes", "missing_files"), 0)
    for p in paths:
        try:
            size, res = p.stat().st_size, resident_bytes(p)
        except FileNotFoundError:
            out["missing_files"] += 1
            continue
        out["files"] += 1
        out["bytes"] += size
        out["resident_files"] += res > 0
        out["resident_bytes"] += res
    return out


def parse_proc_io(text: str) -> dict[str, int]:
    """/proc/<pid>/io as {field: int}."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if value.strip().isdigit():
            out[key.strip()] = int(value)
    return out


def read_bytes(pid: int | str = "self") -> int | None:
    """Bytes the process (all its threads) had the block layer read: ``read_bytes``."""
    try:
        return parse_proc_io(Path(f"/proc/{pid}/io").read_text()).get("read_bytes")
    except OSError:
        return None


def snapshot(folder: Path, suffix: str) -> dict[str, tuple[int, float]]:
    """{file: (size, mtime)} of the files under ``folder`` ending in ``suffix``."""
    out = {}
    for p in folder.rglob(f"*{suffix}"):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        out[str(p)] = (st.st_size, st.st_mtime)
    return out


def wait_quiet(
    folder: Path, suffix: str, min_files: int = 0, quiet_s: float = 3.0, timeout_s: float = 300.0
) -> dict[str, Any]:
    """Wait until ``folder`` holds ``min_files`` files and no file appeared, grew or was touched
    for ``quiet_s`` (no store in flight). Returns the files and whether it got quiet."""
    t0 = time.monotonic()
    last, since = snapshot(folder, suffix), t0
    while time.monotonic() - t0 < timeout_s:
        time.sleep(0.25)
        now = snapshot(folder, suffix)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s and len(now) >= min_files:
            return {"quiet": True, "files": now, "waited_s": round(time.monotonic() - t0, 2)}
    return {"quiet": False, "files": last, "waited_s": round(time.monotonic() - t0, 2)}


def _read_all(path: Path, direct: bool, chunk: int, bufs: list[mmap.mmap]) -> int:
    """Read one file with preads of ``chunk`` into an aligned buffer of the pool."""
    buf, n, off = bufs.pop(), 0, 0
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        while k := os.preadv(fd, [buf], off):
            n, off = n + k, off + k
            if k < chunk:
                break
    finally:
        os.close(fd)
        bufs.append(buf)
    return n


def read_rate(paths: Sequence[Path], direct: bool, threads: int, chunk: int = 8 << 20) -> float:
    """GB/s reading ``paths`` whole, ``threads`` files in flight (the caller drops the cache)."""
    bufs = [mmap.mmap(-1, chunk) for _ in range(threads)]  # page aligned, as O_DIRECT needs
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        n = sum(pool.map(lambda p: _read_all(p, direct, chunk, bufs), paths))
    return n / (time.perf_counter() - t0) / GB


def drop_cache(paths: Iterable[Path]) -> None:
    """fsync + POSIX_FADV_DONTNEED per file: out of the page cache."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def ceiling_probe(
    folder: Path, file_bytes: int, total_bytes: int, threads: Sequence[int] = (1, 8, 32)
) -> dict[str, Any]:
    """The device's read ceiling over files like the L2 objects (``file_bytes`` each, about
    ``total_bytes`` in all): O_DIRECT and buffered (after a drop), ``threads`` files in flight;
    then buffered with the files in the page cache. ``disk_gbps``, ``page_cache_gbps``: the
    best of each."""
    folder.mkdir(parents=True, exist_ok=True)
    size = max(PAGE, file_bytes // PAGE * PAGE)
    paths = [folder / f"ceiling-{i:04d}.bin" for i in range(max(2, total_bytes // size))]
    block = os.urandom(1 << 20) * (size >> 20) + os.urandom(size % (1 << 20))
    res: dict[str, Any] = {"file_bytes": size, "files": len(paths), "passes": {}}
    try:
        for p in paths:
            with open(p, "wb", buffering=0) as f:
                f.write(block)
        drop_cache(paths)
        for t in threads:
            for direct in (True, False):
                drop_cache(paths)
                label = f"{'direct' if direct else 'buffered'}-{t}"
                try:
                    res["passes"][label] = read_rate(paths, direct, t)
                except OSError as e:  # tmpfs refuses O_DIRECT
                    res["passes"][label] = None
                    res[f"{label}_error"] = f"{type(e).__name__}: {e}"
        for t in threads:
            read_rate(paths, False, t)  # resident
            res["passes"][f"cached-{t}"] = read_rate(paths, False, t)
    finally:
        for p in paths:
            p.unlink(missing_ok=True)
    cold = [v for k, v in res["passes"].items() if v and not k.startswith("cached")]
    res["disk_gbps"] = max(cold, default=None)
    res["page_cache_gbps"] = max(
        (v for k, v in res["passes"].items() if v and k.startswith("cached")), default=None
    )
    return res


def floor_s(nbytes: float | None, gbps: float | None, fixed: float | None) -> float | None:
    """The fastest a restore of ``nbytes`` can be: read at the ceiling, then the fixed cost
    (what the engine spends on a hit already in GPU memory)."""
    if nbytes is None or not gbps or fixed is None:
        return None
    return nbytes / (gbps * GB) + fixed


def spread(values: Iterable[float | None]) -> dict[str, Any]:
    got = [v for v in values if v is not None]
    if not got:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(got), "median": statistics.median(got), "min": min(got), "max": max(got)}
