"""A chunk stored without its recurrent state: FA objects only, and longer hits pass it.

Under MTP vLLM never computes the recurrent state at the prompt's last full block, so
that chunk reaches the server with vLLM's null block (id 0) as its recurrent block.
The server stores its FA objects and no recurrent-state object (it would hold the null
block's bytes): a hit cannot end at that chunk, and a longer hit resumes from a later
chunk's state across it. A whole LMCache server on CPU over an fs L2 folder
(restore_server), restarted on the same folder.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_cache_interface")
pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_l2_adapter")

from hybrid_kv import build_hybrid_kv  # noqa: E402
from restore_server import (  # noqa: E402
    BASE,
    BLOCKS,
    FA_GROUP,
    NUM_BLOCKS,
    N,
    restore_compared,
    store_ids,
    tokens,
)

pytestmark = pytest.mark.feature
GAP = 7  # the block (= chunk at chunk N) whose recurrent slots are vLLM's null block


def gap_ids() -> list[list[int]]:
    ids = store_ids()
    for g in range(FA_GROUP):
        ids[g][GAP] = 0
    return ids


def stored_with_a_gap(real_servers, l2):
    kv = build_hybrid_kv(N, BASE.page, BASE.layout, NUM_BLOCKS, seed=0)
    server = real_servers(kv, BASE.chunk, l2, **BASE.server_args)
    assert server.store("store", tokens(), gap_ids())
    server.wait_l2_objects(2 * BLOCKS - 1)
    objects = server.l2_objects()
    server.close()
    return kv, objects


def test_the_gap_chunk_has_no_recurrent_object(real_servers, tmp_path) -> None:
    _, objects = stored_with_a_gap(real_servers, tmp_path / "l2")
    assert objects == 2 * BLOCKS - 1  # FA of every chunk, state of all but the gap


def test_a_longer_hit_resumes_past_the_gap_byte_exactly(real_servers, tmp_path) -> None:
    src, _ = stored_with_a_gap(real_servers, tmp_path / "l2")
    assert restore_compared(real_servers, tmp_path / "l2", BASE, src, gap_ids()) == BLOCKS


def test_a_hit_never_ends_at_the_gap_chunk(real_servers, tmp_path) -> None:
    src, _ = stored_with_a_gap(real_servers, tmp_path / "l2")
    prompt = tokens()[: (GAP + 1) * N + 1]  # its last whole chunk is the gap
    hit = restore_compared(real_servers, tmp_path / "l2", BASE, src, gap_ids(), prompt)
    assert hit == GAP
