"""The connector's tracked block ids must follow vLLM's live block table.

vLLM 0.26's MambaManager in mamba_cache_mode "align" rewrites a request's block table in
place without reporting a delta (vllm/v1/core/single_type_kv_cache_manager.py): with
speculative blocks it moves the running-state tail to a new slot and nulls the old one
(``allocate_new_blocks``), and it frees skipped state blocks and nulls their slots
(``remove_skipped_blocks``). Pristine LMCache 0.5.3 only appends the reported deltas, so
its ids go stale; a stale id makes a store read (or a retrieve write) a block that now
holds another state or another request's data.

Real vLLM ``KVCacheManager`` + real LMCache ``LMCacheMPConnector`` (scheduler role);
see vllm_sched_fakes.py for the scheduler-shaped driver.
"""

from __future__ import annotations

import pytest
from vllm_sched_fakes import (
    BLOCK,
    NULL_BLOCK_ID,
    SchedDriver,
    StepResult,
    make_connector,
    make_kv_cache_config,
)

pytestmark = pytest.mark.bases("0.5.3", "0.5.6")

SPEC_BLOCKS = [0, 1, 2]


def _driver(
    monkeypatch: pytest.MonkeyPatch, num_spec_blocks: int | None, chunk: int = BLOCK
) -> SchedDriver:
    config = make_kv_cache_config(num_spec_blocks)
    return SchedDriver(config, make_connector(config, chunk, monkeypatch))


