"""What each engine of a case is asked to do (hybridfa_gate.specs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridfa_gate import lora, specs
from hybridfa_gate.cases import Case, select_cases
from hybridfa_gate.prompts import NEW_TOKENS, TURN2_QUESTION, prompt_key
from hybridfa_gate.specs import RunConfig, engine_spec, restore_spec, store_spec


@pytest.fixture
def rc(tmp_path: Path) -> RunConfig:
    return RunConfig(arm="patched", lmcache_dir=tmp_path, out=tmp_path)


def test_the_restore_engine_warms_up_on_other_prompts_before_the_timed_restore(
    tmp_path: Path, rc: RunConfig
) -> None:
    # Measured 2026-11-29: a fresh engine's first long request paid 0.7-2.5 s of one-time costs, so
    # the timed restore (first) lost (d) to the cold reference (after it) in every case.
    case = Case("olmo-r17", "NHD", 1, True)
    store = store_spec(case, tmp_path, rc, 1, tmp_path / "l2")
    restore = restore_spec(case, tmp_path, rc, 2)
    first, warm_cold = restore["warm_first"]["restore"], restore["warm_first"]["cold"]
    assert list(restore["warm_first"]) == ["restore", "cold"]  # in this order
    pairs = restore["timed_pairs"]
    assert len(pairs) == specs.D_REPEATS and all(list(p) == ["restore", "cold"] for p in pairs)
    # Every prompt the restore engine restores was stored, and the store waits for all of it.
    assert store["also_store"] == [first] + [p["restore"] for p in pairs]
    assert store["l2_min_objects"] == (1 + len(store["also_store"])) * (4352 // 544)
    prompts = [store["prompt"], *store["also_store"], warm_cold, *(p["cold"] for p in pairs)]
    assert restore["prompt"] == store["prompt"]
    assert {len(t) for t in prompts} == {case.prompt_tokens}
    assert len({tuple(t[:64]) for t in prompts}) == len(prompts)  # no two share a prefix block


def test_fixed_kv_cache_reaches_the_engine_spec(tmp_path: Path, rc: RunConfig) -> None:
    case = Case("olmo-r5", "NHD", 1, False)
    assert "kv_cache_memory_bytes" not in engine_spec(case, "cold", tmp_path, rc, None, None)
    rc.kv_cache_memory_bytes = 2**31
    spec = engine_spec(case, "cold", tmp_path, rc, None, None)
    assert spec["kv_cache_memory_bytes"] == 2**31


def test_engine_spec(tmp_path: Path, rc: RunConfig) -> None:
    case = Case("qwen35-r17", "HND", 2, False)
    spec = engine_spec(case, "store", tmp_path, rc, 5555, tmp_path / "l2")
    assert spec["max_num_batched_tokens"] == 2 * 544 - 1
    assert spec["language_model_only"] is True
    assert spec["lmcache"]["extra_config"]["lmcache.mp.port"] == 5555
    assert spec["prompt_key"] == prompt_key(spec["prompt"])
    assert spec["l2_min_objects"] == case.prompt_tokens // case.chunk
    assert "lmcache" not in engine_spec(case, "cold", tmp_path, rc, None, None)
    assert not {"kv_cache_dtype", "lora", "second", "l2_snapshot"} & set(spec)


def test_mtp_cases_ask_every_engine_for_speculative_decoding(tmp_path: Path, rc: RunConfig) -> None:
    case = Case("qwen35-r5", "HND", 1, True, spec_tokens=2)
    for role in ("cold", "store", "restore"):
        spec = engine_spec(case, role, tmp_path, rc, 1, None)
        assert spec["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    plain = Case("qwen35-r5", "HND", 1, True)
    assert "speculative_config" not in engine_spec(plain, "cold", tmp_path, rc, None, None)


def test_a_save_decode_case_asks_each_connector_to_store_decode_time_chunks(
    tmp_path: Path, rc: RunConfig
) -> None:
    (case,) = select_cases("decode")
    assert case.case_id == "qwen35-r5-HND-c2N-offset-mtp1-turn2-savedecode"
    for role in ("store", "restore"):
        extra = engine_spec(case, role, tmp_path, rc, 1, None)["lmcache"]["extra_config"]
        assert extra["lmcache.mp.save_decode_cache"] is True
    assert "lmcache" not in engine_spec(case, "cold", tmp_path, rc, None, None)
    plain = Case("qwen35-r5", "HND", 2, False, spec_tokens=1, turn=2)
    extra = engine_spec(plain, "store", tmp_path, rc, 1, None)["lmcache"]["extra_config"]
    assert "lmcache.mp.save_decode_cache" not in extra


def test_turn2_restores_the_prompt_plus_answer_plus_question(tmp_path: Path, rc: RunConfig) -> None:
    case = Case("olmo-r5", "NHD", 2, False, turn=2)
    answer = list(range(100, 100 + case.answer_tokens))
    cold = engine_spec(case, "cold", tmp_path, rc, None, None)
    assert cold["new_tokens"] == case.answer_tokens
    assert cold["turn2_question"] == list(TURN2_QUESTION)
    restore = restore_spec(case, tmp_path, rc, 1, answer)
    assert restore["prompt"] == cold["prompt"] + answer + list(TURN2_QUESTION)
    assert restore["prompt_key"] == prompt_key(restore["prompt"])
    assert {len(t) for p in restore["timed_pairs"] for t in p.values()} == {case.prompt_tokens}
    assert restore["max_model_len"] >= case.turn2_prompt_tokens + NEW_TOKENS
    assert case.turn2_prompt_tokens == len(restore["prompt"])


def test_a_refused_case_waits_for_no_stored_object(tmp_path: Path, rc: RunConfig) -> None:
    case = Case("olmo-r5", "NHD", 2, False, l2="fs_native")
    assert store_spec(case, tmp_path, rc, 1, tmp_path / "l2")["l2_min_objects"] == 0
    pristine = RunConfig(arm="pristine", lmcache_dir=tmp_path, out=tmp_path)
    assert store_spec(case, tmp_path, pristine, 1, tmp_path / "l2")["l2_min_objects"] > 0


def test_a_forged_case_refused_for_want_of_kernels_snapshots_nothing(
    tmp_path: Path, rc: RunConfig
) -> None:
    (case,) = select_cases("qwen35-r5-NHD-c2N-offset-forged")
    assert "l2_snapshot" in store_spec(case, tmp_path, rc, 1, tmp_path / "l2")
    rc.kernels = False
    spec = store_spec(case, tmp_path, rc, 1, tmp_path / "l2")
    assert spec["l2_min_objects"] == 0 and "l2_snapshot" not in spec


def test_a_kv_dtype_change_stores_under_one_dtype_and_restores_under_the_other(
    tmp_path: Path, rc: RunConfig
) -> None:
    (case,) = select_cases("qwen35-r5-NHD-c1N-offset-fp8e4m3-to-fp8e5m2")
    got = {
        role: engine_spec(case, role, tmp_path, rc, 1, None)["kv_cache_dtype"]
        for role in ("cold", "store", "restore")
    }
    assert got == {"cold": "fp8_e5m2", "store": "fp8_e4m3", "restore": "fp8_e5m2"}
    assert specs.cold_key(case) != specs.cold_key(
        Case("qwen35-r5", "NHD", 1, False, kv_dtype="fp8_e4m3")
    )


def test_a_lora_case_runs_a_then_b_where_each_is_meant_to_run(
    tmp_path: Path, rc: RunConfig
) -> None:
    adapters = {"A": "/a", "B": "/b"}
    other = Case("qwen35-r5", "NHD", 1, False, lora="other")
    each = Case("qwen35-r5", "HND", 2, False, lora="each")
    for case, stores_b in ((other, False), (each, True)):
        for role in ("cold", "store", "restore"):
            spec = engine_spec(case, role, tmp_path, rc, 1, None, adapters=adapters)
            assert spec["lora"] == {"max_lora_rank": lora.RANK, "adapters": adapters}
            assert spec["prompt_lora"] == "A"
            runs_b = role != "store" or stores_b
            assert spec.get("second") == ({"lora": "B"} if runs_b else None), (case, role)
    assert specs.cold_key(other) != specs.cold_key(Case("qwen35-r5", "NHD", 1, False))


def test_a_forged_case_lists_the_prompts_objects_after_a_warmup_that_stores_none(
    tmp_path: Path, rc: RunConfig
) -> None:
    case = Case("qwen35-r5", "NHD", 2, False, forged=True)
    spec = store_spec(case, tmp_path, rc, 1, tmp_path / "l2")
    assert len(spec["warmup"]) < case.chunk
    assert spec["l2_snapshot"] == {"min_objects": case.prompt_tokens // case.chunk}
    restore = restore_spec(case, tmp_path, rc, 2)
    assert "l2_snapshot" not in restore and len(restore["warmup"]) > case.chunk


def test_a_graphs_case_runs_every_engine_as_vllm_defaults_it(tmp_path: Path, rc: RunConfig) -> None:
    (case,) = select_cases("olmo-r5-NHD-c1N-offset-graphs")
    for role in ("cold", "store", "restore"):
        assert engine_spec(case, role, tmp_path, rc, 1, None)["enforce_eager"] is False
    eager = Case("olmo-r5", "NHD", 1, False)
    assert "enforce_eager" not in engine_spec(eager, "cold", tmp_path, rc, 1, None)
    assert specs.cold_key(case) != specs.cold_key(eager)  # one cold engine each
