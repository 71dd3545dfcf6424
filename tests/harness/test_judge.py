"""The criteria (a)-(e) and the verdicts (hybridfa_gate.judge), on engine results as
engine_proc reports them."""

from __future__ import annotations

from typing import Any

import pytest
from judge_fakes import engine, hashes, restored_case, timed_pairs

from hybridfa_gate import judge
from hybridfa_gate.cases import Case, select_cases
from hybridfa_gate.judge import evaluate_case


def test_compare_logprobs() -> None:
    a = [{"1": -0.5, "2": -1.0}, {"3": -0.1, "4": -2.0}]
    assert judge.compare_logprobs(a, a) == (True, 0.0)
    ok, diff = judge.compare_logprobs(a, [{"1": -0.5004, "2": -1.0}, {"3": -0.1, "4": -2.0}])
    assert ok and diff == pytest.approx(4e-4)
    assert not judge.compare_logprobs(a, [{"1": -0.51, "2": -1.0}, a[1]])[0]
    assert judge.compare_logprobs(a, [{"1": -0.5, "9": -1.0}, a[1]])[0] is False
    assert judge.compare_logprobs(a, a[:1])[0] is False


def test_compare_kv_hashes_equal_and_restored_checkpoint_covered() -> None:
    store = [hashes({"0": "a", "1": "b", "2": "c"}, {"0": "x", "1": "y"})]
    restore = [hashes({"0": "a", "1": "b", "2": "c"}, {"1": "y"})]  # nulls below the hit
    res = judge.compare_kv_hashes(store, restore, hit_tokens=160)
    assert res["match"] and res["fa_blocks"] == 3 and res["gdn_blocks"] == 1


def test_compare_kv_hashes_detects_wrong_fa_pages() -> None:
    store = [hashes({"0": "a", "1": "b"}, {"0": "x"})]
    restore = [hashes({"0": "a", "1": "B"}, {"0": "x"})]
    res = judge.compare_kv_hashes(store, restore, hit_tokens=80)
    assert not res["match"] and res["fa_bad"] == 1
    assert res["mismatches"] == ["rank0 fa l3 block 1"]


def test_compare_kv_hashes_requires_the_restored_gdn_checkpoint() -> None:
    store = [hashes({"0": "a"}, {"0": "x", "1": "y"})]
    restore = [hashes({"0": "a"}, {"0": "x"})]
    res = judge.compare_kv_hashes(store, restore, hit_tokens=160)  # hit block is 1
    assert not res["match"] and res["problems"]


def test_compare_kv_hashes_per_rank() -> None:
    store = [hashes({"0": "a"}, {}, 0), hashes({"0": "b"}, {}, 1)]
    assert judge.compare_kv_hashes(store, list(reversed(store)), 0)["match"]
    assert not judge.compare_kv_hashes(store, store[:1], 0)["match"]


