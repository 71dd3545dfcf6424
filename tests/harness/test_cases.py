"""Gate cases and case sets (hybridfa_gate.cases) and their prompts (hybridfa_gate.prompts)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from hybridfa_gate import cases, prompts
from hybridfa_gate.cases import Case, select_cases
from hybridfa_gate.models import expected_geometry


def test_make_prompt_is_deterministic_with_a_buried_key() -> None:
    a = prompts.make_prompt(4207, seed=1)
    assert a == prompts.make_prompt(4207, seed=1)
    assert a != prompts.make_prompt(4207, seed=2)
    assert len(a) == 4207
    assert all(prompts.TOKEN_LO <= t < prompts.TOKEN_HI for t in a)
    start = 4207 // 2 - prompts.KEY_LEN // 2
    key = a[start : start + prompts.KEY_LEN]
    assert max(key) - min(key) < 64  # the narrow-band run
    assert prompts.prompt_key(a) == prompts.prompt_key(list(a))
    assert prompts.prompt_key(a) != prompts.prompt_key(a[:-1])


@pytest.mark.parametrize(
    "n,chunk_blocks", [(80, 1), (80, 2), (544, 1), (544, 2), (1600, 1), (1600, 2)]
)
def test_prompt_lengths(n: int, chunk_blocks: int) -> None:
    c = n * chunk_blocks
    exact = prompts.prompt_length(n, c, exact=True)
    assert exact % c == 0 and exact >= prompts.MIN_PROMPT_TOKENS
    p = prompts.prompt_length(n, c, exact=False)
    assert p % n != 0
    assert prompts.max_promisable_hit(p, c) >= prompts.HIT_FRACTION * p
    assert prompts.required_hit(p, c) >= prompts.HIT_FRACTION * p
    # exact multiple: the last chunk is recomputed, so at most (m-1)*C can be required
    assert prompts.required_hit(exact, c) == min(math.ceil(prompts.HIT_FRACTION * exact), exact - c)
    assert exact // c >= prompts.EXACT_MIN_CHUNKS  # at least 3/4 of it restorable


def test_case_selection() -> None:
    quick, every, full = (select_cases(s) for s in ("quick", "all", "full"))
    assert len(quick) == 3 and len(every) == 18 and len(full) == 48
    assert len({c.case_id for c in full}) == 48
    assert set(quick) <= set(full) and set(every) <= set(full)
    assert {c.geometry.ratio for c in every} == {5, 17, 25}
    assert {c.layout for c in every} == {"NHD", "HND"}
    assert {c.chunk_blocks for c in every} == {1, 2}
    assert {c.exact for c in every} == {True, False}
    assert {c.spec.family for c in every} == {"olmo_hybrid", "qwen3_5"}
    picked = select_cases("olmo-r5-NHD-c1N-offset,qwen35-r25-.*-exact")
    assert [c.case_id for c in picked] == [
        "olmo-r5-NHD-c1N-offset",
        "qwen35-r25-NHD-c1N-exact",
        "qwen35-r25-NHD-c2N-exact",
        "qwen35-r25-HND-c1N-exact",
        "qwen35-r25-HND-c2N-exact",
    ]
    with pytest.raises(ValueError):
        select_cases("nope")
    assert select_cases("quick", tp=2)[0].case_id.endswith("-tp2")


def test_every_case_id_names_one_case() -> None:
    every = cases.named_cases()
    assert len({c.case_id for c in every}) == len(every)
    for name in cases.SET_NAMES:
        assert {c.case_id for c in select_cases(name)} <= {c.case_id for c in every}


def test_core_matrix_covers_every_dimension_per_ratio() -> None:
    core = select_cases("core")
    assert len(core) == 6 and set(core) <= set(select_cases("full"))
    for ratio in (5, 17, 25):
        mine = [c for c in core if c.geometry.ratio == ratio]
        assert {c.layout for c in mine} == {"NHD", "HND"}
        assert {c.chunk_blocks for c in mine} == {1, 2}
        assert {c.exact for c in mine} == {True, False}
    for family in ("olmo_hybrid", "qwen3_5"):
        assert {c.layout for c in core if c.spec.family == family} == {"NHD", "HND"}


def test_deployment_cases_name_their_backend_and_batch() -> None:
    by_id = {c.case_id: c for c in select_cases("deploy")}
    fa = by_id["olmo-r5-NHD-c1N-offset-fa"]
    assert (fa.geometry.kernel_page, fa.geometry.ratio) == (80, 1)
    assert by_id["olmo-r5-NHD-c1N-offset-mbtN"].max_num_batched_tokens == 80
    assert select_cases("olmo-r5-NHD-c3N-offset")[0].chunk == 240
    assert Case("olmo-r5", "NHD", 1, False).max_num_batched_tokens == 159


def test_an_mtp_case_has_the_geometry_of_its_longer_conv_state() -> None:
    case = Case("qwen35-r5", "NHD", 2, False, spec_tokens=1)
    assert case.case_id == "qwen35-r5-NHD-c2N-offset-mtp1"
    assert case.geometry == expected_geometry(case.spec, 1, 1)
    assert {c.spec_tokens for c in select_cases("mtp")} == {1, 2}


@pytest.mark.parametrize("case", cases.turn2_matrix(), ids=lambda c: c.case_id)
def test_turn2_answer_ends_where_prefix_cache_and_chunks_agree(case: Any) -> None:
    n, c = case.geometry.block_size, case.chunk
    kv_tokens = case.prompt_tokens + case.answer_tokens - 1
    own = kv_tokens // n * n - (n if case.spec_tokens else 0)  # vLLM's own full-block hit
    assert case.answer_tokens >= 2 * c
    assert own % c == 0 and kv_tokens - own < n + c  # it ends on a chunk boundary
    assert own == case.promisable_hit
    assert case.promisable_hit >= prompts.HIT_FRACTION * case.turn2_prompt_tokens - n


@pytest.mark.parametrize(
    ("case_id", "promise"),
    [
        ("qwen35-r5-NHD-c2N-offset-mtp1", 4000),  # not 4160: no state at 4160 (block 52's end)
        ("qwen35-r17-NHD-c1N-offset-mtp2", 8704),  # not 9248
        ("qwen35-r5-HND-c1N-exact-mtp2", 4080),  # an exact prompt: the last chunk anyway
    ],
)
def test_under_mtp_the_promise_ends_a_block_before_the_prompts_last_full_block(
    case_id: str, promise: int
) -> None:
    """Seen on an H200 (vLLM 0.26.0): under MTP the scheduler ends no prefill step at the
    prompt's last full block, so that block's recurrent state never exists."""
    (case,) = select_cases(case_id)
    assert case.promisable_hit == promise
    plain = Case(case.model, case.layout, case.chunk_blocks, case.exact)
    assert plain.promisable_hit >= promise


def test_l2_cases_name_their_adapter_and_only_patched_refuses_fs_native() -> None:
    by_id = {c.case_id: c for c in select_cases("l2")}
    assert {c.l2 for c in by_id.values()} == {"resp", "fs_native"}
    native = by_id["olmo-r5-NHD-c2N-offset-fsnative"]
    assert native.refused_by("patched") and not native.refused_by("pristine")
    assert not by_id["olmo-r5-NHD-c1N-offset-resp"].refused_by("patched")


# --- the fp8, identity and seed sets --------------------------------------------------------


def test_fp8_cases_cover_both_backends_and_layouts_at_the_fp8_geometry() -> None:
    fp8 = select_cases("fp8")
    assert {c.backend for c in fp8} == {"FLASHINFER", "FLASH_ATTN"}
    assert {c.layout for c in fp8} == {"NHD", "HND"}
    assert all(c.kv_dtype.startswith("fp8") and c.mode("patched") == "restore" for c in fp8)
    # FlashAttention takes fp8_e4m3 only (FA3 on SM90)
    assert {c.kv_dtype for c in fp8 if c.backend == "FLASH_ATTN"} == {"fp8_e4m3"}
    case = select_cases("qwen35-r5-NHD-c1N-offset-fp8e4m3")[0]
    assert case.geometry == expected_geometry(case.spec, kv_cache_dtype="fp8_e4m3")
    assert case.geometry.block_size == 144 and case.chunk == 144


def test_a_kv_dtype_change_is_a_miss_on_every_arm_and_keeps_the_geometry() -> None:
    (case,) = select_cases("qwen35-r5-NHD-c1N-offset-fp8e4m3-to-fp8e5m2")
    assert case.mode("patched") == case.mode("pristine") == "miss"
    assert case.kv_cache_dtype("store") == "fp8_e4m3"
    assert case.kv_cache_dtype("cold") == case.kv_cache_dtype("restore") == "fp8_e5m2"
    with pytest.raises(ValueError, match="element size"):
        Case("qwen35-r5", "NHD", 1, False, kv_dtype="fp8_e4m3", restore_kv_dtype="bfloat16")


def test_identity_cases_and_their_modes() -> None:
    by_id = {c.case_id: c for c in select_cases("identity")}
    assert {c.lora for c in by_id.values()} == {"", "other", "each"}
    forged = [c for c in by_id.values() if c.forged]
    assert forged and all(c.mode("patched") == c.mode("pristine") == "forged" for c in forged)
    for c in forged:  # the forger tells a chunk's FA object from its GDN object by size
        assert c.fa_object_bytes != c.gdn_object_bytes
    assert by_id["qwen35-r5-NHD-c1N-offset-lora-other"].mode("patched") == "restore"
    with pytest.raises(ValueError, match="Qwen3.5"):
        Case("olmo-r5", "NHD", 1, False, lora="other")
    with pytest.raises(ValueError, match="fs tier"):
        Case("olmo-r5", "NHD", 1, False, l2="resp", forged=True)


def test_the_seed_geometry_is_25_pages_of_64_in_a_block_of_1600_chunked_per_block() -> None:
    seed = select_cases("seed")
    assert {(c.geometry.block_size, c.geometry.kernel_page, c.geometry.ratio) for c in seed} == {
        (1600, 64, 25)
    }
    assert {c.chunk for c in seed} == {1600} and {c.backend for c in seed} == {"FLASHINFER"}
    assert {c.server_args for c in seed} == {(), ("--separate-object-groups",)}
    assert {c.case_id for c in seed if c.separate_groups} == {
        "qwen35-r25-NHD-c1N-offset-sog",
        "qwen35-r25-HND-c1N-exact-sog",
    }


def test_new_fields_leave_every_earlier_case_id_as_it_was() -> None:
    plain = Case("olmo-r5", "NHD", 1, False)
    assert plain.case_id == "olmo-r5-NHD-c1N-offset"
    assert plain.mode("patched") == "restore" and plain.server_args == ()
    assert plain.kv_cache_dtype("restore") == "auto"


def test_without_compiled_kernels_the_patched_server_refuses_every_case() -> None:
    """A CUDA server whose compiled copy kernels did not load (torch 2.13 under the 0.5.3
    base) refuses every hybrid layout on either base; pristine serves it on the fallback."""
    for case in select_cases("quick") + select_cases("identity"):
        for base in ("0.5.3", "0.5.6"):
            assert case.refused_by("patched", base, kernels=False), case.case_id
            assert not case.refused_by("pristine", base, kernels=False), case.case_id


def test_the_graphs_set_runs_core_like_cases_and_mtp_with_cuda_graphs() -> None:
    graphs = select_cases("graphs")
    assert all(c.graphs and c.case_id.endswith("-graphs") for c in graphs)
    assert {c.layout for c in graphs} == {"NHD", "HND"}
    assert {c.spec.family for c in graphs} == {"olmo_hybrid", "qwen3_5"}
    assert any(c.spec_tokens for c in graphs) and {c.exact for c in graphs} == {True, False}
    # the same settings run eager elsewhere: only the graphs set's ids carry the suffix
    eager = {c.case_id for c in cases.named_cases() if not c.graphs}
    assert {c.case_id.removesuffix("-graphs") for c in graphs} <= eager
