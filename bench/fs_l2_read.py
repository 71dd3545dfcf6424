"""How fast LMCache's fs L2 adapter reads its objects back from disk, next to the raw disk.

Stores K objects of S bytes through the real ``FSL2Adapter`` (default 24 x 64 MiB) into a
folder, drops them from the page cache (fsync + ``POSIX_FADV_DONTNEED`` per file) and loads
them all back with ONE ``submit_load_task`` over all keys, which is what the MP server's
prefetch does (``PrefetchController._submit_load_tasks``: one load task per adapter per
request). Wall-clock GB/s from submit to completion. On the same files, each pass after a
fresh drop: plain sequential buffered ``readinto`` (one file after another) and the same with
N threads; and blake3 throughput of the payload (single call, 2 threads, ``max_threads``).

``--variant`` monkeypatches the adapter's load path in this process only (nothing in the
source tree changes) to measure candidate fixes; see VARIANTS. Passes are interleaved
in a shuffled order over ``--reps`` repetitions (the disk of a VM is noisy) and
reported as medians; a "warm" pass per variant (files in the page cache) isolates the CPU cost.

Run from the repo root, one arm (the lmcache on PYTHONPATH) or both (a child per arm):
    PYTHONPATH=build/lmc-patched python bench/fs_l2_read.py
    python bench/fs_l2_read.py --arms patched,pristine --out FILE
JSON goes to stdout (and --out), the one-paragraph summary to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
GB = 1e9


@dataclass(frozen=True)
class Variant:
    """How the load path runs: as built, or ``_execute_load`` replaced (``conc`` files in
    flight, verification in the default executor or on the event loop, WILLNEED on the
    next ``willneed`` files), optionally blake3 with ``max_threads=AUTO``."""

    replace: bool = False
    conc: int = 1
    verify_in_thread: bool = False
    willneed: int = 0
    hash_mt: bool = False
    odirect: bool = False
    needs_trailer: bool = False  # nothing to measure on pristine (no verification)
    default: bool = True


VARIANTS: dict[str, Variant] = {
    "as-built": Variant(),  # the adapter unchanged: one file at a time, verify on the loop
    "odirect": Variant(odirect=True),  # the adapter's own use_odirect=True path
    "hash-mt": Variant(hash_mt=True, needs_trailer=True),  # _trailer: max_threads=AUTO
    "serial": Variant(replace=True, default=False),  # control: the replacement, as built
    "verify-thread": Variant(replace=True, verify_in_thread=True, needs_trailer=True),
    "conc2": Variant(replace=True, conc=2),  # 2 files in flight, verify on the loop
    "conc2-vt": Variant(replace=True, conc=2, verify_in_thread=True, needs_trailer=True),
    "conc4-vt": Variant(replace=True, conc=4, verify_in_thread=True),
    # more files in flight, for the smaller FA-only objects of --separate-object-groups
    "conc8-vt": Variant(replace=True, conc=8, verify_in_thread=True, default=False),
    "conc16-vt": Variant(replace=True, conc=16, verify_in_thread=True, default=False),
    "conc2-vt-mt": Variant(
        replace=True, conc=2, verify_in_thread=True, hash_mt=True, needs_trailer=True, default=False
    ),
    "willneed-next": Variant(replace=True, willneed=1, default=False),  # fadvise next file
}


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / GB, 3)


# ---------------------------------------------------------------------------------------
# Files and the page cache
# ---------------------------------------------------------------------------------------


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _advise(path: Path, advice: int) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, advice)
        finally:
            os.close(fd)
    except OSError:
        pass


def resident(path: Path) -> str | None:
    exe = shutil.which("fincore")
    if exe is None:
        return None
    cp = subprocess.run([exe, "-bn", "-o", "RES,SIZE", str(path)], capture_output=True, text=True)
    return cp.stdout.strip() or cp.stderr.strip()


def read_file(path: Path, buf: mmap.mmap) -> int:
    mv, total = memoryview(buf), 0
    with open(path, "rb", buffering=0) as f:
        while total < len(mv) and (n := f.readinto(mv[total:])):
            total += n
    return total


def raw_read(paths: list[Path], bufs: list[mmap.mmap], threads: int) -> int:
    if threads == 1:
        return sum(read_file(p, bufs[0]) for p in paths)
    free = list(bufs[:threads])
    lock = threading.Lock()

    def one(p: Path) -> int:
        with lock:
            b = free.pop()
        try:
            return read_file(p, b)
        finally:
            with lock:
                free.append(b)

    with ThreadPoolExecutor(threads) as ex:
        return sum(ex.map(one, paths))


# ---------------------------------------------------------------------------------------
# The adapter and its variants
# ---------------------------------------------------------------------------------------


def make_load(mod: Any, v: Variant) -> Callable[..., Any]:
    """``FSL2Adapter._execute_load`` (buffered path), with ``v.conc`` files in flight."""
    verify = verifier(mod)
    tail_len = getattr(mod, "_TRAILER_LEN", 0) + 1

    async def _execute_load(self: Any, keys: list[Any], objects: list[Any], task_id: int) -> None:
        bitmap = mod.Bitmap(len(keys))
        loop = asyncio.get_running_loop()
        sem = asyncio.Semaphore(v.conc)
        paths = [self._key_to_path(k) for k in keys]

        async def one(i: int) -> None:
            async with sem:
                for p in paths[i + 1 : i + 1 + v.willneed]:
                    loop.run_in_executor(None, _advise, p, os.POSIX_FADV_WILLNEED)
                dst = objects[i].byte_array
                try:
                    async with mod.aiofiles.open(paths[i], "rb") as f:
                        if await mod._async_readinto_full(f, dst) != len(dst):
                            return
                        tail = await f.read(tail_len) if verify else b""
                except FileNotFoundError:
                    return
                if verify is not None:
                    check = getattr(mod, verify)  # the timed one Patches.apply installs
                    args = (dst, tail, paths[i].name)
                    if verify == "_why_not_authentic":
                        args = (self._tag_key, *args)
                    res = (
                        await loop.run_in_executor(None, check, *args)
                        if v.verify_in_thread
                        else check(*args)
                    )
                    if res is not (None if verify == "_why_not_authentic" else True):
                        return
                bitmap.set(i)

        await asyncio.gather(*(one(i) for i in range(len(keys))))
        loaded = [keys[i] for i in bitmap.get_indices_list()]
        if loaded:
            self._notify_keys_accessed(loaded)
        with self._lock:
            self._completed_load_tasks[task_id] = bitmap
        self._load_efd.notify()

    return _execute_load


def verifier(mod: Any) -> str | None:
    """The fs adapter module's check of a loaded object: ``_why_not_authentic`` (keyed
    trailer, None when authentic), ``_payload_is_intact`` (revisions up to 14: unkeyed
    trailer, True when intact), or None (pristine: no check)."""
    return next((n for n in ("_why_not_authentic", "_payload_is_intact") if hasattr(mod, n)), None)


class Patches:
    """Monkeypatches of the fs adapter module, undone by ``undo``; read/verify timers."""

    def __init__(self, mod: Any) -> None:
        self.mod, self.saved, self.read_s, self.verify_s = mod, [], [], []

    def set(self, obj: Any, name: str, value: Any) -> None:
        self.saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def apply(self, v: Variant) -> None:
        mod = self.mod
        read, name = mod._async_readinto_full, verifier(mod)

        async def timed_read(f: Any, buf: Any) -> int:
            t0 = time.perf_counter()
            n = await read(f, buf)
            self.read_s.append(time.perf_counter() - t0)
            return n

        self.set(mod, "_async_readinto_full", timed_read)
        if name is not None:
            verify = getattr(mod, name)

            def timed_verify(*args: Any) -> Any:
                t0 = time.perf_counter()
                res = verify(*args)
                self.verify_s.append(time.perf_counter() - t0)
                return res

            self.set(mod, name, timed_verify)
        if v.hash_mt:
            import blake3

            def trailer_mt(*args: Any) -> bytes:
                *key, payload, filename = args  # (key,) from revision 15: keyed trailer
                mt = blake3.blake3.AUTO
                if not key:
                    h = blake3.blake3(memoryview(payload).cast("B"), max_threads=mt)
                    h.update(filename.encode())
                    return bytes(mod._TRAILER_MAGIC + h.digest())
                encoded = filename.encode()
                prefix = len(encoded).to_bytes(4, "little") + encoded
                h = blake3.blake3(prefix, key=key[0], max_threads=mt)
                h.update(memoryview(payload).cast("B"))
                return bytes(mod._TRAILER_MAGIC + h.digest())

            self.set(mod, "_trailer", trailer_mt)
        if v.replace:
            self.set(mod.FSL2Adapter, "_execute_load", make_load(mod, v))

    def undo(self) -> None:
        while self.saved:
            obj, name, value = self.saved.pop()
            setattr(obj, name, value)
        self.read_s, self.verify_s = [], []


def wait(poll: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while (res := poll()) is None:
        if time.monotonic() > deadline:
            raise TimeoutError("fs L2 task did not complete")
        time.sleep(0.0005)
    return res


# ---------------------------------------------------------------------------------------
# One arm
# ---------------------------------------------------------------------------------------


def machine(folder: Path) -> dict[str, Any]:
    info: dict[str, Any] = {"cores": os.cpu_count(), "kernel": platform.release()}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            info["cpu"] = line.split(":", 1)[1].strip()
            break
    mem = Path("/proc/meminfo").read_text().split()
    info["mem_gb"] = round(int(mem[1]) * 1024 / GB, 1)
    best = ("", "", "")
    for line in Path("/proc/mounts").read_text().splitlines():
        dev, mnt, fstype = line.split()[:3]
        if str(folder).startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(best[1]):
            best = (dev, mnt, fstype)
    info.update(device=best[0], mount=best[1], fs=best[2])
    queue = Path("/sys/block") / Path(best[0]).name / "queue"
    for knob in ("read_ahead_kb", "max_sectors_kb", "nr_requests", "rotational"):
        try:
            info[knob] = int((queue / knob).read_text())
        except (OSError, ValueError):
            pass
    return info


def host_object(raw: Any) -> Any:
    """LMCache's real TensorMemoryObj over a flat uint8 CPU tensor, as the server holds."""
    import torch

    from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

    meta = MemoryObjMetadata(
        shape=raw.shape, dtype=torch.uint8, address=0, phy_size=raw.numel(), ref_count=1
    )
    return TensorMemoryObj(raw, meta, None)


