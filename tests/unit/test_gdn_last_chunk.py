"""A restore reads GDN state for its last hit chunk only, and releases only the locks it took.

With ``--separate-object-groups`` a recurrent (Mamba/GDN) group is stored as its own
object group with a window of one block, so a restore after a restart reads the FA
objects of every hit chunk and the GDN object of the last one. Every test runs a whole
LMCache server on CPU (restore_server: real StorageManager, fs L2 folder, LookupModule,
LMCacheDrivenTransferModule) over the exact tensors vLLM 0.26 registers for a hybrid
GDN + FA model (hybrid_kv), and restarts it on the same folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm.v1.kv_cache_interface")
pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_l2_adapter")

from hybrid_kv import FA_LAYERS, NUM_LAYERS, HybridKV, build_hybrid_kv  # noqa: E402
from restore_server import ServerFactory  # noqa: E402

N, PAGE = 80, 16  # vLLM block of 5 FlashInfer kernel pages
NUM_CHUNKS = 3
FA_GROUP = 3  # engine group order: Mamba groups 0-2, FA group 3
NUM_BLOCKS = 32


def prompt(num_tokens: int) -> list[int]:
    return list(range(1000, 1000 + num_tokens))


def store_ids(blocks: int) -> list[list[int]]:
    """``blocks`` block ids per engine group, all from one pool (0 is the null block)."""
    return [[1 + g * blocks + i for i in range(blocks)] for g in range(4)]


def restore_ids(blocks: int) -> list[list[int]]:
    """What vLLM allocates for an external hit of ``blocks`` blocks in align mode: FA
    blocks from the pool, and Mamba slots null-padded except the last."""
    fa = [NUM_BLOCKS - 1 - i for i in range(blocks)]
    return [[0] * (blocks - 1) + [2 + g] for g in range(3)] + [fa]


def group_of(layer: int) -> int:
    return FA_GROUP if layer in FA_LAYERS else layer % 4


def snapshot(kv: HybridKV) -> dict[tuple[int, int], torch.Tensor]:
    return {
        (layer, b): kv.block_bytes(layer, b).clone()
        for layer in range(NUM_LAYERS)
        for b in range(kv.num_blocks)
    }


def fa_bytes(kv: HybridKV, chunk: int) -> int:
    return len(FA_LAYERS) * kv.page_bytes * chunk // kv.tokens_per_block


def gdn_bytes(kv: HybridKV) -> int:
    """One block's state for every GDN layer (a windowed object keeps one block)."""
    return (NUM_LAYERS - len(FA_LAYERS)) * kv.page_bytes


