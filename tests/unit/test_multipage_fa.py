"""Subpaged full-attention blocks are stored and restored whole.

Every check runs through LMCache's real connector registration
(apply_kv_cache_group_edits + create_engine_group_infos_from_vllm) and the server's real
LMCacheDrivenTransferModule on the CPU platform, over the exact tensors vLLM 0.26
registers for a hybrid GDN + FA model with FlashInfer's kernel pages.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.v1.kv_cache_interface")
pytest.importorskip("lmcache.v1.multiprocess.modules.lmcache_driven_transfer")

from hybrid_kv import (  # noqa: E402
    FA_LAYERS,
    NUM_LAYERS,
    HybridKV,
    build_fa_only_kv,
    build_hybrid_kv,
    start_server,
)

# (tokens_per_block N, kernel page): ratios 3, 5, 9, 17 (544/32) and 25 (1600/64).
GEOMETRIES = [(48, 16), (80, 16), (288, 32), (544, 32), (1600, 64)]
GEOMETRY_IDS = [f"r{n // p}-{n}over{p}" for n, p in GEOMETRIES]
LAYOUTS = ["NHD", "HND"]

# Request A: 2 logical blocks per group, ids from one pool; 0 is vLLM's null block.
# Engine group order: Mamba groups 0-2, FA group 3.
STORE_IDS = [[3, 4], [5, 6], [7, 8], [1, 2]]
RESTORE_IDS = [[9, 10], [2, 1], [4, 3], [11, 6]]


def _as_int16(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).view(torch.int16)


def _sorted_values(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.sort(torch.cat([_as_int16(p) for p in parts])).values


def _chunk_sources(kv: HybridKV, ids: list[list[int]], chunk: int, blocks: int) -> list:
    """Bytes a chunk must keep (``blocks`` logical blocks per chunk): every FA block,
    and for each GDN layer the state of its last block, the one a restore resumes from."""
    parts = []
    for layer in range(NUM_LAYERS):
        group = 3 if layer in FA_LAYERS else layer % 4
        chunk_ids = ids[group][chunk * blocks : (chunk + 1) * blocks]
        for block_id in chunk_ids if layer in FA_LAYERS else chunk_ids[-1:]:
            parts.append(kv.block_bytes(layer, block_id))
    return parts


def _restored_pairs(group: int, store_ids: list[int], restore_ids: list[int]) -> list:
    """(stored, restored) blocks a restore must bring back: every FA block, and the
    GDN state of the last block."""
    pairs = list(zip(store_ids, restore_ids, strict=True))
    return pairs if group == 3 else pairs[-1:]


def _snapshot(kv: HybridKV, layers: int = NUM_LAYERS) -> dict[tuple[int, int], torch.Tensor]:
    """A copy of every (layer, logical block) the engine holds."""
    return {
        (layer, b): kv.block_bytes(layer, b).clone()
        for layer in range(layers)
        for b in range(kv.num_blocks)
    }


def _stored_objects(server) -> list[torch.Tensor]:
    """The bytes stored for each chunk, over all its objects (keys: request, group, chunk)."""
    objs = server.ctx.storage_manager.objects
    chunks = sorted({k[2] for k in objs})
    return [torch.cat([objs[k].raw_tensor for k in sorted(objs) if k[2] == c]) for c in chunks]


@pytest.fixture(params=LAYOUTS)
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.fix
@pytest.mark.parametrize(("n", "page"), GEOMETRIES, ids=GEOMETRY_IDS)
def test_store_keeps_every_kernel_page(n, page, layout, monkeypatch):
    kv = build_hybrid_kv(n, page, layout)
    server = start_server(kv, chunk_size=n, monkeypatch=monkeypatch)
    assert server.store("A", 2 * n, STORE_IDS)

    stored = _stored_objects(server)
    assert len(stored) == 2
    for chunk, obj in enumerate(stored):
        expected = _sorted_values(_chunk_sources(kv, STORE_IDS, chunk, 1))
        assert obj.numel() == expected.numel() * 2, (
            f"object holds {obj.numel()} bytes; the chunk's FA + GDN blocks are "
            f"{expected.numel() * 2} (FA kernel pages per block: {kv.ratio})"
        )
        assert torch.equal(_sorted_values([obj]), expected)


@pytest.mark.fix
@pytest.mark.parametrize(("n", "page"), GEOMETRIES, ids=GEOMETRY_IDS)
def test_round_trip_is_bitwise_and_touches_only_destination_blocks(n, page, layout, monkeypatch):
    kv = build_hybrid_kv(n, page, layout)
    server = start_server(kv, chunk_size=n, monkeypatch=monkeypatch)
    assert server.store("A", 2 * n, STORE_IDS)
    # Layers 0-3 share raw tensor 0 and layers 4-7 raw tensor 1 (vLLM's shared_by).
    before = _snapshot(kv)

    assert server.retrieve("A", 2 * n, RESTORE_IDS)

    destinations = set()
    for layer in range(NUM_LAYERS):
        group = 3 if layer in FA_LAYERS else layer % 4
        for src, dst in _restored_pairs(group, STORE_IDS[group], RESTORE_IDS[group]):
            assert torch.equal(kv.block_bytes(layer, dst), before[(layer, src)]), (
                f"layer {layer}: block {dst} is not the stored block {src}"
            )
            destinations.add((layer // 4, dst))
    for (layer, b), old in before.items():
        if (layer // 4, b) not in destinations:
            assert torch.equal(kv.block_bytes(layer, b), old), (
                f"raw tensor {layer // 4}: block {b} was not a destination but changed"
            )


@pytest.mark.fix
@pytest.mark.parametrize(("n", "page"), [(80, 16), (544, 32)], ids=["r5", "r17"])
def test_chunk_of_two_blocks_round_trips(n, page, layout, monkeypatch):
    kv = build_hybrid_kv(n, page, layout)
    server = start_server(kv, chunk_size=2 * n, monkeypatch=monkeypatch)
    assert server.store("A", 2 * n, STORE_IDS)
    sources = _snapshot(kv)
    assert server.retrieve("A", 2 * n, RESTORE_IDS)
    for layer in range(NUM_LAYERS):
        group = 3 if layer in FA_LAYERS else layer % 4
        for src, dst in _restored_pairs(group, STORE_IDS[group], RESTORE_IDS[group]):
            assert torch.equal(kv.block_bytes(layer, dst), sources[(layer, src)])


@pytest.mark.fix
def test_prefetch_layout_after_restart_holds_every_page(layout, monkeypatch):
    """The layout registered for the L2 -> L1 prefetch sizes objects like the store."""
    n, page = 544, 32
    kv = build_hybrid_kv(n, page, layout)
    server = start_server(kv, chunk_size=n, monkeypatch=monkeypatch)
    registered = server.ctx.layout_desc_registry.find_group_layout_descs("hybrid", 1)
    sizes = [
        torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
        for desc in registered.values()
        for s, d in zip(desc.shapes, desc.dtypes, strict=True)
    ]
    assert sum(sizes) == NUM_LAYERS * kv.page_bytes


@pytest.mark.fix
def test_staging_copies_cover_each_object_once_without_touching_its_metadata(layout, monkeypatch):
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as transfer

    n, page = 544, 32
    kv = build_hybrid_kv(n, page, layout)
    server = start_server(kv, chunk_size=n, monkeypatch=monkeypatch)
    copies: list[tuple[int, int, int, int]] = []

    def recorder(original, obj_first: bool):
        def copy(a, b):
            obj, staging = (a, b) if obj_first else (b, a)
            copies.append((obj.data_ptr, obj.meta.address, obj.get_size(), staging.nbytes))
            return original(a, b)

        return copy

    monkeypatch.setattr(
        transfer, "lmcache_memcpy_async_d2h", recorder(transfer.lmcache_memcpy_async_d2h, False)
    )
    monkeypatch.setattr(
        transfer, "lmcache_memcpy_async_h2d", recorder(transfer.lmcache_memcpy_async_h2d, True)
    )
    assert server.store("A", 2 * n, STORE_IDS)
    objs = server.ctx.storage_manager.objects
    metas = {k: (o.meta.address, o.meta.shape, list(o.meta.shapes)) for k, o in objs.items()}
    assert server.retrieve("A", 2 * n, RESTORE_IDS)

    chunk_bytes = NUM_LAYERS * kv.page_bytes
    by_ptr = {o.data_ptr: o for o in objs.values()}
    # Stored: every object of both chunks; restored: FA of both, GDN of the last.
    assert len(copies) == len(objs) + len(objs) - 1
    for data_ptr, address, size, staging_bytes in copies:
        obj = by_ptr[data_ptr]
        assert data_ptr == obj.raw_tensor.data_ptr() and address == 0
        assert size == staging_bytes == obj.get_size()
    for chunk in (0, 1):
        stored = sum(o.get_size() for k, o in objs.items() if k[2] == chunk)
        assert stored == chunk_bytes, f"chunk {chunk}: {stored} bytes of {chunk_bytes}"
    assert {k: (o.meta.address, o.meta.shape, list(o.meta.shapes)) for k, o in objs.items()} == (
        metas
    )


@pytest.mark.fix
@pytest.mark.parametrize(("n", "page"), [(48, 16), (80, 16)], ids=["r3", "r5"])
def test_gdn_blocks_survive_the_fa_restore(n, page, layout, monkeypatch):
    """GDN blocks share raw memory with FA kernel pages: an FA restore must not land in them.

    Pristine writes kernel page L' for FA block L'; with r = 3 or 5, pages 11 and 6 lie
    inside logical blocks 3/2 and 2/1, which this restore gives to GDN groups.
    """
    kv = build_hybrid_kv(n, page, layout)
    server = start_server(kv, chunk_size=n, monkeypatch=monkeypatch)
    assert server.store("A", 2 * n, STORE_IDS)
    sources = _snapshot(kv)
    assert server.retrieve("A", 2 * n, RESTORE_IDS)
    for layer in range(NUM_LAYERS):
        if layer in FA_LAYERS:
            continue
        (src, dst), *_ = _restored_pairs(layer % 4, STORE_IDS[layer % 4], RESTORE_IDS[layer % 4])
        assert torch.equal(kv.block_bytes(layer, dst), sources[(layer, src)])
        for other in RESTORE_IDS[layer % 4][:-1]:
            assert torch.equal(kv.block_bytes(layer, other), sources[(layer, other)]), (
                f"GDN layer {layer}: block {other}, not a destination, was overwritten"
            )


@pytest.mark.parametrize("page", [16, 32])
def test_non_hybrid_model_round_trips_as_before(page, layout, monkeypatch):
    """No subpaging (FA only, block == page): the pristine path, on both arms."""
    kv = build_fa_only_kv(page, layout)
    server = start_server(kv, chunk_size=2 * page, monkeypatch=monkeypatch)
    ids = [[1, 2, 3, 4]]
    assert server.store("A", 4 * page, ids)
    sources = _snapshot(kv, layers=2)
    assert server.retrieve("A", 4 * page, [[9, 5, 11, 7]])
    for layer in range(2):
        for src, dst in zip(ids[0], [9, 5, 11, 7], strict=True):
            assert torch.equal(kv.block_bytes(layer, dst), sources[(layer, src)])


def _replace_fa_views(kv: HybridKV, pages: int, slots: int) -> None:
    from hybrid_kv import FA_DTYPE, HEAD_SIZE, NUM_KV_HEADS, layer_name

    for layer in FA_LAYERS:
        elems = kv.raw_of(layer).view(FA_DTYPE)[: pages * slots * NUM_KV_HEADS * 2 * HEAD_SIZE]
        kv.kv_caches[layer_name(layer)] = elems.view(pages, NUM_KV_HEADS, slots, 2 * HEAD_SIZE)


@pytest.mark.feature
def test_block_that_is_not_whole_kernel_pages_is_refused_naming_the_layer(monkeypatch):
    """Pristine refuses this geometry too, naming the engine group, not the layer."""
    kv = build_hybrid_kv(80, 16, "HND")
    _replace_fa_views(kv, pages=30, slots=32)  # 80-token blocks over 32-slot pages
    with pytest.raises(ValueError, match=r"model\.layers\.3\.self_attn.*80-token block.*32-slot"):
        start_server(kv, chunk_size=80, monkeypatch=monkeypatch)


@pytest.mark.fix
def test_page_count_not_a_multiple_of_the_ratio_is_refused(monkeypatch):
    kv = build_hybrid_kv(80, 16, "HND")
    _replace_fa_views(kv, pages=59, slots=16)  # 59 pages cannot hold whole 5-page blocks
    with pytest.raises(ValueError, match=r"model\.layers\.3\.self_attn.*59 kernel pages"):
        start_server(kv, chunk_size=80, monkeypatch=monkeypatch)


def test_chunk_not_a_multiple_of_the_block_is_refused(monkeypatch):
    """The server refuses a chunk that splits blocks (a client that skipped its own check)."""
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as transfer

    kv = build_hybrid_kv(80, 16, "HND")
    server = start_server(kv, chunk_size=80, monkeypatch=monkeypatch)
    wrappers = [type(w)(w.to_tensor()) for w in _registered_wrappers(kv)]
    ctx = type(server.ctx)(chunk_size=120)
    module = transfer.LMCacheDrivenTransferModule(ctx)
    from lmcache.utils import EngineType

    with pytest.raises(ValueError, match=r"120 must be a multiple of .*\b80\b"):
        module.register_kv_cache(
            2,
            wrappers,
            "hybrid",
            1,
            EngineType.VLLM,
            {"kv_layout": "HND"},
            server.engine_group_infos,
        )


def _registered_wrappers(kv: HybridKV) -> list:
    from hybrid_kv import _Wrapper

    from lmcache.integration.vllm.kv_cache_group_edits import apply_kv_cache_group_edits

    edited = apply_kv_cache_group_edits(kv.config, dict(kv.kv_caches), {"kv_layout": "HND"})
    return [_Wrapper(t) for t in edited.values()]


def _with_fa_group_spec(kv: HybridKV, spec_cls: type, **extra: object) -> HybridKV:
    """The same tensors, with vLLM declaring the attention group ``spec_cls``."""
    import dataclasses

    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    groups = list(kv.config.kv_cache_groups)
    fa = groups[3].kv_cache_spec
    spec = spec_cls(
        block_size=fa.block_size,
        num_kv_heads=fa.num_kv_heads,
        head_size=fa.head_size,
        dtype=fa.dtype,
        **extra,
    )
    groups[3] = KVCacheGroupSpec(groups[3].layer_names, spec)
    kv.config = dataclasses.replace(kv.config, kv_cache_groups=groups)
    return kv


SUBPAGEABLE = {
    "sliding-window": ("SlidingWindowSpec", {"sliding_window": 160}),
    "chunked-local": ("ChunkedLocalAttentionSpec", {"attention_chunk_size": 160}),
}


@pytest.mark.fix
@pytest.mark.parametrize("kind", list(SUBPAGEABLE))
def test_a_subpaged_attention_group_that_is_not_full_attention_is_refused(kind, monkeypatch):
    from vllm.v1 import kv_cache_interface

    name, extra = SUBPAGEABLE[kind]
    spec_cls = getattr(kv_cache_interface, name)
    kv = _with_fa_group_spec(build_hybrid_kv(80, 16, "HND"), spec_cls, **extra)
    with pytest.raises(ValueError, match=rf"{name} layers .*model\.layers\.3\.self_attn.*80-token"):
        start_server(kv, chunk_size=80, monkeypatch=monkeypatch)


@pytest.mark.parametrize("kind", list(SUBPAGEABLE))
def test_an_attention_group_of_whole_pages_is_served(kind, monkeypatch):
    from vllm.v1 import kv_cache_interface

    name, extra = SUBPAGEABLE[kind]
    spec_cls = getattr(kv_cache_interface, name)
    kv = _with_fa_group_spec(build_hybrid_kv(80, 80, "HND"), spec_cls, **extra)
    assert start_server(kv, chunk_size=80, monkeypatch=monkeypatch).engine_group_infos
