"""Stored evidence judged again. A report keeps no KV hashes, so ``judge.rejudge`` can only
recompute (c) and keep the rest: every committed gate report in results/ keeps the verdicts it
recorded, save those a later rule changed (CHANGED, each named with the rule), a guard against
a judge that drifts. Raw engine results (data/raw-engines, each engine's OUT file as
``engine_proc`` wrote it on a GPU, KV hashes and all) go through ``evaluate_case`` whole."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from hybridfa_gate.cases import select_cases
from hybridfa_gate.judge import evaluate_case, rejudge, verdict

RESULTS = Path(__file__).resolve().parents[2] / "results"
RAW = Path(__file__).resolve().parent / "data" / "raw-engines"
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


def _raw(case_id: str) -> tuple[Any, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A case and its cold, store and restore engines' results, as they ran."""
    (case,) = select_cases(case_id)
    roles = (
        json.loads((RAW / case_id / f"{r}.json").read_text()) for r in ("cold", "store", "restore")
    )
    return (case, *roles)


# A LoRA case on vLLM 0.27.1 (torch 2.13, an H100) with revision 16, whose server copied with
# LMCache's Python fallback (the compiled kernels did not load; revision 19 refuses that): its
# report (results/gpu-gate-2026-12-04T123042-patched-vllm0271.json) recorded a 4160-token
# hit of adapter A with 100 of 106 FA blocks and 2 of 6 compared recurrent checkpoints wrong,
# other tokens, and adapter B's request a miss with the cold engine's output.
LORA_FALLBACK = "qwen35-r5-NHD-c1N-offset-lora-other"


def test_a_raw_restore_replayed_fails_where_its_run_did() -> None:
    ev = evaluate_case(*_raw(LORA_FALLBACK), "patched")
    assert verdict(ev) == "fails (a) (b)" and ev["errors"] == []
    kv = {k: ev["kv"][k] for k in ("fa_blocks", "fa_bad", "gdn_blocks", "gdn_bad")}
    assert kv == {"fa_blocks": 106, "fa_bad": 100, "gdn_blocks": 6, "gdn_bad": 2}
    assert (ev["hit_tokens"], ev["required_hit"], ev["c"]) == (4160, 4081, True)
    assert ev["lora_b"]["hit_tokens"] == 0 and ev["lora_b"]["b"] and ev["lora_b"]["c"]


def test_the_replayed_restore_fails_a_by_its_kv_hashes() -> None:
    case, cold, store, restore = _raw(LORA_FALLBACK)
    restore["kv_hashes"] = store["kv_hashes"]  # the bytes the storing engine computed
    ev = evaluate_case(case, cold, store, restore, "patched")
    assert ev["a"] and ev["bytes_match"] and verdict(ev) == "fails (b)"
