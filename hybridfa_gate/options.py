"""The command-line options that the gate (``cli``), the fault run and the load run share."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridfa_gate.models import MODELS
from hybridfa_gate.procs import ENGINE_TIMEOUT_S, compile_cache_env

ARM_HELP = (
    "patched (this series' wheel), pristine (the base's lmcache release: 0.5.3, or 0.5.6 for "
    "vLLM 0.29-0.34) or control (pristine 0.5.3 with the series' HND and native-batch patches, "
    "built by `python -m hybridfa_gate.control`, for the HND and resp cases where pristine "
    "stores nothing)"
)


def add_run_args(
    ap: argparse.ArgumentParser, *, work: Path, kv_cache_gib: float | None, arms: Sequence[str]
) -> None:
    ap.add_argument("--arm", choices=arms, default="patched", help=ARM_HELP)
    ap.add_argument(
        "--lmcache-dir",
        type=Path,
        help="folder holding the lmcache package under test (put first on the PYTHONPATH of "
        "every engine and server)",
    )
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument(
        "--kv-cache-gib",
        type=float,
        default=kv_cache_gib,
        help="fixed KV cache per engine (skips vLLM's memory profiling, which breaks when "
        "engines run at once)",
    )
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    ap.add_argument(
        "--engine-timeout",
        type=float,
        default=ENGINE_TIMEOUT_S,
        help="seconds an engine may take, start to exit, beside a load phase (raise it on a "
        "machine that still compiles its kernels for many engines at once)",
    )
    ap.add_argument("--work", type=Path, default=work)
    ap.add_argument("--keep-l2", action="store_true")
    ap.add_argument(
        "--compile-cache",
        type=Path,
        help="one folder for every engine's compiled kernels (vLLM's, inductor's, Triton's, "
        "FlashInfer's JIT), to carry to another machine of the same GPU model and software; "
        "default: each library's own",
    )


def use_compile_cache(a: argparse.Namespace) -> None:
    """Point every engine started from here at ``--compile-cache`` (children inherit it)."""
    if a.compile_cache is not None:
        os.environ.update(compile_cache_env(a.compile_cache))


def add_case_args(
    ap: argparse.ArgumentParser, *, model: str, work: Path, kv_cache_gib: float | None
) -> None:
    add_run_args(ap, work=work, kv_cache_gib=kv_cache_gib, arms=("patched", "pristine"))
    ap.add_argument("--model", default=model, choices=sorted(MODELS))
    ap.add_argument("--layout", default="NHD", choices=("NHD", "HND"))
    ap.add_argument("--chunk-blocks", type=int, default=1, help="LMCache chunk = this x N")


def case_args(a: argparse.Namespace) -> dict[str, Any]:
    """add_case_args' values, as keyword arguments of FaultConfig and LoadConfig."""
    keys: tuple[str, ...] = ("arm", "out", "model", "layout", "chunk_blocks", "kv_cache_gib")
    keys += ("gpu_memory_utilization", "engine_timeout", "keep_l2", "work")
    args = {k: getattr(a, k) for k in keys}
    return {**args, "lmcache_dir": (a.lmcache_dir or Path(".")).resolve()}
