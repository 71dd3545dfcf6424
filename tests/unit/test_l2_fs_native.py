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

pytest.importorskip("vllm.v1.kv_cache_interface")
pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_native_l2_adapter")

from hybrid_kv import build_fa_only_kv, build_hybrid_kv  # noqa: E402
from restore_server import BASE, BLOCKS, restored_blocks  # noqa: E402

N, PAGE, CHUNKS, NUM_BLOCKS = 80, 16, 3, 32


def store_ids() -> list[list[int]]:
    return [[1 + g * CHUNKS + i for i in range(CHUNKS)] for g in range(4)]


@pytest.mark.fix
def test_a_hybrid_model_over_fs_native_never_restores_wrong_bytes(real_servers, tmp_path):
    native = BASE.but(l2_adapter="fs_native")
    # restored_blocks fails on any restored byte that differs from the stored one
    assert restored_blocks(real_servers, tmp_path, native, native) in (0, BLOCKS)


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