def stored(
    real_servers: ServerFactory,
    l2: Path,
    layout: str,
    chunk: int,
    separate: bool,
    page: int = PAGE,
) -> HybridKV:
    """Store NUM_CHUNKS chunks of ``prompt`` to ``l2`` and stop that server."""
    kv = build_hybrid_kv(N, page, layout, num_blocks=NUM_BLOCKS, seed=0)
    server = real_servers(kv, chunk, l2, separate)
    tokens = prompt(NUM_CHUNKS * chunk + 1)
    assert server.store("store", tokens, store_ids(NUM_CHUNKS * chunk // N))
    server.wait_l2_objects(NUM_CHUNKS * server.num_object_groups)
    server.close()
    return kv


def fa_object_group(server: Any) -> int:
    """Index of the full-attention object group (the other one holds the GDN groups)."""
    windows = server.ctx.layout_desc_registry.find_attn_desc("hybrid", 1).num_chunks_in_sw
    return windows.index(-1)


def restarted(
    real_servers: ServerFactory, tmp_path: Path, layout: str = "NHD", chunk: int = N
) -> tuple[HybridKV, HybridKV, Any]:
    """Store with --separate-object-groups, then start a new server and engine KV on the
    same folder: (stored KV, new KV, new server)."""
    l2 = tmp_path / "l2"
    src = stored(real_servers, l2, layout, chunk, separate=True)
    kv = build_hybrid_kv(N, PAGE, layout, num_blocks=NUM_BLOCKS, seed=1)
    return src, kv, real_servers(kv, chunk, l2, True)


def assert_gdn_state_restored(
    kv: HybridKV, src: HybridKV, ids: list[list[int]], stored_block: int
) -> None:
    """Every GDN layer's last destination block holds the stored state of block
    ``stored_block`` (an index into store_ids(NUM_CHUNKS))."""
    for layer in range(NUM_LAYERS):
        g = group_of(layer)
        if g != FA_GROUP:
            s = store_ids(NUM_CHUNKS)[g][stored_block]
            assert torch.equal(kv.block_bytes(layer, ids[g][-1]), src.block_bytes(layer, s))


# ---------------------------------------------------------------------------------
# bytes read by a restore


@pytest.mark.feature
@pytest.mark.parametrize("chunk", [N, 2 * N], ids=["chunk=N", "chunk=2N"])
def test_restore_loads_gdn_objects_of_the_last_hit_chunk_only(real_servers, tmp_path, chunk):
    _, kv, server = restarted(real_servers, tmp_path, chunk=chunk)
    tokens = prompt(NUM_CHUNKS * chunk + 1)

    hit = server.lookup("restore", tokens[:-1])

    assert hit == NUM_CHUNKS
    chunk_of = {
        key: (g, c)
        for g, keys in enumerate(server.object_keys(tokens, NUM_CHUNKS))
        for c, key in enumerate(keys)
    }
    loaded = sorted(chunk_of[key] for key, _ in server.reads.loads)
    expected = sorted(
        [(fa_object_group(server), c) for c in range(NUM_CHUNKS)]
        + [(1 - fa_object_group(server), NUM_CHUNKS - 1)]
    )
    assert loaded == expected, (
        f"the restore loaded (object group, chunk) {loaded}; FA objects of every hit chunk "
        f"and the GDN object of the last one are {expected}"
    )


@pytest.mark.feature
def test_restore_reads_fa_for_every_chunk_and_one_gdn_state(real_servers, tmp_path):
    _, kv, server = restarted(real_servers, tmp_path)
    tokens = prompt(NUM_CHUNKS * N + 1)

    hit = server.lookup("restore", tokens[:-1])

    assert hit == NUM_CHUNKS
    expected = NUM_CHUNKS * fa_bytes(kv, N) + gdn_bytes(kv)
    every_block = NUM_CHUNKS * (fa_bytes(kv, N) + gdn_bytes(kv))
    assert server.reads.nbytes == expected, (
        f"the restore read {server.reads.nbytes} bytes from disk: FA for {hit} chunks and "
        f"the GDN state at the hit boundary are {expected} (every block's state: "
        f"{every_block})"
    )


# ---------------------------------------------------------------------------------
# restored bytes


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("chunk", [N, 2 * N], ids=["chunk=N", "chunk=2N"])
@pytest.mark.parametrize("extra", [1, 0], ids=["prompt=3C+1", "prompt=3C"])
def test_restore_after_restart_is_bitwise(real_servers, tmp_path, layout, chunk, extra):
    """FA blocks of every hit chunk and the GDN state at the hit boundary are the stored
    bytes; nothing else changes. A prompt of exactly 3 chunks hits 2 (the last prompt token
    is never promised: it is recomputed), so the state is the one after chunk 2, not chunk 3."""
    src, kv, server = restarted(real_servers, tmp_path, layout, chunk)
    tokens = prompt(NUM_CHUNKS * chunk + extra)

    hit = server.lookup("restore", tokens[:-1])
    assert hit == (NUM_CHUNKS if extra else NUM_CHUNKS - 1)
    blocks = hit * chunk // N
    ids = restore_ids(blocks)
    before = snapshot(kv)
    assert server.retrieve("restore", tokens, 0, hit * chunk, ids)

    src_ids = store_ids(NUM_CHUNKS * chunk // N)
    written = set()
    for layer in range(NUM_LAYERS):
        g = group_of(layer)
        pairs = (
            list(zip(src_ids[g][:blocks], ids[g], strict=True))
            if g == FA_GROUP
            else [(src_ids[g][blocks - 1], ids[g][-1])]
        )
        for s, d in pairs:
            assert torch.equal(kv.block_bytes(layer, d), src.block_bytes(layer, s)), (
                f"layer {layer} (group {g}): block {d} is not the stored block {s}"
            )
            written.add((layer // 4, d))
    for (layer, b), old in before.items():
        if (layer // 4, b) not in written:
            assert torch.equal(kv.block_bytes(layer, b), old), (
                f"raw tensor {layer // 4}: block {b} was not a destination but changed"
            )


def test_missing_gdn_object_of_the_last_chunk_shortens_the_hit(real_servers, tmp_path):
    """FA objects of all chunks are on disk, the GDN object of the last one is not: the
    hit ends a chunk earlier, on a GDN state that exists."""
    src, kv, server = restarted(real_servers, tmp_path)
    tokens = prompt(NUM_CHUNKS * N + 1)
    gdn_keys = server.object_keys(tokens, NUM_CHUNKS)[0]
    (gone,) = [
        p
        for p in server.l2_dir.iterdir()
        if p.name.endswith(gdn_keys[-1].chunk_hash.hex() + ".data") and "@0@" in p.name
    ]
    gone.unlink()

    hit = server.lookup("restore", tokens[:-1])

    assert hit == NUM_CHUNKS - 1
    ids = restore_ids(hit)
    assert server.retrieve("restore", tokens, 0, hit * N, ids)
    assert_gdn_state_restored(kv, src, ids, hit - 1)


# ---------------------------------------------------------------------------------
# read locks


def test_no_read_lock_is_left_after_a_restore(real_servers, tmp_path):
    _, kv, server = restarted(real_servers, tmp_path)
    tokens = prompt(NUM_CHUNKS * N + 1)
    keys = [k for group in server.object_keys(tokens, NUM_CHUNKS) for k in group]

    hit = server.lookup("restore", tokens[:-1])
    assert server.retrieve("restore", tokens, 0, hit * N, restore_ids(hit))

    assert server.read_locked(keys) == [False] * len(keys)


def test_freeing_a_longer_hit_keeps_another_request_s_gdn_lock(real_servers, tmp_path):
    """Request B's hit ends at chunk 2, whose GDN object only B holds. Request A hits
    3 chunks, of which vLLM's own cache holds 2: its free_lookup_locks over chunks 0-1
    must not release B's GDN lock, or B's retrieve finds nothing."""
    src, kv, server = restarted(real_servers, tmp_path)
    tokens = prompt(NUM_CHUNKS * N + 1)
    short = tokens[: 2 * N] + [7]

    assert server.lookup("A", tokens[:-1]) == NUM_CHUNKS
    assert server.lookup("B", short[:-1]) == 2
    server.free_lookup_locks("A", tokens, 0, 2 * N)
    gdn_b = server.object_keys(tokens, 2)[0][1]
    assert server.read_locked([gdn_b]) == [True], "A released B's read lock"

    ids = restore_ids(2)
    assert server.retrieve("B", short, 0, 2 * N, ids)
    assert_gdn_state_restored(kv, src, ids, 1)


def test_l1_window_lock_is_released_when_l2_extends_the_hit(real_servers, tmp_path):
    """Chunks 0-1 are still in L1 and chunk 2 only on disk: the L1 hit's GDN lock on
    chunk 1 is superseded by chunk 2's and must not outlive the request."""
    l2 = tmp_path / "l2"
    kv = build_hybrid_kv(N, PAGE, "NHD", num_blocks=NUM_BLOCKS, seed=0)
    server = real_servers(kv, N, l2, True)
    tokens = prompt(NUM_CHUNKS * N + 1)
    assert server.store("store", tokens, store_ids(NUM_CHUNKS))
    server.wait_l2_objects(NUM_CHUNKS * server.num_object_groups)
    groups = server.object_keys(tokens, NUM_CHUNKS)
    deleted, _ = server.ctx.storage_manager.delete_l1_keys([g[-1] for g in groups], force=True)
    assert deleted == 2

    hit = server.lookup("restore", tokens[:-1])
    assert hit == NUM_CHUNKS
    assert server.retrieve("restore", tokens, 0, hit * N, restore_ids(hit))

    keys = [k for g in groups for k in g]
    assert server.read_locked(keys) == [False] * len(keys)
