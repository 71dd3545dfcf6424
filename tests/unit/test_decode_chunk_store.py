"""Chunks completed during decode are stored, at every chunk multiple k·N.

In vLLM's mamba_cache_mode="align" only the block at the end of each step keeps its
recurrent state; the Mamba slots before it are nulled (freed) as the request advances.
A chunk of k blocks therefore holds null Mamba blocks but its last one, and the only
recurrent state a restore needs is that last block's. The connector must store such a
chunk when every FA block and its last Mamba block are real. Revision 9 of this series
skipped every chunk holding a null block, so it stored none of them at 2N and beyond;
pristine 0.5.3 stores them from its stale, never-nulled ids. Real vLLM KVCacheManager,
real scheduler-side connector (vllm_sched_fakes).
"""

from __future__ import annotations

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
)


def _decode(driver: SchedDriver, req_id: str, prompt_len: int, total: int) -> list:
    """Prefill ``prompt_len`` tokens in one step, then decode one token a step until
    ``total`` tokens are computed; the store ops of every step. A one-block prompt
    leaves every block's state in place at the end of its step."""
    req = driver.add_request(req_id, list(range(1, 1 + prompt_len)))
    ops = list(driver.step({req_id: -1}).stores)
    token = 10_000
    while req.num_computed_tokens < total:
        req.append_output_token_ids(token)
        token += 1
        ops += driver.step({req_id: 1}).stores
    return ops


def _assert_real_blocks(op: object, chunk: int) -> None:
    """Every FA block of a stored chunk is real, and so is its last Mamba block."""
    per_chunk = chunk // BLOCK
    assert NULL_BLOCK_ID not in op.block_ids[FA_GROUP], f"op {op.start}-{op.end}"
    last_blocks = op.block_ids[MAMBA_GROUP][per_chunk - 1 :: per_chunk]
    assert NULL_BLOCK_ID not in last_blocks, (
        f"op {op.start}-{op.end} stores a null block's state: {op.block_ids[MAMBA_GROUP]}"
    )


@pytest.mark.parametrize("k", [1, 2, 3, 4], ids=lambda k: f"chunk={k}N")
def test_chunks_completed_during_decode_are_stored_from_real_blocks(k, monkeypatch):
    chunk = k * BLOCK
    config = make_kv_cache_config(num_spec_blocks=0)
    driver = SchedDriver(config, make_connector(config, chunk, monkeypatch))
    ops = _decode(driver, "r", BLOCK, 2 * chunk + 1)
    for op in ops:
        _assert_real_blocks(op, chunk)
    stored = sorted((op.start, op.end) for op in ops)
    covered = [t for start, end in stored for t in range(start, end, chunk)]
    assert covered == [0, chunk], f"chunk {chunk}: stored {stored}, expected both chunks"
