"""Under MTP the prompt's last full block has no recurrent state: its chunk is stored as
its FA objects, on the lmcache 0.5.6 base.

vLLM 0.29+ caches Mamba state at the last block boundary one block before the prompt's
last full block when it drafts with MTP (``Scheduler._mamba_block_aligned_split``: the
eagle block drop) and runs the rest of the prompt in one step, so the Mamba slot of
that block stays vLLM's null block while its FA blocks are real. Pristine 0.5.6 skips a
chunk per object group only when every block of it is null: it stores such a chunk's
state from the null block (silently wrong state for a hit ending there). This build
stores the chunk without the object groups holding that state (its FA objects where
the state has object groups of its own, the default), says so in GET_EXPERIMENTAL, and
its connector then sends the chunk instead of passing over it: the chunks a chat's
answer completes during decode are no longer cut off behind a gap. A hit never ends at
the gap chunk; a longer one resumes from a later chunk's state across it.

Connector side: the real scheduler-side connector over vLLM's KVCacheManager with
vLLM's own split rule (vllm_sched_fakes). Server side: vLLM's own allocation
(vllm_kv_alloc), LMCache's real LMCacheDrivenTransferModule and cache context, the
storage manager a fake that records the keys it is asked to reserve; hits by LMCache's
own fold over what was stored.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

from test_layout_fingerprint_056 import MODEL, Server  # noqa: E402
from vllm_kv_alloc import build_registration, connector_view  # noqa: E402
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


def _chat_turn_one(
    monkeypatch: pytest.MonkeyPatch, spec_blocks: int, fa_only: bool, save_decode: bool = False
) -> list:
    """A 10-block + 7-token prompt at chunk 2N, prefilled as vLLM splits it with a
    budget of 2N - 1, then 40 tokens decoded; every store op. The prompt's last whole
    chunk is chunk 4 (its last full block, 10N, ends it)."""
    config = make_kv_cache_config(num_spec_blocks=spec_blocks, num_blocks=256)
    connector = make_connector(config, CHUNK, monkeypatch, fa_only_chunks=fa_only)
    connector._save_decode_cache = save_decode  # lmcache.mp.save_decode_cache
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


@pytest.mark.feature
def test_the_gap_chunk_is_sent_where_the_server_stores_it_as_fa(monkeypatch) -> None:
    from lmcache.v1.distributed.layout_namespace import FA_ONLY_CHUNKS_MARKER
    from lmcache.v1.multiprocess.modules.management import ManagementModule

    assert FA_ONLY_CHUNKS_MARKER in ManagementModule(SimpleNamespace()).get_experimental()
    ops = _chat_turn_one(monkeypatch, spec_blocks=1, fa_only=True)
    # The prompt's chunks, and the answer's first: vLLM retains its state under MTP (0022).
    assert _chunks(ops) == list(range(0, 6 * CHUNK, CHUNK))
    (gap,) = [op for op in ops if op.start <= 4 * CHUNK < op.end]
    i = (4 * CHUNK - gap.start) // CHUNK
    mamba = gap.block_ids[MAMBA_GROUP][i * 2 : i * 2 + 2]
    assert mamba[-1] == NULL_BLOCK_ID, "the gap chunk's state block is vLLM's null block"
    assert mamba[0] != NULL_BLOCK_ID, "and its earlier state block is real"
    for op in ops:
        assert NULL_BLOCK_ID not in op.block_ids[FA_GROUP], f"op {op.start}-{op.end}"


@pytest.mark.feature
def test_decode_chunks_past_the_gap_are_stored(monkeypatch) -> None:
    """With decode caching (lmcache.mp.save_decode_cache) the answer's chunks follow."""
    ops = _chat_turn_one(monkeypatch, spec_blocks=1, fa_only=True, save_decode=True)
    assert _chunks(ops) == list(range(0, 6 * CHUNK, CHUNK))


def test_without_the_servers_word_the_gap_chunk_is_not_sent(monkeypatch) -> None:
    """A server that would copy the null block as the chunk's state (one without the
    word; with --full-sw-kv the strict rule keeps it out too)."""
    ops = _chat_turn_one(monkeypatch, spec_blocks=1, fa_only=False)
    assert 4 * CHUNK not in _chunks(ops)
    for op in ops:
        last = op.block_ids[MAMBA_GROUP][1::2]
        assert NULL_BLOCK_ID not in last, f"op {op.start}-{op.end} sends a null state block"


def test_without_mtp_every_chunk_keeps_its_state(monkeypatch) -> None:
    ops = _chat_turn_one(monkeypatch, spec_blocks=0, fa_only=True, save_decode=True)
    assert _chunks(ops) == list(range(0, 6 * CHUNK, CHUNK))
    for op in ops:
        assert NULL_BLOCK_ID not in op.block_ids[MAMBA_GROUP][1::2]


# Server side: vllm_kv_alloc's 3:1 GDN:FA hybrid (engine groups 0-2 Mamba, 3 FA, 16-token
# blocks), chunks of 2 blocks; chunk GAP as MTP leaves it: FA real, its earlier state
# block real, its last state block null.
SERVER_CHUNK = 2 * 16
NUM_CHUNKS = 5
GAP = 3