def run_arm(args: argparse.Namespace) -> dict[str, Any]:
    import blake3
    import torch

    import lmcache
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.l2_adapters import fs_l2_adapter as mod

    patched = verifier(mod) is not None
    names = args.variant or [
        n for n, v in VARIANTS.items() if v.default and (patched or not v.needs_trailer)
    ]
    k, size = args.objects, args.size_mib << 20
    parent = args.dir or REPO / "build"
    parent.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(parent).free < 2 * k * size:
        raise SystemExit(f"not enough free space under {parent} for {k * size / GB:.1f} GB")
    folder = Path(tempfile.mkdtemp(prefix="fs-l2-read-", dir=parent))
    timeout = 60 + k * size / (0.02 * GB)
    out: dict[str, Any] = {
        "arm": "patched" if patched else "pristine",
        "lmcache": str(Path(lmcache.__file__).parent),
        "machine": machine(folder),
        "config": {"objects": k, "object_bytes": size, "threads": args.threads, "reps": args.reps},
        "blake3": {"version": getattr(blake3, "__version__", "?")},
    }
    mms = [mmap.mmap(-1, size) for _ in range(k)]  # page aligned, as L1 memory (O_DIRECT)
    objs = [host_object(torch.frombuffer(m, dtype=torch.uint8)) for m in mms]
    keys = [
        ObjectKey(chunk_hash=i.to_bytes(16, "big"), model_name="bench", kv_rank=0) for i in range(k)
    ]
    block = os.urandom(size)
    for i, m in enumerate(mms):
        m[:] = block
        m[:16] = keys[i].chunk_hash
    del block
    adapters: dict[bool, Any] = {}
    try:
        for direct in (False, True):
            cfg = mod.FSL2AdapterConfig(base_path=str(folder), use_odirect=direct)
            adapters[direct] = mod.FSL2Adapter(cfg)
        a = adapters[False]
        t0 = time.perf_counter()
        task = a.submit_store_task(keys, objs)
        res = wait(lambda: a.pop_completed_store_tasks().get(task), timeout)
        t1 = time.perf_counter()
        paths = [a._key_to_path(key) for key in keys]
        drop_cache(paths)
        t2 = time.perf_counter()
        if int(res) < 0 or not all(p.exists() for p in paths):
            raise RuntimeError("fs L2 store failed")
        out["store"] = {
            "gbps_to_page_cache": gbps(k * size, t1 - t0),
            "gbps_incl_fsync": gbps(k * size, t2 - t0),
            "file_bytes": paths[0].stat().st_size,
        }
        out["page_cache_after_drop"] = resident(paths[0])
        bufs = [mmap.mmap(-1, size + 4096) for _ in range(max(1, args.threads))]
        patches = Patches(mod)

        def adapter_pass(name: str) -> dict[str, Any]:
            v = VARIANTS[name]
            ad = adapters[v.odirect]
            for m in mms:
                m[:16] = bytes(16)
            patches.apply(v)
            try:
                t0 = time.perf_counter()
                task = ad.submit_load_task(keys, objs)
                bitmap = wait(lambda: ad.query_load_result(task), timeout)
                dt = time.perf_counter() - t0
                read_s, verify_s = sum(patches.read_s), sum(patches.verify_s)
            finally:
                patches.undo()
            hits = sum(bitmap.test(i) for i in range(k))
            if hits != k or any(m[:16] != key.chunk_hash for m, key in zip(mms, keys, strict=True)):
                raise RuntimeError(f"{name}: {hits}/{k} objects loaded intact")
            return {
                "gbps": gbps(k * size, dt),
                "wall_s": dt,
                "read_s": read_s,
                "verify_s": verify_s,
            }

        passes: dict[str, Callable[[], dict[str, Any]]] = {
            "raw-seq": lambda: {"bytes": raw_read(paths, bufs, 1)},
            f"raw-par{args.threads}": lambda: {"bytes": raw_read(paths, bufs, args.threads)},
        }
        passes.update({n: (lambda n=n: adapter_pass(n)) for n in names})
        cold: dict[str, list[dict[str, Any]]] = {n: [] for n in passes}
        order = list(passes)
        for rep in range(args.reps):  # a fresh order each rep: the disk's state has memory
            random.Random(rep).shuffle(order)
            for n in order:
                fn = passes[n]
                drop_cache(paths)
                t0 = time.perf_counter()
                r = fn()
                r.setdefault("gbps", gbps(k * size, time.perf_counter() - t0))
                r.pop("bytes", None)
                cold[n].append(r)
        warm: dict[str, list[float]] = {n: [] for n in passes if n != "odirect"}
        raw_read(paths, bufs, 1)  # everything into the page cache
        for _ in range(args.reps):
            for n in warm:
                t0 = time.perf_counter()
                r = passes[n]()
                warm[n].append(r.get("gbps") or gbps(k * size, time.perf_counter() - t0))
        base = statistics.median(r["gbps"] for r in cold["raw-seq"])
        out["cold"] = {}
        for n, rs in cold.items():
            med = statistics.median(r["gbps"] for r in rs)
            row: dict[str, Any] = {
                "gbps_median": round(med, 3),
                "vs_raw_seq": round(med / base, 2),
                "gbps": [r["gbps"] for r in rs],
            }
            for t in ("wall_s", "read_s", "verify_s"):  # summed over objects (overlap if conc)
                if t in rs[0]:
                    row[t] = round(statistics.median(r[t] for r in rs), 3)
            out["cold"][n] = row
        out["warm_gbps"] = {n: statistics.median(w) for n, w in warm.items()}
        out["warm_gbps_all"] = warm
        out["blake3"].update(hash_throughput(mms))
    finally:
        for ad in adapters.values():
            ad.close()
        shutil.rmtree(folder, ignore_errors=True)
    return out


