"""Subpaged full attention under the HND layout, on the lmcache 0.5.6 base.

0.5.6 re-views a kernel-paged FA tensor (FlashInfer pages a logical block of N tokens as
N / page kernel pages) as whole logical blocks, but always NHD-ordered: under HND the
format detector reads dim 2 as heads and dim 3 as the block, so the group reads as N heads
of a 1-slot block, a "compressed" group whose CUDA copy kernel is launched with N rows of
threads, past the 1024-thread limit at N = 544: nothing is stored. The KV cache here is
allocated by vLLM's own code (vllm_kv_alloc) with each resolved layout; the CPU copy path
has no thread limit, so the tests check the group geometry, the launch shape the CUDA
kernel would get, and the bytes of a store and restore through LMCache's transfer code.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

from vllm_kv_alloc import (  # noqa: E402
    FA_LAYERS,
    block_bytes,
    build_registration,
    copy_fa_block,
    layer_name,
    register,
)

pytestmark = pytest.mark.bases("0.5.6")

GEOMETRIES = [(80, 16), (544, 32), (1600, 64)]  # (N, FlashInfer page): ratios 5, 17, 25
MAX_THREADS_PER_BLOCK = 1024  # CUDA limit, also the limit of blockDim.y


def cuda_block_dims(group) -> tuple[int, int]:
    """blockDim of the multi-layer block copy kernel: x = min(head bytes / copy unit,
    32), y = heads; the copy unit is 16, 4 or 2 bytes. A model of that launch, written
    from the kernel's source: no kernel runs on a CPU box, so a test of it checks the
    group geometry the launch is computed from."""
    sd = group.shape_desc
    head_bytes = sd.hs * sd.element_size
    unit = next(u for u in (16, 4, 2) if head_bytes % u == 0)
    return min(head_bytes // unit, 32), sd.nh


def _kernel_groups(tokens_per_block: int, page: int, layout: str) -> list:
    ctx, _ = register(build_registration(tokens_per_block, page, layout), tokens_per_block)
    return ctx.kv_layer_groups_manager.kernel_groups


@pytest.mark.parametrize(
    ("tokens_per_block", "page", "layout"),
    [(n, p, "LBNHC") for n, p in GEOMETRIES]
    + [pytest.param(n, p, "LBHNC", marks=pytest.mark.fix) for n, p in GEOMETRIES]
    + [(n, p, layout) for n, p in GEOMETRIES[:1] for layout in ("BLNHC", "BLHNC")],
)
def test_every_group_is_one_head_slab_of_whole_blocks(tokens_per_block, page, layout):
    for g in _kernel_groups(tokens_per_block, page, layout):
        assert g.tokens_per_block == g.slots_per_block == tokens_per_block, (
            f"layers {g.layer_indices}: {g.slots_per_block} slots per "
            f"{g.tokens_per_block}-token block ({g.shape_desc.nh} heads)"
        )


@pytest.mark.parametrize(
    ("tokens_per_block", "page", "layout"),
    [(n, p, "LBNHC") for n, p in GEOMETRIES]
    # At N = 80 even the misread group fits in 1024 threads.
    + [pytest.param(n, p, "LBHNC", marks=pytest.mark.fix if n > 80 else ()) for n, p in GEOMETRIES],
)
def test_every_kernel_group_fits_a_cuda_block(tokens_per_block, page, layout):
    for g in _kernel_groups(tokens_per_block, page, layout):
        x, y = cuda_block_dims(g)
        assert x * y <= MAX_THREADS_PER_BLOCK and y <= MAX_THREADS_PER_BLOCK, (
            f"layers {g.layer_indices}: blockDim ({x}, {y}) = {x * y} threads"
        )


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize(("tokens_per_block", "page"), GEOMETRIES)
def test_a_stored_fa_block_restores_byte_equal_into_another(tokens_per_block, page, layout):
    reg = build_registration(tokens_per_block, page, layout)
    fa = [layer_name(i) for i in FA_LAYERS]
    before = {n: [block_bytes(reg, n, b).clone() for b in range(reg.config.num_blocks)] for n in fa}
    assert copy_fa_block(reg, tokens_per_block, src=3, dst=7), "the transfer raised"
    for n in fa:
        assert block_bytes(reg, n, 7).equal(before[n][3]), f"{n}: block 7 is not block 3"
        for b in range(reg.config.num_blocks):
            if b != 7:
                assert block_bytes(reg, n, b).equal(before[n][b]), f"{n}: block {b} changed"
