"""A hybrid GDN + full-attention KV cache registered by vLLM's own allocation code (vLLM
0.29 and later), on CPU, and LMCache's registration of it (the connector's edits and group
infos, the server's cache context).

vLLM side: real specs, ``get_kv_cache_config_from_groups`` (one int8 allocation; every
``KVCacheTensor`` places a group's layers in it by ``layers``/``layer_stride``/
``block_stride``; the groups overlay each other) and ``allocate_kv_cache`` (strided 4-D
views per layer: FA ``[B, H, N, 2*hs]`` at the kernel block size, GDN ``[NB, 1, 1, row]``),
with the engine's resolved KV layout. Layers: 6 GDN + 2 FA (FA at i % 4 == 3), 3 Mamba
groups then the FA group, as vLLM orders a 3:1 hybrid.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

NUM_KV_HEADS = 2
HEAD_SIZE = 16
FA_DTYPE = torch.bfloat16
NUM_LAYERS = 8
FA_LAYERS = (3, 7)
CONV_DIM, CONV_WIDTH = 24, 4
SSM_HEADS, SSM_DIM = 2, 8


def layer_name(i: int) -> str:
    return f"model.layers.{i}.{'self_attn.attn' if i in FA_LAYERS else 'linear_attn'}"


def has_strided_allocation() -> bool:
    """Whether this vLLM allocates the KV cache the 0.29 way (``allocate_kv_cache``)."""
    try:
        from vllm.v1.worker.utils import allocate_kv_cache  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class Registration:
    """What the connector registers: vLLM's config and per-layer views, and the layout."""

    config: Any
    kv_caches: dict[str, torch.Tensor]
    layout: str  # vLLM's KVCacheLayout name: LBNHC (NHD), LBHNC (HND), BLNHC, BLHNC
    tokens_per_block: int
    kernel_block: int


def build_registration(
    tokens_per_block: int,
    kernel_block: int,
    layout: str,
    num_blocks: int = 12,
    conv_state_len: int = CONV_WIDTH - 1,
) -> Registration:
    """vLLM's allocation of a 3:1 GDN:FA hybrid; FA kernel-paged at ``kernel_block``;
    ``layout`` is a ``KVCacheLayout`` name; ``conv_state_len`` the conv state's length
    (MTP lengthens it by the draft tokens)."""
    if not has_strided_allocation():
        pytest.skip("this vLLM does not allocate the KV cache as strided views (< 0.29)")
    try:  # vLLM >= 0.33 moved it
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    fa = FullAttentionSpec(
        block_size=tokens_per_block, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=FA_DTYPE
    )
    mamba = MambaSpec(
        block_size=tokens_per_block,
        shapes=((CONV_DIM, conv_state_len), (SSM_HEADS, SSM_DIM, SSM_DIM)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=fa.page_size_bytes,
        mamba_cache_mode="align",
    )
    names = [[layer_name(i) for i in range(NUM_LAYERS) if i % 4 == g] for g in range(4)]
    groups = [KVCacheGroupSpec(n, s) for n, s in zip(names, [mamba] * 3 + [fa], strict=True)]
    resolved = KVCacheLayout[layout]
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: resolved,
            num_gpu_blocks_override=num_blocks,
            prefix_cache_retention_interval=None,
        ),
        attention_config=SimpleNamespace(hisparse_config=None),
    )
    config = get_kv_cache_config_from_groups(vllm_config, groups, 1 << 30)
    assert config.num_blocks == num_blocks
    if resolved.is_block_outermost:
        # prepare_kernel_block_sizes: other layers' pages lie between the blocks
        # of a blocks-first layout, so vLLM never splits its blocks into kernel pages.
        kernel_block = tokens_per_block
    kernel_sizes = [tokens_per_block] * 3 + [kernel_block]
    kv_caches = allocate_kv_cache(config, torch.device("cpu"), resolved, kernel_sizes)
    gen = torch.Generator().manual_seed(0)
    for view in {t.untyped_storage().data_ptr(): t for t in kv_caches.values()}.values():
        backing = torch.empty(0, dtype=torch.int8).set_(view.untyped_storage())
        backing.copy_(torch.randint(-128, 128, backing.shape, dtype=torch.int8, generator=gen))
    return Registration(config, kv_caches, layout, tokens_per_block, kernel_block)


def over_the_queue(infos: Any) -> list[Any]:
    """Engine group infos as the server receives them (msgpack, as the message queue
    carries them)."""
    import msgspec

    from lmcache.v1.multiprocess.group_view import EngineGroupInfo

    return msgspec.msgpack.decode(msgspec.msgpack.encode(list(infos)), type=list[EngineGroupInfo])