def hash_throughput(mms: list[mmap.mmap]) -> dict[str, Any]:
    import blake3

    total = sum(len(m) for m in mms)

    def run(max_threads: int, threads: int = 1) -> float:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda m: blake3.blake3(memoryview(m), max_threads=max_threads), mms))
        return gbps(total, time.perf_counter() - t0)

    res: dict[str, Any] = {"single_gbps": run(1), "two_threads_gbps": run(1, 2)}
    auto = getattr(blake3.blake3, "AUTO", None)
    res["max_threads_auto_gbps"] = run(auto) if auto is not None else None
    return res


# ---------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------


def summary(arms: dict[str, dict[str, Any]]) -> str:
    parts = []
    for name, r in arms.items():
        c, w, b3 = r["cold"], r["warm_gbps"], r["blake3"]
        par = next(n for n in c if n.startswith("raw-par"))
        ours = [n for n in c if not n.startswith("raw")]
        best_c = max(ours, key=lambda n: c[n]["gbps_median"])
        best_w = max((n for n in ours if n in w), key=lambda n: w[n])
        ab, seq = c["as-built"], c["raw-seq"]["gbps"]
        parts.append(
            f"{name}: adapter load {ab['gbps_median']} GB/s cold = {ab['vs_raw_seq']}x raw "
            f"buffered sequential {c['raw-seq']['gbps_median']} (passes {min(seq)}-{max(seq)}; "
            f"{par} {c[par]['gbps_median']}), "
            f"verification {ab['verify_s']} s (summed over objects) of {ab['wall_s']} s; best cold "
            f"variant {best_c} {c[best_c]['gbps_median']}; from the page cache as-built "
            f"{w['as-built']} vs raw {w['raw-seq']} GB/s, best {best_w} {w[best_w]}; blake3 "
            f"{b3['single_gbps']} GB/s single-threaded, {b3['max_threads_auto_gbps']} AUTO"
        )
    first = next(iter(arms.values()))
    m, cfg = first["machine"], first["config"]
    return (
        f"fs L2 read of {cfg['objects']} x {cfg['object_bytes'] >> 20} MiB on {m['fs']} "
        f"{m['device']} ({m['cores']} cores, {m.get('cpu')}), medians of {cfg['reps']}: "
        + "; ".join(parts)
        + "."
    )


