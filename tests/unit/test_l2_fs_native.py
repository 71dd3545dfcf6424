"""A hybrid model over LMCache's native disk adapter (fs_native) fails closed.

fs_native publishes objects without a check a load can verify (LMCache#4991: failed
stores stay visible and are served; #4492: corrupted answers after a restart), and this
series' trailer and rename cover the Python ``fs`` adapter only. The patched server
therefore stores nothing for a hybrid layout when fs_native is among its L2 adapters,
and its lookups miss; a dense model keeps pristine behaviour. A whole CPU server
(restore_server) with the real FSNativeL2Adapter, stopped and restarted on one folder.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.v1.kv_cache_interface")
pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_native_l2_adapter")

from hybrid_kv import FA_LAYERS, build_fa_only_kv, build_hybrid_kv  # noqa: E402

N, PAGE, CHUNKS, NUM_BLOCKS = 80, 16, 3, 32
FA_GROUP = 3


def store_ids() -> list[list[int]]:
    return [[1 + g * CHUNKS + i for i in range(CHUNKS)] for g in range(4)]


def _settle(server, seconds: float = 1.0) -> None:
    import time

    time.sleep(seconds)  # fs_native writes in its own threads; give them time before the stop
    server.close()


@pytest.mark.fix
def test_a_hybrid_model_over_fs_native_never_restores_wrong_bytes(real_servers, tmp_path):
    l2 = tmp_path / "l2"
    tokens = list(range(1000, 1000 + CHUNKS * N + 1))
    src = build_hybrid_kv(N, PAGE, "NHD", NUM_BLOCKS, seed=0)
    server = real_servers(src, N, l2, False, l2_adapter="fs_native")
    server.store("store", tokens, store_ids())
    _settle(server)

    kv = build_hybrid_kv(N, PAGE, "NHD", NUM_BLOCKS, seed=1)
    server = real_servers(kv, N, l2, False, l2_adapter="fs_native")
    hit = server.lookup("restore", tokens[:-1])
    if hit == 0:
        return
    ids = [[0] * (hit - 1) + [20 + g] for g in range(3)] + [[28 - i for i in range(hit)]]
    server.retrieve("restore", tokens, 0, hit * N, ids)
    for layer in FA_LAYERS:
        for dst, s in zip(ids[FA_GROUP], store_ids()[FA_GROUP], strict=False):
            assert torch.equal(kv.block_bytes(layer, dst), src.block_bytes(layer, s)), (
                f"fs_native restored other bytes for FA layer {layer}"
            )


@pytest.mark.feature
def test_a_hybrid_model_over_fs_native_stores_nothing(real_servers, tmp_path):
    kv = build_hybrid_kv(N, PAGE, "NHD", NUM_BLOCKS)
    server = real_servers(kv, N, tmp_path / "l2", False, l2_adapter="fs_native")
    tokens = list(range(1000, 1000 + CHUNKS * N + 1))
    assert not server.store("store", tokens, store_ids())
    assert server.lookup("again", tokens[:-1]) == 0


def test_a_dense_model_over_fs_native_keeps_its_hits(real_servers, tmp_path):
    kv = build_fa_only_kv(16, "NHD", num_blocks=NUM_BLOCKS)
    server = real_servers(kv, 16, tmp_path / "l2", False, l2_adapter="fs_native")
    tokens = list(range(1000, 1000 + CHUNKS * 16 + 1))
    assert server.store("store", tokens, [[1, 2, 3]])
    assert server.lookup("again", tokens[:-1]) == CHUNKS
