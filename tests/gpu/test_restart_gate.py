"""GPU restart gate for the arm in HYBRIDFA_ARM (tests/conftest.py), on the lmcache this pytest
imports (the engines import it too: its folder goes first on their PYTHONPATH, or, installed
with pip, stays where it is). The criteria (a)-(e) and what each arm must show:
hybridfa_gate/judge.py.

Environment: HYBRIDFA_GATE_CASES (default quick; a set name, case ids or regexes),
HYBRIDFA_GATE_OUT (default results/), HYBRIDFA_GATE_TP (default 1), HYBRIDFA_GATE_JOBS (cases
at once, default 1) and HYBRIDFA_GATE_KV_CACHE_GIB (a fixed KV cache per engine instead of
vLLM's memory profiling, which breaks while other processes start or stop on the GPU; needed
with more than one job), HYBRIDFA_GATE_ENGINE_TIMEOUT (seconds an engine may take, start to
exit, default 420) and HYBRIDFA_GATE_EXPECT_REFUSALS=1 (the patched lmcache's compiled copy
kernels do not load with this torch and every case is to be judged as the server's refusal;
without it such a run fails).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from hybridfa_gate.cases import select_cases
from hybridfa_gate.judge import gate_problems
from hybridfa_gate.procs import ENGINE_TIMEOUT_S
from hybridfa_gate.report import markdown_report
from hybridfa_gate.run import run_matrix
from hybridfa_gate.specs import RunConfig

ARM = os.environ.get("HYBRIDFA_ARM", "patched")


def _lmcache_dir() -> Path:
    spec = importlib.util.find_spec("lmcache")
    if spec is None or spec.origin is None:
        pytest.skip("lmcache is not importable")
    return Path(spec.origin).resolve().parent.parent


@pytest.fixture(scope="module")
def report() -> dict:
    kv_gib = float(os.environ.get("HYBRIDFA_GATE_KV_CACHE_GIB", "0"))
    rc = RunConfig(
        arm=ARM,
        lmcache_dir=_lmcache_dir(),
        out=Path(os.environ.get("HYBRIDFA_GATE_OUT", "results")),
        jobs=int(os.environ.get("HYBRIDFA_GATE_JOBS", "1")),
        kv_cache_memory_bytes=int(kv_gib * 2**30) or None,
        engine_timeout=float(os.environ.get("HYBRIDFA_GATE_ENGINE_TIMEOUT") or ENGINE_TIMEOUT_S),
        expect_refusals=os.environ.get("HYBRIDFA_GATE_EXPECT_REFUSALS") == "1",
    )
    tp = int(os.environ.get("HYBRIDFA_GATE_TP", "1"))
    cases = select_cases(os.environ.get("HYBRIDFA_GATE_CASES", "quick"), tp)
    return {**run_matrix(cases, rc), "selected": [c.case_id for c in cases]}


@pytest.mark.gpu
def test_restart_gate(report: dict) -> None:
    problems = gate_problems(report, ARM)
    assert not problems, "\n".join(problems) + "\n" + markdown_report(report)
