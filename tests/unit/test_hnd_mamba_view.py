"""GDN/Mamba pages under the HND layout.

On the H200 every Qwen3.5 gate case ran with VLLM_KV_CACHE_LAYOUT=HND and no chunk was ever
stored, on pristine and patched alike: "CUDA error: invalid argument" from
execute_object_group_transfer. The Mamba page view was NHD-ordered whatever the layout, so
the HND detector read it as N heads of a 1-slot block and the copy kernel was launched with
32 x N threads per CUDA block. The CPU copy path has no such limit, so these tests check the
group geometry and the launch shape the CUDA kernel would get.
"""

from __future__ import annotations

import pytest
from hybrid_kv import FA_LAYERS, NUM_LAYERS, build_hybrid_kv, start_server

GEOMETRIES = [(80, 16), (544, 32), (1600, 64)]  # (N, FlashInfer page): ratios 5, 17, 25
MAX_THREADS_PER_BLOCK = 1024  # CUDA limit, also the limit of blockDim.y
MAMBA_LAYERS = tuple(i for i in range(NUM_LAYERS) if i not in FA_LAYERS)


def cuda_block_dims(group) -> tuple[int, int]:
    """blockDim of multi_layer_block_kv_transfer (csrc/mp_mem_kernels.cu in 0.5.3):
    x = min(head bytes / copy unit, 32), y = heads; the copy unit is 16, 4 or 2 bytes.
    A model of that launch, written from the kernel's source: no kernel runs on a CPU box,
    so a test of it checks the group geometry the launch is computed from."""
    sd = group.shape_desc
    head_bytes = sd.hs * sd.element_size
    unit = next(u for u in (16, 4, 2) if head_bytes % u == 0)
    return min(head_bytes // unit, 32), sd.nh


def kernel_groups(tokens_per_block: int, page: int, layout: str, monkeypatch) -> list:
    kv = build_hybrid_kv(tokens_per_block, page, layout)
    server = start_server(kv, chunk_size=tokens_per_block, monkeypatch=monkeypatch)
    (ctx,) = [e.cache_context for e in server.module._cache_contexts.values()]
    return ctx.kv_layer_groups_manager.kernel_groups


def mamba_groups(groups: list) -> list:
    found = [g for g in groups if set(g.layer_indices) <= set(MAMBA_LAYERS)]
    assert found, "no Mamba kernel group registered"
    return found


@pytest.mark.fix
@pytest.mark.parametrize(("tokens_per_block", "page"), GEOMETRIES)
def test_hnd_mamba_page_is_one_head_of_a_whole_block(tokens_per_block, page, monkeypatch):
    for g in mamba_groups(kernel_groups(tokens_per_block, page, "HND", monkeypatch)):
        assert (g.shape_desc.nh, g.shape_desc.bs) == (1, tokens_per_block), (
            f"layers {g.layer_indices}: read as {g.shape_desc.nh} heads of a "
            f"{g.shape_desc.bs}-slot block"
        )
        assert g.tokens_per_block == g.slots_per_block == tokens_per_block


@pytest.mark.parametrize(
    ("tokens_per_block", "page", "layout"),
    [(n, p, "NHD") for n, p in GEOMETRIES]
    # The harness's Mamba page is small (16-byte heads): at N=80 even the misread
    # group fits in 1024 threads, so only the larger blocks show the bug.
    + [pytest.param(n, p, "HND", marks=pytest.mark.fix if n > 80 else ()) for n, p in GEOMETRIES],
)
def test_every_kernel_group_fits_a_cuda_block(tokens_per_block, page, layout, monkeypatch):
    for g in kernel_groups(tokens_per_block, page, layout, monkeypatch):
        x, y = cuda_block_dims(g)
        assert x * y <= MAX_THREADS_PER_BLOCK and y <= MAX_THREADS_PER_BLOCK, (
            f"layers {g.layer_indices}: blockDim ({x}, {y}) = {x * y} threads"
        )
