"""Command line of the gate (``python -m hybridfa_gate``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from hybridfa_gate.cases import SET_NAMES, select_cases
from hybridfa_gate.judge import gate_problems
from hybridfa_gate.options import add_run_args, use_compile_cache
from hybridfa_gate.procs import install_cleanup_handler
from hybridfa_gate.report import table_row
from hybridfa_gate.run import ARMS, run_matrix
from hybridfa_gate.specs import RunConfig


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m hybridfa_gate",
        description="GPU restart gate: store, kill engine and LMCache server, restart, restore "
        "(criteria: hybridfa_gate/judge.py)",
    )
    add_run_args(ap, work=Path("/tmp/hybridfa-gate"), kv_cache_gib=None, arms=ARMS)
    ap.add_argument(
        "--cases",
        default="quick",
        help=f"{' | '.join(SET_NAMES)}, or comma-separated case ids / regexes",
    )
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of every engine")
    ap.add_argument("--jobs", type=int, default=1, help="cases run at once, each its own engines")
    ap.add_argument(
        "--expect-refusals",
        action="store_true",
        help="the engines' lmcache is a patched build whose compiled copy kernels do not load: "
        "judge each case as the server's refusal (without this such a run is an error)",
    )
    ap.add_argument("--list", action="store_true", help="print the selected cases and exit")
    a = ap.parse_args(argv)
    use_compile_cache(a)
    try:
        cases = select_cases(a.cases, a.tp)
    except ValueError as e:
        ap.error(str(e))
    if a.list:
        for c in cases:
            g = c.geometry
            shape = f"N={g.block_size} page={g.kernel_page} r={g.ratio} chunk={c.chunk}"
            print(f"{c.case_id:44s} {shape} prompt={c.prompt_tokens}")
        return 0
    if a.lmcache_dir is None:
        ap.error("--lmcache-dir is required (except with --list)")
    try:
        rc = RunConfig(
            a.arm,
            a.lmcache_dir.resolve(),
            a.out,
            gpu_memory_utilization=a.gpu_memory_utilization,
            kv_cache_memory_bytes=int(a.kv_cache_gib * 2**30) if a.kv_cache_gib else None,
            jobs=a.jobs,
            engine_timeout=a.engine_timeout,
            keep_l2=a.keep_l2,
            work=a.work,
            expect_refusals=a.expect_refusals,
        )
    except ValueError as e:
        ap.error(str(e))
    install_cleanup_handler()
    report = run_matrix(cases, rc, lambda rec: print(" | ".join(table_row(a.arm, rec)), flush=True))
    if report.get("error"):
        print(f"gate: {report['error']}", file=sys.stderr)
        return 2
    print(Path(report["md_path"]).read_text())
    problems = gate_problems({**report, "selected": [c.case_id for c in cases]}, a.arm)
    for problem in problems:
        print(f"gate: {problem}", file=sys.stderr)
    return 1 if problems else 0
