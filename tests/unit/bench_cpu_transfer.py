"""CPU benchmark: store + retrieve of a ~16k-token context through LMCache's server
transfer module, hybrid (6 GDN + 2 FA, N=544 over 32-slot pages, r=17) against a
non-hybrid model of 8 FA layers moving the same bytes per chunk.

It drives the unit tests' hybrid KV and LMCache's real transfer module (hybrid_kv.py), so it
lives beside them; pytest does not collect it. Run with the build under test on PYTHONPATH:
    PYTHONPATH=build/lmc-patched .venv-test/bin/python tests/unit/bench_cpu_transfer.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch
from hybrid_kv import build_fa_only_kv, build_hybrid_kv, start_server

N, PAGE, CHUNKS, REPEATS = 544, 32, 30, 5


def _time(server, ids: list[list[int]], tokens: int) -> tuple[float, float]:
    stores, retrieves = [], []
    for i in range(REPEATS):
        server.ctx.storage_manager.objects.clear()
        t0 = time.perf_counter()
        assert server.store(f"r{i}", tokens, ids)
        t1 = time.perf_counter()
        assert server.retrieve(f"r{i}", tokens, ids)
        t2 = time.perf_counter()
        stores.append(t1 - t0)
        retrieves.append(t2 - t1)
    return statistics.median(stores), statistics.median(retrieves)


def _lmcache_build() -> str:
    try:
        import lmcache._hybridfa as marker

        return marker.VERSION
    except ImportError:
        return "0.5.3 (pristine)"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokens = CHUNKS * N
    mp = pytest.MonkeyPatch()
    results = {}
    try:
        hybrid = build_hybrid_kv(N, PAGE, "NHD", num_blocks=4 * CHUNKS + 2)
        server = start_server(hybrid, chunk_size=N, monkeypatch=mp)
        ids = [[1 + g * CHUNKS + c for c in range(CHUNKS)] for g in range(4)]
        results["hybrid"] = _time(server, ids, tokens)
        chunk_bytes = sum(o.get_size() for o in server.ctx.storage_manager.objects.values())
        dense = build_fa_only_kv(PAGE, "NHD", num_blocks=CHUNKS * (N // PAGE) + 2, num_layers=8)
        server = start_server(dense, chunk_size=N, monkeypatch=mp)
        results["non_hybrid"] = _time(server, [list(range(1, CHUNKS * (N // PAGE) + 1))], tokens)
        dense_bytes = sum(o.get_size() for o in server.ctx.storage_manager.objects.values())
    finally:
        mp.undo()
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, CPU only",
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "tokens": tokens,
        "lmcache": _lmcache_build(),
        "bytes_moved_each_way": {"hybrid": chunk_bytes, "non_hybrid": dense_bytes},
        "store_s": {k: round(v[0], 4) for k, v in results.items()},
        "retrieve_s": {k: round(v[1], 4) for k, v in results.items()},
        "hybrid_over_non_hybrid": {
            "store": round(results["hybrid"][0] / results["non_hybrid"][0], 3),
            "retrieve": round(results["hybrid"][1] / results["non_hybrid"][1], 3),
        },
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
