"""The chunks a request completes while decoding are stored where vLLM retains their
recurrent state, from the block vLLM names, on the lmcache 0.5.6 base.

vLLM 0.29+ keeps the recurrent state of every block a hybrid request computes when it
drafts with MTP (its default prefix_cache_retention_interval, dense checkpointing), and
of the prompt's last boundary only otherwise. Each retained state is offered to the
connector with its block (``SchedulerOutput.kv_connector_block_state``); an align-mode
table relocates and nulls state slots, so the live table's slot is no such name. Pristine
0.5.6 stores prompt chunks only (unless ``lmcache.mp.save_decode_cache``), so a chat's
next turn restores less than vLLM's own prefix cache serves, and recomputes the rest.
This build stores a chunk past the prompt once every recurrent group offered its end
state, one step after the offer (the worker stores at the end of the forward pass; under
MTP the accepted tokens' states reach their blocks after it), from the offered blocks,
and never from a block vLLM hands out again in the step the store reads it.

vLLM side: the real KVCacheManager and its hand-off (vllm_sched_fakes); LMCache side: the
real scheduler-side connector.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

from vllm_sched_fakes import (  # noqa: E402
    BLOCK,
    FA_GROUP,
    MAMBA_GROUP,
    NULL_BLOCK_ID,
    SchedDriver,
    make_connector,
    make_kv_cache_config,
    prefill_split,
)

pytestmark = pytest.mark.bases("0.5.6")
CHUNK = 2 * BLOCK
PROMPT = 10 * BLOCK + 7  # its last whole chunk ends at 10N (chunk 4)


def _turn(
    monkeypatch: pytest.MonkeyPatch,
    retention: int | None,
    handed_out_again: set[int] | None = None,
) -> tuple[list[tuple[int, Any]], dict[int, tuple[int, int]]]:
    """A prompt prefilled as vLLM splits it under MTP (budget 2N - 1), then 60 tokens
    decoded. Returns (step, store op) pairs and {boundary: (step, block)} of the Mamba
    states vLLM offered at chunk ends past the prompt. ``handed_out_again``: blocks the connector is
    told vLLM hands out again in every step."""
    config = make_kv_cache_config(num_spec_blocks=1, num_blocks=256, retention_interval=retention)
    connector = make_connector(config, CHUNK, monkeypatch, fa_only_chunks=True)
    if handed_out_again:
        handed = connector._blocks_handed_out
        monkeypatch.setattr(
            connector, "_blocks_handed_out", lambda *a: handed(*a) | handed_out_again
        )
    driver = SchedDriver(config, connector)
    req = driver.add_request("r", list(range(1, 1 + PROMPT)))
    ops: list[tuple[int, Any]] = []
    offers: dict[int, tuple[int, int]] = {}

    def step(step_no: int, n: int) -> None:
        ops.extend((step_no, op) for op in driver.step({"r": n}).stores)
        for group, block, boundary in driver.offers.get("r", []):
            if group == MAMBA_GROUP and boundary > PROMPT and boundary % CHUNK == 0:
                offers[boundary] = (step_no, block)

    step_no = 0
    while req.num_computed_tokens < PROMPT:
        step(step_no, prefill_split(req, 2 * BLOCK - 1, mtp=True))
        step_no += 1
    for token in range(20_000, 20_060):
        req.append_output_token_ids(token)
        step(step_no, 1)
        step_no += 1
    return ops, offers


def _by_chunk(ops: list[tuple[int, Any]]) -> dict[int, tuple[int, int, int]]:
    """{chunk start: (step, its last Mamba block, its last FA block)} of every store."""
    out = {}
    for step_no, op in ops:
        for i, start in enumerate(range(op.start, op.end, CHUNK)):
            last = 2 * i + 1
            out[start] = (step_no, op.block_ids[MAMBA_GROUP][last], op.block_ids[FA_GROUP][last])
    return out


@pytest.mark.feature
def test_the_answers_chunks_are_stored_from_the_states_vllm_offers(monkeypatch) -> None:
    ops, offers = _turn(monkeypatch, retention=None)
    chunks = _by_chunk(ops)
    assert sorted(chunks) == list(range(0, 7 * CHUNK, CHUNK)), "prompt and answer chunks"
    assert sorted(offers) == [12 * BLOCK, 14 * BLOCK]
    for boundary, (offer_step, block) in offers.items():
        store_step, state_block, fa_block = chunks[boundary - CHUNK]
        assert state_block == block, f"the chunk ending at {boundary} reads the offered block"
        assert store_step == offer_step + 1, "read a step after vLLM offered it"
        assert fa_block != NULL_BLOCK_ID


def test_where_vllm_keeps_no_state_of_the_answer_its_chunks_are_not_stored(
    monkeypatch,
) -> None:
    """Sparse retention (vLLM 0.29's default without MTP): no offer past the prompt."""
    ops, offers = _turn(monkeypatch, retention=0)
    assert offers == {}
    assert sorted(_by_chunk(ops)) == list(range(0, 5 * CHUNK, CHUNK))


@pytest.mark.feature
def test_a_state_block_vllm_hands_out_again_is_not_read(monkeypatch) -> None:
    _, offers = _turn(monkeypatch, retention=None)
    reused = offers[12 * BLOCK][1]
    ops, _ = _turn(monkeypatch, retention=None, handed_out_again={reused})
    chunks = _by_chunk(ops)
    assert {10 * BLOCK, 12 * BLOCK} <= chunks.keys(), "the answer's chunks are stored"
    assert chunks[10 * BLOCK][1] == NULL_BLOCK_ID, "without that state (FA only)"
    assert chunks[12 * BLOCK][1] == offers[14 * BLOCK][1], "the next chunk keeps its own"