def test_evaluate_case_pass_and_pristine_like_failure() -> None:
    case = Case("olmo-r5", "NHD", 1, False)
    p = case.prompt_tokens
    lps = [{"5": -1.0}]
    kv = [hashes({"0": "a"}, {str(p // 80 - 1): "x"})]
    cold = engine([5], lps, 2.0)
    store = engine([5], lps, 2.1, kv=kv)
    restore = engine([5], lps, 0.5, cached=p // 80 * 80, kv=kv)
    ev = evaluate_case(case, cold, store, restore)
    assert ev["pass"], ev
    bad_kv = [hashes({"0": "WRONG"}, {str(p // 80 - 1): "x"})]
    ev = evaluate_case(case, cold, store, engine([5], lps, 0.5, cached=p // 80 * 80, kv=bad_kv))
    assert ev["completed"] and ev["bytes_match"] is False and not ev["pass"]
    assert ev["b"] and ev["c"] and ev["d"] and ev["e"]
    assert judge.verdict(ev) == "fails (a)" and judge.pristine_shows_the_bug(ev)[0]


def test_d_times_prefill_by_first_token() -> None:
    """(d) compares prefill (TTFT), not TTFT plus the same decode steps on both sides."""
    case, cold, store, restore = restored_case(False, [0.4] * 3, [1.0] * 3)
    for pair in restore["timed_pairs"]:
        pair["restore"]["gen_s"], pair["cold"]["gen_s"] = 3.2, 1.5  # slow decode after a restore
    ev = evaluate_case(case, cold, store, restore)
    assert ev["d"] and (ev["restore_s"], ev["cold_same_engine_s"]) == (0.4, 1.0)
    _, _, _, slow = restored_case(False, [1.2] * 3, [1.0] * 3)
    assert not evaluate_case(case, cold, store, slow)["d"]


def test_d_leaves_the_measured_restore_out() -> None:
    """The measured restore is watched (its checkpoints copied as they complete): its TTFT
    carries the gate's own work and is reported, not timed."""
    case, cold, store, restore = restored_case(True, [0.17, 0.18, 0.17], [0.181] * 3)
    restore["ttft_s"] = 0.19
    ev = evaluate_case(case, cold, store, restore)
    assert ev["d"] and ev["measured_restore_s"] == 0.19
    assert ev["restore_runs_s"] == [0.17, 0.18, 0.17]


def test_d_compares_cold_prefills_of_the_restore_engine_only() -> None:
    case, cold, store, restore = restored_case(False, [0.8] * 3, [1.6] * 3)
    cold["ttft_s"] = 0.5  # another process, a quieter moment
    ev = evaluate_case(case, cold, store, restore)
    assert ev["d"] and ev["cold_same_engine_s"] == 1.6 and ev["cold_s"] == 0.5
    for pair in restore["timed_pairs"]:
        pair["cold"]["num_cached_tokens"] = 80  # none of them cold
    ev = evaluate_case(case, cold, store, restore)
    assert ev["cold_same_engine_s"] is None and not ev["d"]


def test_evaluate_case_reports_the_engines_first_restore() -> None:
    case, cold, store, restore = restored_case(False, [0.3] * 3, [0.5] * 3)
    hit = restore["num_cached_tokens"]
    restore["warm_first"] = {"restore": {"ttft_s": 1.4, "num_cached_tokens": hit}}
    ev = evaluate_case(case, cold, store, restore)
    assert ev["d"] and ev["first_restore_s"] == 1.4
    restore["warm_first"]["restore"]["num_cached_tokens"] = 0  # it restored nothing
    assert evaluate_case(case, cold, store, restore)["first_restore_s"] is None


def test_evaluate_case_criteria_c_d_and_errors() -> None:
    case = Case("olmo-r5", "NHD", 1, False)
    kv = [hashes({"0": "a"}, {})]
    cold = engine([5], [], 1.0)
    store = engine([5], [], 1.0, kv=kv)
    slow = engine([5], [], 1.5, cached=80, kv=kv)
    slow["timed_pairs"] = timed_pairs([1.5] * 3, [1.0] * 3, 80)
    ev = evaluate_case(case, cold, store, slow)
    assert not ev["c"] and not ev["d"] and not ev["pass"]
    ev = evaluate_case(case, cold, store, {"ok": False, "error": "boom"})
    assert not ev["completed"] and "restore: boom" in ev["errors"][0]
    wrong_geo = engine([5], [], 0.1, cached=case.prompt_tokens, kv=kv)
    wrong_geo["geometry"] = {"block_size": 48, "kernel_page": 16}
    ev = evaluate_case(case, cold, store, wrong_geo)
    assert not ev["pass"] and "geometry" in ev["errors"][0]


def test_an_engine_that_died_is_named_with_its_exception_not_its_frames() -> None:
    frames = "".join(f'  File "/x/f{i}.py", line {i}, in f\n    f()\n    ^^^\n' for i in range(60))
    died = {"ok": False, "error": f"Traceback (most recent call last):\n{frames}ValueError: no\n"}
    case = Case("olmo-r5", "NHD", 1, False)
    ev = evaluate_case(case, engine([5], [], 1.0), died, None)
    assert ev["errors"][:2] == ["store: ValueError: no", "restore: no result"]


def test_evaluate_case_without_a_hit_proves_nothing() -> None:
    """Seen on an H200: every store failed, the restore recomputed everything and the
    KV bytes matched trivially. That must not read as "bytes match" on either arm."""
    case = Case("qwen35-r5", "HND", 2, False)
    kv = [hashes({"0": "a"}, {"0": "g"})]
    cold = engine([5], [], 2.0)
    store = engine([5], [], 2.0, kv=kv)
    ev = evaluate_case(case, cold, store, engine([5], [], 1.0, cached=0, kv=kv))
    assert ev["bytes_match"] is None and not ev["a"] and not ev["pass"]
    assert any("no external hit" in e for e in ev["errors"])


def test_evaluate_case_needs_kv_hashes_from_every_tp_rank() -> None:
    case = Case("olmo-r5", "NHD", 1, False, tp=2)
    p = case.prompt_tokens
    gdn = {str(p // 80 - 1): "x"}
    one_rank = [hashes({"0": "a"}, gdn, 0)]
    both = [hashes({"0": "a"}, gdn, 0), hashes({"0": "b"}, gdn, 1)]
    cold = {**engine([5], [], 3.0), "ttft_s": 2.0}
    for kv, ok in ((both, True), (one_rank, False)):
        store = engine([5], [], 3.0, kv=kv)
        restore = {**engine([5], [], 1.0, cached=p // 80 * 80, kv=kv), "ttft_s": 0.5}
        ev = evaluate_case(case, cold, store, restore)
        assert ev["a"] is ok, ev["kv"]


def test_d_compares_medians_of_the_repeated_restores_and_cold_prefills() -> None:
    # Measured 2026-11-29: one restore against one cold prefill lost by 0.03 s under load, and
    # passed when rerun alone; one slow outlier on the restore side no longer decides (d).
    case, cold, store, restore = restored_case(True, [0.185, 0.11, 0.12], [0.155, 0.15, 0.16])
    ev = evaluate_case(case, cold, store, restore)
    assert ev["restore_runs_s"] == [0.185, 0.11, 0.12] and ev["restore_s"] == 0.12
    assert ev["cold_same_engine_runs_s"] == [0.155, 0.15, 0.16]
    assert ev["cold_same_engine_s"] == 0.155
    assert ev["d"] and not ev["errors"]
    restore["timed_pairs"] = restore["timed_pairs"][:1]  # one of each: the outlier decides
    assert not evaluate_case(case, cold, store, restore)["d"]


def test_a_repeat_that_restored_nothing_or_hit_a_cache_is_an_error() -> None:
    case, cold, store, restore = restored_case(False, [0.3, 0.9], [1.0, 0.2])
    restore["timed_pairs"][1]["restore"]["num_cached_tokens"] = 0
    restore["timed_pairs"][1]["cold"]["num_cached_tokens"] = 80
    ev = evaluate_case(case, cold, store, restore)
    assert ev["errors"] == [
        "repeat 2: its restore restored nothing",
        "repeat 2: its cold prefill hit a cache",
    ]
    assert not ev["pass"] and ev["restore_runs_s"] == [0.3]
    assert ev["cold_same_engine_runs_s"] == [1.0]


def test_c_counts_the_connectors_hit_not_the_engines_own_prefix_cache() -> None:
    case, cold, store, restore = restored_case(False, [0.5] * 3, [1.0] * 3)
    hit = restore["num_cached_tokens"]
    assert evaluate_case(case, cold, store, restore)["c"]
    # the same cached-token count, served by vLLM's own prefix cache and not LMCache
    local = {**restore, "external_cached_tokens": 0, "local_cached_tokens": hit}
    ev = evaluate_case(case, cold, store, local)
    assert ev["hit_tokens"] == 0 and not ev["c"] and not ev["pass"]
    assert any("own prefix cache served" in e for e in ev["errors"])


def _passing_evaluation() -> dict:
    case = Case("olmo-r5", "NHD", 1, False)
    p = case.prompt_tokens
    kv = [hashes({"0": "a"}, {str(p // 80 - 1): "x"})]
    cold, store = engine([5], [], 2.0), engine([5], [], 2.1, kv=kv)
    ev = evaluate_case(case, cold, store, engine([5], [], 0.5, cached=p // 80 * 80, kv=kv))
    assert ev["pass"], ev
    return ev


def _passing_engines(tp: int = 1) -> tuple[Case, dict, dict, dict]:
    case = Case("olmo-r5", "NHD", 1, False, tp)
    p = case.prompt_tokens
    gdn = {str(p // 80 - 1): "x"}
    kv = [hashes({"0": "a"}, gdn, rank) for rank in range(tp)]
    cold, store = engine([5], [], 2.0), engine([5], [], 2.1, kv=kv)
    return case, cold, store, engine([5], [], 0.5, cached=p // 80 * 80, kv=kv)


def test_an_engine_whose_fa_cache_shows_no_layout_is_an_error_where_it_could() -> None:
    case, cold, store, restore = _passing_engines()
    restore["observed_layout"] = None  # two kv heads per rank: the strides tell the layout
    ev = evaluate_case(case, cold, store, restore)
    assert not ev["pass"] and ev["errors"] == ["restore: its FA cache is laid out None, not NHD"]
    case, cold, store, restore = _passing_engines(tp=2)
    for r in (cold, store, restore):
        r["observed_layout"] = None  # one kv head per rank: no order to tell
    assert evaluate_case(case, cold, store, restore)["pass"]


def test_an_fa_cache_laid_out_otherwise_than_the_case_is_an_error() -> None:
    case, cold, store, restore = _passing_engines()
    store["observed_layout"] = "HND"
    ev = evaluate_case(case, cold, store, restore)
    assert not ev["pass"] and ev["errors"] == ["store: its FA cache is laid out HND, not NHD"]


def test_a_health_request_that_differs_from_the_cold_engines_fails_e() -> None:
    case, cold, store, restore = _passing_engines()
    restore["health"] = {"ok": True, "tokens": [1, 3]}
    ev = evaluate_case(case, cold, store, restore)
    assert ev["health_ok"] and not ev["health_matches_cold"]
    assert ev["e"] is False and not ev["pass"] and judge.verdict(ev) == "fails (e)"


def test_a_store_engine_whose_tokens_differ_from_the_cold_engines_is_an_error() -> None:
    case, cold, store, restore = _passing_engines()
    store["tokens"] = [6]
    ev = evaluate_case(case, cold, store, restore)
    assert not ev["pass"] and ev["errors"] == [
        "the store engine's tokens differ from the cold engine's"
    ]


def _graphs_engines(modes: dict[str, str | None]) -> dict:
    """A graphs case's evaluation, each engine having resolved ``modes[role]`` (None: none
    reported)."""
    _, cold, store, restore = _passing_engines()
    case = Case("olmo-r5", "NHD", 1, False, graphs=True)
    for role, r in (("cold", cold), ("store", store), ("restore", restore)):
        if (mode := modes.get(role, "FULL_AND_PIECEWISE")) is not None:
            worker = {"rank": 0, "cudagraph_mode": mode}
            r["compilation"] = {"cudagraph_mode": "FULL_AND_PIECEWISE", "workers": [worker]}
    return evaluate_case(case, cold, store, restore)


def test_a_graphs_case_passes_where_every_engine_ran_cuda_graphs() -> None:
    assert _graphs_engines({})["pass"]


def test_a_graphs_case_whose_engine_ran_eager_is_an_error() -> None:
    ev = _graphs_engines({"restore": "NONE"})
    assert not ev["pass"] and ev["errors"] == [
        "restore: vLLM resolved CUDA-graph mode NONE; the case asked CUDA graphs"
    ]


def test_a_graphs_case_whose_engine_reported_no_mode_is_an_error() -> None:
    ev = _graphs_engines({"cold": None})
    assert not ev["pass"] and ev["errors"] == [
        "cold: reported no CUDA-graph mode; the case asked for CUDA graphs"
    ]


def test_an_eager_case_whose_engine_ran_cuda_graphs_is_an_error() -> None:
    case, cold, store, restore = _passing_engines()
    store["compilation"] = {"cudagraph_mode": "PIECEWISE", "workers": []}
    ev = evaluate_case(case, cold, store, restore)
    assert ev["errors"] == ["store: vLLM resolved CUDA-graph mode PIECEWISE; the case asked eager"]


def test_a_case_with_failed_stores_does_not_pass() -> None:
    rec = {"server1": {"store_failures": 3}}
    assert not judge.add_errors(_passing_evaluation(), judge.run_errors(rec))["pass"]


def test_an_l2_folder_that_never_settled_is_an_error() -> None:
    rec = {"l2_after_store": {"objects": 2, "bytes": 10, "stable": False}}
    ev = judge.add_errors(_passing_evaluation(), judge.run_errors(rec))
    assert not ev["pass"] and "did not settle" in ev["errors"][-1]


def test_an_object_that_could_not_be_forged_is_an_error() -> None:
    ev = judge.add_errors(_passing_evaluation(), judge.run_errors({"forge_error": "no file"}))
    assert not ev["pass"] and ev["errors"] == ["no file"]


def test_a_pristine_case_that_stored_nothing_does_not_show_the_bug() -> None:
    shown, why = judge.pristine_shows_the_bug({"bytes_match": None})
    assert not shown and "restored nothing" in why
    assert judge.pristine_shows_the_bug({"bytes_match": False})[0]
    assert not judge.pristine_shows_the_bug({"bytes_match": True})[0]


# --- turn 2 ---------------------------------------------------------------------------------


def _turn2_engines(restore_kv: list, restore_tokens: list[int]) -> tuple[Any, dict, dict, dict]:
    case = Case("olmo-r5", "NHD", 2, False, turn=2)
    p2, hit = case.turn2_prompt_tokens, case.promisable_hit
    ref_kv = [hashes({"0": "a"}, {str(hit // 80 - 1): "x"})]
    cold = engine([5] * case.answer_tokens, [], 3.0)
    cold["turn2"] = {
        "tokens": [7],
        "logprobs": [],
        "kv_hashes": ref_kv,
        "local_cached_tokens": hit,
        "external_cached_tokens": 0,
    }
    # the storing engine's own turn-1 prompt: what turn 1 (wrongly) would compare against
    store = engine([5] * case.answer_tokens, [], 3.0, kv=[hashes({"0": "turn1"}, {})])
    restore = {**engine(restore_tokens, [], 0.5, cached=hit, kv=restore_kv), "ttft_s": 0.5}
    restore.update(external_cached_tokens=hit, local_cached_tokens=0)
    assert p2 > hit
    return case, cold, store, restore


def test_turn2_is_judged_against_vllms_own_prefix_cache() -> None:
    case, cold, store, restore = _turn2_engines([], [7])
    restore["kv_hashes"] = cold["turn2"]["kv_hashes"]
    ev = evaluate_case(case, cold, store, restore)
    assert ev["pass"], ev
    assert ev["reference_prefix_cache_hit"] == case.promisable_hit
    _, _, _, flipped = _turn2_engines(cold["turn2"]["kv_hashes"], [8])
    ev = evaluate_case(case, cold, store, flipped)
    assert ev["a"] and not ev["b"] and not ev["pass"]


def test_turn2_without_the_reference_turn_is_an_error() -> None:
    case, cold, store, restore = _turn2_engines([], [7])
    del cold["turn2"]
    ev = evaluate_case(case, cold, store, restore)
    assert "the reference engine did not run turn 2" in ev["errors"] and not ev["pass"]


def test_turn2_is_bounded_by_vllms_own_prefix_cache_hit() -> None:
    # vLLM 0.29 without MTP keeps no state of turn 1's decode-time block boundaries: its own
    # prefix cache serves turn 1's prompt blocks only, and so can a connector.
    case, cold, store, restore = _turn2_engines([], [7])
    own = case.prompt_tokens // 80 * 80
    bound = own // case.chunk * case.chunk
    assert bound < case.promisable_hit
    cold["turn2"]["local_cached_tokens"] = own
    restore["kv_hashes"] = cold["turn2"]["kv_hashes"]
    for hit, c in ((bound, True), (bound - case.chunk, False)):
        restore.update(external_cached_tokens=hit, num_cached_tokens=hit)
        ev = evaluate_case(case, cold, store, restore)
        assert ev["required_hit"] == bound and ev["c"] is c, ev


def test_turn2_under_mtp_is_bounded_by_vllms_own_prefix_cache_hit() -> None:
    case, cold, store, restore = _turn2_engines([], [7])
    mtp = Case("olmo-r5", "NHD", 2, False, spec_tokens=1, turn=2)
    own = case.promisable_hit - 80  # vLLM's own hit: a block short of the usual promise
    cold["turn2"]["local_cached_tokens"] = own
    restore["kv_hashes"] = cold["turn2"]["kv_hashes"]
    bound = own // mtp.chunk * mtp.chunk
    for hit, c in ((bound, True), (bound - mtp.chunk, False)):
        restore.update(external_cached_tokens=hit, num_cached_tokens=hit)
        ev = evaluate_case(mtp, cold, store, restore)
        assert ev["required_hit"] == bound and ev["c"] is c, ev
    cold["turn2"]["local_cached_tokens"] = 0
    ev = evaluate_case(mtp, cold, store, restore)
    assert not ev["pass"] and any("no bound for (c)" in e for e in ev["errors"])


# --- a miss by design: refused layouts, kv_cache_dtype changes -----------------------------


def _refused_evaluation(hit: int) -> dict:
    case = Case("olmo-r5", "NHD", 2, False, l2="fs_native")
    cold, store = engine([5], [], 2.0), engine([5], [], 2.1)
    restore = engine([5], [], 2.0, cached=hit)
    restore["timed_pairs"] = [{"restore": {"gen_s": 2.0, "num_cached_tokens": hit}}]
    return evaluate_case(case, cold, store, restore, "patched")


def test_a_refused_case_passes_on_a_miss_with_the_stored_prompts_tokens() -> None:
    ev = _refused_evaluation(0)
    assert ev["pass"] and judge.verdict(ev) == "refused (a miss)"
    assert ev["a"] is None and ev["d"] is None


def test_a_refused_case_with_a_hit_fails_c() -> None:
    ev = _refused_evaluation(320)
    assert not ev["pass"] and ev["c"] is False


def test_a_refusal_the_server_never_logged_or_that_stored_objects_is_an_error() -> None:
    rec = {"expect_refusal": True, "server1": {"refusals": 0}, "l2_after_kill": {"objects": 3}}
    errors = judge.run_errors(rec)
    assert len(errors) == 2 and judge.REFUSAL.pattern in errors[0]
    logged = {"expect_refusal": True, "server1": {"refusals": 1}, "l2_after_kill": {"objects": 0}}
    assert judge.run_errors(logged) == []


def _dtype_change(hit: int, restore_tokens: list[int]) -> dict:
    (case,) = select_cases("qwen35-r5-NHD-c1N-offset-fp8e4m3-to-fp8e5m2")
    geo = {"block_size": 144, "kernel_page": 16, "ratio": 9}
    lps = [{"5": -1.0}]
    cold = {**engine([5], lps, 2.0, kv=[hashes({"0": "e5m2"}, {}, n=144)]), "geometry": geo}
    store = {**engine([6], lps, 2.0, kv=[hashes({"0": "e4m3"}, {}, n=144)]), "geometry": geo}
    kv = [hashes({"0": "e5m2" if not hit else "e4m3"}, {}, n=144)]
    restore = {**engine(restore_tokens, lps, 1.0, cached=hit, kv=kv), "geometry": geo}
    return evaluate_case(case, cold, store, restore, "patched")


def test_a_kv_dtype_change_passes_on_a_miss_that_gives_the_cold_output() -> None:
    ev = _dtype_change(0, [5])
    assert ev["pass"] and judge.verdict(ev) == "pass (a miss)", ev
    assert ev["mode"] == "miss" and ev["a"] is None and ev["d"] is None
    # the store engine ran the other dtype: its tokens are reported, not judged
    assert ev["info"] == {"cold_tokens_match_store": False}


def test_a_kv_dtype_change_that_restores_fails_c_and_shows_the_bug_on_pristine() -> None:
    ev = _dtype_change(144 * 28, [6])
    assert not ev["pass"] and ev["c"] is False and ev["b"] is False
    assert judge.verdict(ev) == "fails (b) (c)"
    assert judge.pristine_shows_the_bug(ev) == (True, "fails (b) (c)")
    assert not judge.pristine_shows_the_bug(_dtype_change(0, [5]))[0]


# --- a forged object ------------------------------------------------------------------------


FORGED_CASE = Case("qwen35-r5", "NHD", 2, False, forged=True)
FULL = FORGED_CASE.promisable_hit


def _forged_restore(hit: int, fa: str) -> dict:
    """A restore engine of the forged case: ``hit`` tokens restored, FA block 1 hashed ``fa``
    (the storing engine's is "b")."""
    gdn = {str(hit // 80 - 1): "x"} if hit else {}
    return engine([5], [{"5": -1.0}], 1.0, cached=hit, kv=[hashes({"0": "a", "1": fa}, gdn)])


def _forged(hit: int, fa_restored: str, restart: dict | None = None, kept: bool = True) -> dict:
    """The forged case's evaluation; the restore after the second restart is ``restart``, by
    default a miss from the forged chunk on again (13 of 26 chunks restored)."""
    p = FORGED_CASE.prompt_tokens
    lps = [{"5": -1.0}]
    gdn = {str(t // 80 - 1): "x" for t in (p, hit, 160 * 13, FULL) if t}
    store_kv = [hashes({"0": "a", "1": "b"}, gdn)]
    cold, store = engine([5], lps, 2.0), engine([5], lps, 2.0, kv=store_kv)
    restore = _forged_restore(hit, fa_restored)
    again = _forged_restore(160 * 13, "b") if restart is None else restart
    return evaluate_case(
        FORGED_CASE, cold, store, restore, "patched", restart=again, forged_kept=kept
    )


def test_a_forged_object_passes_when_the_restore_stops_before_it() -> None:
    ev = _forged(160 * 13, "b")  # restored 13 of 26 chunks, the rest recomputed exactly
    assert ev["pass"] and ev["judged"] == "abce" and ev["d"] is None, ev
    assert not _forged(0, "b")["errors"]  # the first chunk forged: nothing restored, no error


def test_a_forged_object_that_is_restored_fails() -> None:
    ev = _forged(FULL, "FORGED")
    assert not ev["pass"] and ev["a"] is False and ev["c"] is False
    assert judge.pristine_shows_the_bug(ev)[0]


def test_a_forged_object_restored_after_the_next_restart_fails() -> None:
    """The forged payload, still in its file, sealed anew by a server that read it: the
    restore after the second restart takes it."""
    ev = _forged(160 * 13, "b", restart=_forged_restore(FULL, "FORGED"))
    assert ev["restart"]["a"] is False and ev["restart"]["c"] is False
    assert not ev["pass"] and judge.verdict(ev) == "fails (a) (c)"


def test_a_forged_case_without_its_restore_after_the_next_restart_is_an_error() -> None:
    ev = _forged(160 * 13, "b", restart={"ok": False, "error": "boom"})
    assert not ev["pass"] and ev["errors"] == ["restart: boom"]


def test_a_forged_object_the_first_restore_replaced_is_restored_whole_after_the_restart() -> None:
    ev = _forged(160 * 13, "b", restart=_forged_restore(FULL, "b"), kept=False)
    assert ev["pass"] and ev["restart"]["hit_tokens"] == FULL, ev
    # replaced, and still a miss: the tier lost a chunk it holds
    ev = _forged(160 * 13, "b", kept=False)
    assert not ev["pass"] and ev["restart"]["c"] is False


def test_the_restore_after_the_restart_gives_the_cold_engines_output() -> None:
    restart = _forged_restore(160 * 13, "b")
    restart["tokens"] = [6]
    ev = _forged(160 * 13, "b", restart=restart)
    assert ev["restart"]["b"] is False and judge.verdict(ev) == "fails (b)"


# --- LoRA -----------------------------------------------------------------------------------


def _lora(mode: str, b_hit: int, b_tokens: list[int], b_kv: str = "B") -> dict:
    case = Case("qwen35-r5", "NHD", 1, False, lora=mode)
    p = case.prompt_tokens
    hit = case.promisable_hit
    lps = [{"5": -1.0}]
    a_kv = [hashes({"0": "A"}, {str(p // 80 - 1): "x"})]

    def second(tokens: list[int], kv: str, cached: int) -> dict:
        b_kv = [hashes({"0": kv}, {str(hit // 80 - 1): "y"})]
        out = engine(tokens, lps, 1.0, cached=cached, kv=b_kv)
        return {**out, "lora": "B"}

    cold = {**engine([5], lps, 2.0), "second": second([9], "B", 0)}
    store = engine([5], lps, 2.0, kv=a_kv)
    if mode == "each":
        store["second"] = second([9], "B", 0)
    restore = engine([5], lps, 0.5, cached=hit, kv=a_kv)
    restore["second"] = second(b_tokens, b_kv, b_hit)
    return evaluate_case(case, cold, store, restore, "patched")


def test_lora_b_after_a_passes_on_a_miss_with_its_own_cold_output() -> None:
    ev = _lora("other", 0, [9])
    assert ev["pass"] and ev["lora_b"]["c"] and ev["lora_b"]["b"], ev


def test_lora_b_served_a_kv_fails_b_and_c() -> None:
    ev = _lora("other", 80 * 52, [5], b_kv="A")  # A's chunks restored into B's request
    assert not ev["pass"] and ev["b"] is False and ev["c"] is False
    assert judge.pristine_shows_the_bug(ev)[0]


def test_lora_each_adapter_restores_its_own_kv() -> None:
    hit = Case("qwen35-r5", "NHD", 1, False).promisable_hit
    assert _lora("each", hit, [9])["pass"]
    ev = _lora("each", hit, [9], b_kv="A")  # B restored A's bytes
    assert not ev["pass"] and ev["a"] is False
    assert not _lora("each", 0, [9])["pass"]  # B was stored: a miss fails (c)


def test_a_lora_case_without_bs_request_is_an_error() -> None:
    case = Case("qwen35-r5", "NHD", 1, False, lora="other")
    _, cold, store, restore = restored_case(False, [0.5] * 3, [1.0] * 3)
    ev = evaluate_case(case, cold, store, restore, "patched")
    assert not ev["pass"] and "adapter B's request did not run in every engine" in ev["errors"]


# --- the gate's verdict over a report (tests/gpu/test_restart_gate.py) ---------------------

PASS = {"completed": True, "pass": True, **dict.fromkeys("abcde", True)}


def _report(*evals: dict, selected: int | None = None) -> dict:
    cases = [{"case": f"c{i}", "eval": ev} for i, ev in enumerate(evals)]
    names = [f"c{i}" for i in range(len(evals) if selected is None else selected)]
    return {"cases": cases, "selected": names}


def test_every_selected_case_passing_is_a_pass() -> None:
    assert judge.gate_problems(_report(PASS, PASS), "patched") == []


def test_a_selected_case_that_did_not_run_fails_the_gate() -> None:
    assert judge.gate_problems(_report(PASS, selected=2), "patched") == ["c1: did not run"]


def test_a_refused_case_is_judged_on_b_c_e() -> None:
    refused = {**PASS, "refused": True, "a": None, "d": None}
    assert judge.gate_problems(_report(refused), "patched") == []


def test_a_pristine_or_control_case_that_restored_nothing_does_not_show_the_bug() -> None:
    nothing = {"completed": True, "pass": False, "bytes_match": None}
    for arm in ("pristine", "control"):
        assert "restored nothing" in judge.gate_problems(_report(nothing), arm)[0]


def test_a_refused_lora_case_passes_when_neither_adapter_restores() -> None:
    (case,) = select_cases("qwen35-r5-NHD-c2N-offset-lora-each")
    lps = [{"5": -1.0}]
    b = {**engine([9], lps, 1.0), "lora": "B"}
    cold = {**engine([5], lps, 2.0), "second": b}
    store = {**engine([5], lps, 2.0), "second": b}
    restore = {**engine([5], lps, 2.0), "second": b}
    restore["timed_pairs"] = [{"restore": {"gen_s": 2.0, "num_cached_tokens": 0}}]
    ev = evaluate_case(case, cold, store, restore, "patched", kernels=False)
    assert ev["mode"] == "refused" and ev["pass"], ev
    assert not evaluate_case(case, cold, store, restore, "patched")["pass"]