def _check_step(driver: SchedDriver, req_id: str, result: StepResult, step: int) -> None:
    """Tracked ids == vLLM's table; every op uses exactly vLLM's ids, never a null."""
    vllm_table = driver.vllm_table(req_id)
    assert driver.tracked_table(req_id) == vllm_table, f"step {step}: stale tracked ids"
    for op in result.stores + result.retrieves:
        for group, ids in enumerate(op.block_ids):
            tokens_per_block = BLOCK  # every group of these configs
            expected = vllm_table[group][op.start // tokens_per_block : op.end // tokens_per_block]
            assert ids == expected, f"step {step}: op {op.start}-{op.end} group {group}"
            if op in result.stores:
                assert NULL_BLOCK_ID not in ids, f"step {step}: null block stored"


def _run(driver: SchedDriver, req_id: str, steps: list[int]) -> list[StepResult]:
    results = []
    for i, n in enumerate(steps):
        result = driver.step({req_id: n})
        _check_step(driver, req_id, result, i)
        results.append(result)
    return results


@pytest.mark.fix
@pytest.mark.parametrize("num_spec_blocks", SPEC_BLOCKS)
def test_tracked_ids_follow_vllm_one_block_prefill_steps(
    monkeypatch: pytest.MonkeyPatch, num_spec_blocks: int
) -> None:
    """One block per step (0.5.3's validated config): skipped states are nulled in place."""
    driver = _driver(monkeypatch, num_spec_blocks)
    driver.add_request("r", list(range(6 * BLOCK)))
    _run(driver, "r", [BLOCK] * 6)


@pytest.mark.fix
@pytest.mark.parametrize("num_spec_blocks", SPEC_BLOCKS)
def test_tracked_ids_follow_vllm_multi_block_prefill_steps(
    monkeypatch: pytest.MonkeyPatch, num_spec_blocks: int
) -> None:
    """Steps advancing 2 and 3 blocks: the speculative tail relocates, old slots are nulled."""
    driver = _driver(monkeypatch, num_spec_blocks)
    driver.add_request("r", list(range(8 * BLOCK)))
    _run(driver, "r", [BLOCK, 2 * BLOCK, 3 * BLOCK, 2 * BLOCK])


@pytest.mark.fix
@pytest.mark.parametrize("num_spec_blocks", SPEC_BLOCKS)
def test_stores_skip_null_chunks_and_store_each_chunk_once(
    monkeypatch: pytest.MonkeyPatch, num_spec_blocks: int
) -> None:
    """A chunk whose state slot vLLM nulled is never stored; no chunk is stored twice."""
    driver = _driver(monkeypatch, num_spec_blocks)
    driver.add_request("r", list(range(8 * BLOCK)))
    results = _run(driver, "r", [BLOCK, 3 * BLOCK, 2 * BLOCK, 2 * BLOCK])
    stored = [(op.start, op.end) for result in results for op in result.stores]
    flat = [t for start, end in stored for t in range(start, end, BLOCK)]
    assert len(flat) == len(set(flat)), f"a chunk was stored twice: {stored}"
    assert flat == sorted(flat)


@pytest.mark.fix
@pytest.mark.parametrize("num_spec_blocks", SPEC_BLOCKS)
def test_tracked_ids_follow_vllm_after_partial_prefix_cache_hit(
    monkeypatch: pytest.MonkeyPatch, num_spec_blocks: int
) -> None:
    """A second request hits 2.5 blocks of the first one's prefix (copy-on-write tail);
    from vLLM 0.33 the scheduler floors that hit to 2 blocks."""
    config = make_kv_cache_config(num_spec_blocks)
    driver = SchedDriver(config, make_connector(config, BLOCK, monkeypatch), BLOCK // 2)
    prompt = list(range(5 * BLOCK // 2))
    driver.add_request("a", prompt)
    _run(driver, "a", [BLOCK, BLOCK, BLOCK // 2])
    driver.finish("a")
    driver.add_request("b", prompt + [9] * (7 * BLOCK // 2))
    first = driver.step({"b": BLOCK // 2})
    hit = driver.requests["b"].num_computed_tokens - BLOCK // 2
    assert hit in (5 * BLOCK // 2, 2 * BLOCK), "expected a 2.5- or 2-block hit"
    _check_step(driver, "b", first, 0)
    _run(driver, "b", [BLOCK, 2 * BLOCK, BLOCK])


@pytest.mark.fix
@pytest.mark.parametrize("num_spec_blocks", SPEC_BLOCKS)
def test_tracked_ids_follow_vllm_across_preemption_and_resume(
    monkeypatch: pytest.MonkeyPatch, num_spec_blocks: int
) -> None:
    """Preempted mid-prefill, resumed (from its own cached prefix), then prefilled on."""
    driver = _driver(monkeypatch, num_spec_blocks)
    driver.add_request("r", list(range(10 * BLOCK)))
    _run(driver, "r", [BLOCK, 2 * BLOCK, BLOCK])
    driver.preempt("r")
    resumed = driver.step({"r": BLOCK})
    _check_step(driver, "r", resumed, 0)
    _run(driver, "r", [2 * BLOCK, BLOCK, BLOCK])


@pytest.mark.parametrize("steps", [[BLOCK] * 4, [BLOCK, 2 * BLOCK, 3 * BLOCK]])
def test_full_attention_only_tracks_reported_deltas(
    monkeypatch: pytest.MonkeyPatch, steps: list[int]
) -> None:
    """Non-hybrid model: tracked ids are exactly the appended deltas (pristine semantics)."""
    driver = _driver(monkeypatch, None)
    driver.add_request("r", list(range(8 * BLOCK)))
    results = []
    for i, n in enumerate(steps):
        result = driver.step({"r": n})
        assert driver.tracked_table("r") == driver.reported["r"]
        _check_step(driver, "r", result, i)
        results.append(result)
    stored = [(op.start, op.end) for result in results for op in result.stores]
    assert stored[0][0] == 0 and stored[-1][1] == sum(steps)


@pytest.mark.fix
@pytest.mark.parametrize("chunk_blocks", [1, 2])
def test_one_block_per_step_stores_every_chunk(
    monkeypatch: pytest.MonkeyPatch, chunk_blocks: int
) -> None:
    """0.5.3's validated config (one block per prefill step) loses no chunk to the resync."""
    driver = _driver(monkeypatch, 0, chunk=chunk_blocks * BLOCK)
    driver.add_request("r", list(range(8 * BLOCK)))
    results = _run(driver, "r", [BLOCK] * 8)
    stored = [(op.start, op.end) for result in results for op in result.stores]
    covered = [t for start, end in stored for t in range(start, end, BLOCK)]
    assert covered == list(range(0, 8 * BLOCK, BLOCK)), f"stored chunks: {stored}"