class _Wrapper:
    """Stands in for the IPC wrapper the server receives for each registered tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def to_tensor(self) -> torch.Tensor:
        return self._tensor


def connector_view(
    reg: Registration, engine_identity: str | None = None
) -> tuple[dict[str, torch.Tensor], list[Any], dict[str, str]]:
    """What the connector registers for ``reg``: its edited views, its group infos as they
    cross the message queue, and its layout hints."""
    from lmcache.integration.vllm.kv_cache_group_edits import apply_kv_cache_group_edits
    from lmcache.integration.vllm.kv_cache_groups import create_engine_group_infos_from_vllm
    from lmcache.integration.vllm.utils import translate_vllm_kv_cache_layout

    # What vllm_layout_hints reads from CacheConfig.get_resolved_kv_cache_layout().
    hints = {"kv_layout": translate_vllm_kv_cache_layout(reg.layout)}
    edited = apply_kv_cache_group_edits(reg.config, dict(reg.kv_caches), layout_hints=hints)
    kwargs = {} if engine_identity is None else {"engine_identity": engine_identity}
    infos = create_engine_group_infos_from_vllm(reg.config, edited, layout_hints=hints, **kwargs)
    return edited, over_the_queue(infos), hints


def register(
    reg: Registration, chunk_size: int, separate_object_groups: bool = False
) -> tuple[Any, list[Any]]:
    """The server's cache context for what the connector registers, and the group infos that
    crossed the message queue."""
    from lmcache.utils import EngineType
    from lmcache.v1.platform.cache_context import create_cache_context

    edited, wire, hints = connector_view(reg)
    ctx = create_cache_context(
        [_Wrapper(t) for t in edited.values()],
        chunk_size,
        layout_hints=hints,
        engine_group_infos=wire,
        engine_type=EngineType.VLLM,
        separate_object_groups=separate_object_groups,
        full_sw_kv=False,
    )
    return ctx, wire


def block_bytes(reg: Registration, layer: str, block_id: int) -> torch.Tensor:
    """The bytes vLLM keeps for ``layer``'s block ``block_id``, by its KVCacheTensor."""
    for tensor in reg.config.kv_cache_tensors:
        if layer in tensor.layers:
            break
    else:
        raise KeyError(layer)
    view = reg.kv_caches[layer]
    backing = torch.empty(0, dtype=torch.int8).set_(view.untyped_storage())
    start = tensor.offset + tensor.layers.index(layer) * tensor.layer_stride
    start += block_id * tensor.block_stride
    page = reg.config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    return backing[start : start + page]


def copy_fa_block(reg: Registration, chunk_size: int, src: int, dst: int) -> bool:
    """Store the full-attention block ``src`` through LMCache's transfer code (D2H) and
    retrieve it into block ``dst`` (H2D), one chunk of one block, with the FA group as
    its own object group (the CPU fallback cannot address the GDN views: their block
    stride exceeds their row). Returns False when the store or the retrieve raised."""
    from lmcache import lmcache_native
    from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj
    from lmcache.v1.multiprocess.group_view import expand_engine_block_ids
    from lmcache.v1.multiprocess.modules.lmcache_driven_transfer import get_layout_desc
    from lmcache.v1.multiprocess.object_group_transfer import (
        downsample_and_stage_block_ids,
        transfer_kv_per_object_group,
    )

    ctx, infos = register(reg, chunk_size, separate_object_groups=True)
    manager = ctx.kv_layer_groups_manager
    fa_kernel_groups = {
        k for k, g in enumerate(manager.kernel_groups) if set(g.layer_indices) >= {6, 7}
    }
    (fa_object_group,) = [
        i
        for i, g in enumerate(manager.object_groups)
        if set(g.kernel_group_indices) == fa_kernel_groups
    ]
    layout = get_layout_desc(ctx, chunk_size, fa_object_group)
    nbytes = sum(
        torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
        for s, d in zip(layout.shapes, layout.dtypes, strict=True)
    )
    raw = torch.zeros(nbytes, dtype=torch.uint8)
    meta = MemoryObjMetadata(
        shape=raw.shape,
        dtype=torch.uint8,
        address=0,
        phy_size=raw.numel(),
        ref_count=1,
        shapes=list(layout.shapes),
        dtypes=list(layout.dtypes),
    )
    obj = TensorMemoryObj(raw, meta, None)
    num_groups = len(reg.config.kv_cache_groups)
    direction = lmcache_native.TransferDirection
    try:
        for block, way in ((src, direction.D2H), (dst, direction.H2D)):
            ids = expand_engine_block_ids(infos, [[block]] * num_groups)
            staged = downsample_and_stage_block_ids(ctx, ids)
            transfer_kv_per_object_group(
                ctx, staged, [obj], fa_object_group, 1, 0, way, transfer_key="t"
            )
    except (RuntimeError, ValueError, IndexError, NotImplementedError) as exc:
        print(f"transfer raised: {exc!r}")
        return False
    return True