CHILD_ARGS = ("objects", "size_mib", "threads", "reps")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--objects", type=int, default=24)
    p.add_argument("--size-mib", type=int, default=64)
    p.add_argument("--dir", type=Path, help="parent of the tmp L2 folder (default build/)")
    p.add_argument("--threads", type=int, default=4, help="threads of the parallel raw read")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variant", action="append", choices=list(VARIANTS), help="repeatable")
    p.add_argument("--arms", help="e.g. patched,pristine: one child per build/lmc-<arm>")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.arms:
        results = {}
        argv = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in CHILD_ARGS]
        argv += [f"--dir={args.dir}"] if args.dir else []
        argv += [f"--variant={v}" for v in args.variant or []]
        for arm in args.arms.split(","):
            env = dict(os.environ, PYTHONPATH=str(REPO / "build" / f"lmc-{arm}"))
            env.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
            env["FS_L2_READ_CHILD"] = "1"
            cp = subprocess.run(
                [sys.executable, __file__, *argv], env=env, stdout=subprocess.PIPE, check=True
            )
            results[arm] = next(iter(json.loads(cp.stdout)["arms"].values()))
    else:
        r = run_arm(args)
        results = {r["arm"]: r}
    doc = {"bench": "fs_l2_read", "arms": results, "summary": summary(results)}
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if not os.environ.get("FS_L2_READ_CHILD"):
        print(doc["summary"], file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
