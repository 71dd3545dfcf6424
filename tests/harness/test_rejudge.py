"""Stored reports judged again (judge.rejudge): every committed gate report in results/ keeps
the verdicts it recorded, so today's judge reads yesterday's evidence the same way, save the
verdicts a later rule changed (CHANGED, each named with the rule)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from hybridfa_gate.judge import rejudge, verdict

RESULTS = Path(__file__).resolve().parents[2] / "results"
REPORTS = sorted(RESULTS.glob("gpu-gate-*.json"))

# Verdicts a later rule changed, by report and case. Turn 2 on vLLM 0.29: (c) is bounded by
# vLLM's own prefix-cache hit (4160, turn 1's prompt), which the restore equalled.
CHANGED = {
    "gpu-gate-2026-12-05T141419-patched-vllm0290-base056": {
        "qwen35-r5-NHD-c1N-offset-turn2": "fails (a)"
    },
    "gpu-gate-2026-12-05T142529-patched-vllm0290-base056-turn2": {
        "qwen35-r5-NHD-c1N-offset-turn2": "fails (a)"
    },
}


def test_there_are_committed_reports() -> None:
    assert len(REPORTS) >= 10


@pytest.mark.parametrize("path", REPORTS, ids=lambda p: p.stem)
def test_a_committed_report_keeps_its_verdicts(path: Path) -> None:
    report = json.loads(path.read_text())
    recorded = {rec["case"]: verdict(rec["eval"]) for rec in report["cases"]}
    recorded.update(CHANGED.get(path.stem, {}))
    again = rejudge(copy.deepcopy(report))
    assert {rec["case"]: verdict(rec["eval"]) for rec in again["cases"]} == recorded


def _recorded_mtp_case(**ev: Any) -> dict[str, Any]:
    """One MTP case of an H200 run of 2026-12-01 (revision 12), as that run judged it: with
    (c) a block above what vLLM can hold a recurrent state for under MTP."""
    base = {"completed": True, "errors": [], "prompt_tokens": 4207, "hit_tokens": 4000}
    base.update(required_hit=4081, a=True, b=True, c=False, d=True, e=True, pass_=False)
    base.update(ev)
    base["pass"] = base.pop("pass_")
    case = {"case": "qwen35-r5-NHD-c2N-offset-mtp1", "model": "qwen35-r5", "tp": 1, "eval": base}
    case.update(geometry={"block_size": 80, "kernel_page": 16, "ratio": 5}, layout="NHD")
    case.update(chunk=160, prompt_tokens=4207)
    return {"arm": "patched", "date": "2026-12-01T180924", "cases": [case]}


def test_rejudge_judges_c_by_todays_promise_and_keeps_the_rest() -> None:
    ev = rejudge(_recorded_mtp_case())["cases"][0]["eval"]
    assert ev["required_hit"] == 4000 and ev["c"] and ev["pass"]
    assert ev["recorded"] == {"required_hit": 4081, "c": False, "pass": False}
    ev = rejudge(_recorded_mtp_case(b=False))["cases"][0]["eval"]
    assert ev["c"] and not ev["pass"]
    ev = rejudge(_recorded_mtp_case(hit_tokens=3840))["cases"][0]["eval"]
    assert not ev["c"] and not ev["pass"]
