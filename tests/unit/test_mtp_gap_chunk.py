"""Under MTP the prompt's last full block has no recurrent state: store its FA anyway.

vLLM 0.26's scheduler caches Mamba state one block before the prompt's last full block
at the latest when it drafts with MTP (``Scheduler._mamba_block_aligned_split`` backs
``last_cache_position`` off a block under ``use_eagle``) and runs the rest of the
prompt in one step, so that block's Mamba slot is null when its chunk is stored.
Revision 12 skipped such a chunk whole; the chunks a chat's answer completes during
decode then lay past a gap and a second turn could not reach them. A server that
advertises it (``FA_ONLY_CHUNKS_MARKER``) now gets the chunk with its null recurrent
block and stores its FA objects only. Real vLLM KVCacheManager and Scheduler split
rule, real scheduler-side connector (vllm_sched_fakes).
"""

from __future__ import annotations

from types import SimpleNamespace

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

pytestmark = pytest.mark.feature
CHUNK = 2 * BLOCK


def _chat_turn_one(monkeypatch, spec_blocks: int, fa_only_server: bool) -> list:
    """A 10-block + 7-token prompt at chunk 2N, prefilled as vLLM splits it with a
    budget of 2N - 1, then 40 tokens decoded; every store op."""
    config = make_kv_cache_config(num_spec_blocks=spec_blocks, num_blocks=256)
    connector = make_connector(config, CHUNK, monkeypatch, fa_only_chunks=fa_only_server)
    driver = SchedDriver(config, connector)
    prompt = 10 * BLOCK + 7
    req = driver.add_request("r", list(range(1, 1 + prompt)))
    ops = []
    while req.num_computed_tokens < prompt:
        n = prefill_split(req, 2 * BLOCK - 1, mtp=spec_blocks > 0)
        ops += driver.step({"r": n}).stores
    for token in range(20_000, 20_040):
        req.append_output_token_ids(token)
        ops += driver.step({"r": 1}).stores
    return ops


def _chunks(ops: list) -> list[int]:
    return sorted(t for op in ops for t in range(op.start, op.end, CHUNK))


def test_vllm_runs_the_prompts_last_full_block_without_a_state_under_mtp() -> None:
    req = SimpleNamespace(num_computed_tokens=9 * BLOCK, num_prompt_tokens=10 * BLOCK + 7)
    req.num_tokens, req.shared_prefix_boundary = req.num_prompt_tokens, 0
    assert prefill_split(req, 2 * BLOCK - 1, mtp=False) == BLOCK  # stops at 10N
    assert prefill_split(req, 2 * BLOCK - 1, mtp=True) == BLOCK + 7  # runs past it


def test_the_gap_chunk_is_stored_as_fa_only_where_the_server_can(monkeypatch) -> None:
    ops = _chat_turn_one(monkeypatch, spec_blocks=1, fa_only_server=True)
    assert _chunks(ops) == list(range(0, 6 * CHUNK, CHUNK))
    (gap,) = [op for op in ops if op.start <= 4 * CHUNK < op.end]
    i = (4 * CHUNK - gap.start) // CHUNK
    mamba = gap.block_ids[MAMBA_GROUP][i * 2 : i * 2 + 2]
    assert mamba[-1] == NULL_BLOCK_ID, "the gap chunk's state block is vLLM's null block"
    for op in ops:
        assert NULL_BLOCK_ID not in op.block_ids[FA_GROUP], f"op {op.start}-{op.end}"


def test_without_the_servers_word_the_gap_chunk_is_skipped(monkeypatch) -> None:
    ops = _chat_turn_one(monkeypatch, spec_blocks=1, fa_only_server=False)
    assert 4 * CHUNK not in _chunks(ops)
    for op in ops:
        last = op.block_ids[MAMBA_GROUP][1::2]
        assert NULL_BLOCK_ID not in last, f"op {op.start}-{op.end} sends a null state block"


def test_without_mtp_every_chunk_keeps_its_state(monkeypatch) -> None:
    ops = _chat_turn_one(monkeypatch, spec_blocks=0, fa_only_server=True)
    assert _chunks(ops) == list(range(0, 6 * CHUNK, CHUNK))
    for op in ops:
        assert NULL_BLOCK_ID not in op.block_ids[MAMBA_GROUP][1::2]