def _engine_block_ids() -> list[list[int]]:
    """Per engine group, the block ids of NUM_CHUNKS chunks as align mode leaves them:
    every FA block real, per chunk the state's last block real (its first null), but
    the gap chunk's state in its first block only."""
    fa = list(range(1, 2 * NUM_CHUNKS + 1))
    state = [NULL_BLOCK_ID if j % 2 == 0 else b for j, b in enumerate(fa)]
    state[2 * GAP], state[2 * GAP + 1] = state[2 * GAP + 1], NULL_BLOCK_ID
    return [state, state, state, fa]


def _stored(monkeypatch: pytest.MonkeyPatch, separate_object_groups: bool | None):
    """Store NUM_CHUNKS chunks through the server; per object group, the chunks whose
    object it reserved, and the registration's attention windows."""
    from lmcache.v1.distributed.api import ipc_key_to_object_keys
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
    from lmcache.v1.multiprocess.group_view import expand_engine_block_ids
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as transfer

    reg = build_registration(16, 16, "LBNHC")
    server = Server(separate_object_groups=separate_object_groups)
    hashes = [bytes([c]) * 16 for c in range(NUM_CHUNKS)]
    reserved: list[Any] = []
    server.ctx.chunk_size = SERVER_CHUNK
    server.ctx.null_block_id = NULL_BLOCK_ID
    server.ctx.event_bus = SimpleNamespace(
        publish=lambda *_: None,
        publish_on_stream=lambda *_: None,
        has_subscribers=lambda *_: False,
    )
    server.ctx.resolve_obj_keys = lambda key, gids: ipc_key_to_object_keys(key, hashes, gids)
    server.ctx.storage_manager.reserve_write = lambda keys, *_, **__: reserved.extend(keys) or {}
    # Nothing is reserved, so nothing is copied (the CPU copy cannot address GDN views).
    monkeypatch.setattr(transfer, "transfer_kv_per_object_group", lambda *_, **__: None)
    try:
        server.register(1, reg)
        entry = server.module.get_and_touch_context_entry(1)
        backend = entry.event_backend
        handle = backend.export_event(
            backend.create_event(entry.cache_context.device), entry.cache_context.device
        )
        tokens = tuple(range(NUM_CHUNKS * SERVER_CHUNK))
        key = IPCCacheServerKey(MODEL, 1, 0, tokens, 0, len(tokens), "req-0")
        _, infos, _ = connector_view(reg)
        ids = expand_engine_block_ids(infos, _engine_block_ids())
        _, ok, _ = server.module.store_with_chunk_mask(key, 1, ids, handle)
        assert ok, "the store failed"
        manager = entry.cache_context.kv_layer_groups_manager
        windows = list(manager.get_attn_desc().num_chunks_in_sw)
        recurrent = [
            any(manager.kernel_groups[k].recurrent_state for k in g.kernel_group_indices)
            for g in manager.object_groups
        ]
        server.unregister(1)
    finally:
        server.module.close()
    chunks = [
        sorted(hashes.index(k.chunk_hash) for k in reserved if k.object_group_id == g)
        for g in range(len(windows))
    ]
    return chunks, windows, recurrent


@pytest.mark.fix
def test_the_gap_chunk_is_stored_without_its_state(monkeypatch) -> None:
    chunks, _, recurrent = _stored(monkeypatch, None)
    every = list(range(NUM_CHUNKS))
    for g, holds_state in enumerate(recurrent):
        if holds_state:
            assert GAP not in chunks[g], (
                f"object group {g} stores the gap chunk's state from vLLM's null block"
            )
            assert chunks[g] == [c for c in every if c != GAP], "and every other chunk's"
    assert every in [c for c, r in zip(chunks, recurrent, strict=True) if not r], (
        f"the FA objects of every chunk are stored: {chunks}"
    )


@pytest.mark.fix
def test_one_object_group_never_stores_the_gap_chunk(monkeypatch) -> None:
    """--no-separate-object-groups: the chunk's one object would hold the null state."""
    chunks, _, _ = _stored(monkeypatch, False)
    for g, stored in enumerate(chunks):
        assert GAP not in stored, f"object group {g} stores the gap chunk"
        assert stored == [c for c in range(NUM_CHUNKS) if c != GAP]


def _hit(chunks: list[list[int]], windows: list[int], num_chunks: int) -> int:
    """The hit (in chunks) of a prompt of ``num_chunks`` whole chunks, by LMCache's fold
    over what each object group stored (the lookup's rule)."""
    from lmcache.lmcache_native import Bitmap
    from lmcache.v1.distributed.bitmap_ops.fold import fold_unfold_grouped

    rows = []
    for stored in chunks:
        row = Bitmap(num_chunks)
        for c in stored:
            if c < num_chunks:
                row.set(c)
        rows.append(row)
    hit, _ = fold_unfold_grouped(rows, windows)
    return hit


@pytest.mark.fix
def test_a_hit_never_ends_at_the_gap_chunk(monkeypatch) -> None:
    chunks, windows, _ = _stored(monkeypatch, None)
    assert _hit(chunks, windows, GAP + 1) == GAP


def test_a_longer_hit_resumes_from_a_later_chunks_state(monkeypatch) -> None:
    chunks, windows, _ = _stored(monkeypatch, None)
    assert _hit(chunks, windows, NUM_CHUNKS) == NUM_CHUNKS
