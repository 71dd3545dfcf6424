"""A hybrid GDN + full-attention KV cache exactly as vLLM 0.26 registers it, on CPU,
and LMCache's real LMCacheDrivenTransferModule wired to it with small fakes.

Geometry (vLLM 0.26, FlashInfer): logical block N tokens = r kernel pages of `page` slots.
Layers: 6 GDN + 2 FA (OlmoHybrid-like: FA at i % 4 == 3); 3 Mamba groups and 1 FA group
(Mamba groups first), two raw int8 KVCacheTensors each shared by one layer of every group,
one block-id pool. FA layers see a raw tensor as a rank-4 K/V-packed view
(NB*r, H, page, 2*hs) (HND contiguous, NHD permuted from (NB*r, page, H, 2*hs) memory);
GDN layers see it as [conv_state, ssm_state] as_strided views (gpu_model_runner.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from vllm_kv_alloc import over_the_queue

NUM_KV_HEADS = 2
HEAD_SIZE = 16
FA_DTYPE = torch.bfloat16
NUM_LAYERS = 8
FA_LAYERS = (3, 7)
CONV_DIM, CONV_WIDTH = 24, 4
SSM_HEADS, SSM_DIM = 2, 8


def layer_name(i: int) -> str:
    return f"model.layers.{i}.{'self_attn.attn' if i in FA_LAYERS else 'linear_attn'}"


@dataclass
class HybridKV:
    """One engine's registered KV caches plus the vLLM config they came from."""

    tokens_per_block: int
    page: int
    num_blocks: int
    layout: str  # "NHD" or "HND"
    config: Any = None
    fa_dtype: torch.dtype = FA_DTYPE  # torch.uint8 for vLLM's fp8 KV cache dtypes
    raw: list[torch.Tensor] = field(default_factory=list)
    kv_caches: dict[str, Any] = field(default_factory=dict)
    raw_index: dict[int, int] = field(default_factory=dict)  # layer -> raw tensor

    @property
    def ratio(self) -> int:
        return self.tokens_per_block // self.page

    @property
    def page_bytes(self) -> int:
        """Bytes of one logical block of one layer (FA and padded Mamba alike)."""
        elem = torch.empty((), dtype=self.fa_dtype).element_size()
        return self.tokens_per_block * NUM_KV_HEADS * 2 * HEAD_SIZE * elem

    def raw_of(self, layer: int) -> torch.Tensor:
        return self.raw[self.raw_index[layer]]

    def block_bytes(self, layer: int, block_id: int) -> torch.Tensor:
        """The bytes vLLM keeps for ``layer``'s logical block ``block_id``."""
        start = block_id * self.page_bytes
        return self.raw_of(layer)[start : start + self.page_bytes]


@dataclass(frozen=True)
class GDNState:
    """The GDN state layout inside a Mamba page, as vLLM's MambaSpec declares it.

    ``spec_tokens`` is MTP's num_speculative_tokens (the conv state holds
    ``CONV_WIDTH - 1 + spec_tokens`` columns), ``dim_first`` is
    VLLM_SSM_CONV_STATE_LAYOUT=DS (SD puts the state length first).
    """

    spec_tokens: int = 0
    dim_first: bool = True
    ssm_dtype: torch.dtype = torch.float32

    @property
    def conv_shape(self) -> tuple[int, int]:
        state_len = CONV_WIDTH - 1 + self.spec_tokens
        return (CONV_DIM, state_len) if self.dim_first else (state_len, CONV_DIM)

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (SSM_HEADS, SSM_DIM, SSM_DIM)


def build_hybrid_kv(
    tokens_per_block: int,
    page: int,
    layout: str,
    num_blocks: int = 12,
    seed: int = 0,
    gdn: GDNState = GDNState(),
    fa_dtype: torch.dtype = FA_DTYPE,
) -> HybridKV:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
    )

    kv = HybridKV(tokens_per_block, page, num_blocks, layout, fa_dtype=fa_dtype)
    fa_spec = FullAttentionSpec(
        block_size=tokens_per_block,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=fa_dtype,
    )
    assert fa_spec.page_size_bytes == kv.page_bytes
    mamba_spec = MambaSpec(
        block_size=tokens_per_block,
        shapes=(gdn.conv_shape, gdn.ssm_shape),
        dtypes=(torch.bfloat16, gdn.ssm_dtype),
        page_size_padded=kv.page_bytes,
        mamba_cache_mode="align",
        num_speculative_blocks=gdn.spec_tokens,
    )
    groups = [[layer_name(i) for i in range(NUM_LAYERS) if i % 4 == g] for g in range(4)]
    specs = [mamba_spec, mamba_spec, mamba_spec, fa_spec]
    tensors = [
        KVCacheTensor(
            size=kv.page_bytes * num_blocks,
            shared_by=[layer_name(i) for i in range(t * 4, t * 4 + 4)],
        )
        for t in range(2)
    ]
    kv.config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(n, s) for n, s in zip(groups, specs, strict=True)],
    )
    gen = torch.Generator().manual_seed(seed)
    kv.raw = [torch.randint(-128, 128, (t.size,), dtype=torch.int8, generator=gen) for t in tensors]
    kv.raw_index = {i: i // 4 for i in range(NUM_LAYERS)}
    for i in range(NUM_LAYERS):
        raw = kv.raw_of(i)
        if i in FA_LAYERS:
            kv.kv_caches[layer_name(i)] = _fa_view(raw, kv)
        else:
            kv.kv_caches[layer_name(i)] = _gdn_views(raw, kv.page_bytes, num_blocks, gdn)
    return kv


def build_fa_only_kv(
    page: int, layout: str, num_blocks: int = 12, seed: int = 0, num_layers: int = 2
) -> HybridKV:
    """A non-hybrid model: full-attention layers only, block == kernel page, no sharing."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    kv = HybridKV(page, page, num_blocks, layout)
    spec = FullAttentionSpec(
        block_size=page, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=FA_DTYPE
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    tensors = [KVCacheTensor(size=kv.page_bytes * num_blocks, shared_by=[n]) for n in names]
    kv.config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    gen = torch.Generator().manual_seed(seed)
    kv.raw = [torch.randint(-128, 128, (t.size,), dtype=torch.int8, generator=gen) for t in tensors]
    kv.raw_index = {i: i for i in range(num_layers)}
    kv.kv_caches = {n: _fa_view(r, kv) for n, r in zip(names, kv.raw, strict=True)}
    return kv


def _fa_view(raw: torch.Tensor, kv: HybridKV) -> torch.Tensor:
    pages = kv.num_blocks * kv.ratio
    elems = raw.view(kv.fa_dtype)
    if kv.layout == "HND":
        return elems.view(pages, NUM_KV_HEADS, kv.page, 2 * HEAD_SIZE)
    return elems.view(pages, kv.page, NUM_KV_HEADS, 2 * HEAD_SIZE).permute(0, 2, 1, 3)


def _gdn_views(
    raw: torch.Tensor, page_bytes: int, num_blocks: int, gdn: GDNState
) -> list[torch.Tensor]:
    """[conv_state, ssm_state] as_strided over the padded page, as vLLM registers them."""
    conv = raw.view(torch.bfloat16)
    rows, cols = gdn.conv_shape
    conv_view = torch.as_strided(conv, (num_blocks, rows, cols), (page_bytes // 2, cols, 1))
    conv_bytes = rows * cols * 2
    ssm = raw.view(gdn.ssm_dtype)
    size = ssm.element_size()
    ssm_view = torch.as_strided(
        ssm,
        (num_blocks, SSM_HEADS, SSM_DIM, SSM_DIM),
        (page_bytes // size, SSM_DIM * SSM_DIM, SSM_DIM, 1),
        storage_offset=conv_bytes // size,
    )
    return [conv_view, ssm_view]


# --------------------------------------------------------------------------------------
# LMCache side: connector registration and the server's transfer module on CPU.


class _Wrapper:
    """Stands in for the IPC wrapper the server receives for each registered tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def to_tensor(self) -> torch.Tensor:
        return self._tensor


class _NoopEventBackend:
    def check_event_support(self, device: object) -> None: ...
    def create_event(self, device: object) -> object:
        return object()

    def export_event(self, event: object, device: object) -> bytes:
        return b""

    def import_event(self, handle: bytes, device: object) -> object:
        return object()

    def record_event(self, event: object, stream: object) -> None: ...
    def wait_event(self, event: object, stream: object) -> None: ...


class _NoopDispatcher:
    def register(self, kind: str, handler: object, payload_type: object) -> None: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...


class _NoopBus:
    def publish(self, event: object) -> None: ...
    def publish_on_stream(self, stream: object, event: object) -> None: ...
    def has_subscribers(self, event_type: object) -> bool:
        return False


class FakeStorage:
    """The storage manager's write/read surface, holding real TensorMemoryObjs."""

    def __init__(self) -> None:
        self.objects: dict[Any, Any] = {}
        self.layouts: list[Any] = []

    def reserve_write(self, keys: list[Any], layout: Any, mode: str) -> dict[Any, Any]:
        self.layouts.append(layout)
        reserved = {}
        for key in keys:
            raw = torch.zeros(layout_nbytes(layout), dtype=torch.uint8)
            reserved[key] = self.objects[key] = host_object(raw, layout)
        return reserved

    def finish_write(self, keys: list[Any]) -> None: ...
    def finish_read_prefetched(self, keys: list[Any]) -> None: ...

    @contextlib.contextmanager
    def read_prefetched_results(self, keys: list[Any]) -> Iterator[list[Any]]:
        yield [self.objects[k] for k in keys]


class FakeServerContext:
    def __init__(self, chunk_size: int) -> None:
        from lmcache.v1.multiprocess.engine_context import LayoutDescRegistry

        self.chunk_size = chunk_size
        self.separate_object_groups = False
        self.full_sw_kv = False
        self.layout_desc_registry = LayoutDescRegistry()
        self.storage_manager = FakeStorage()
        self.event_bus = _NoopBus()

    def resolve_obj_keys(self, key: Any, object_groups: list[int]) -> list[list[Any]]:
        chunks = range(key.start // self.chunk_size, key.end // self.chunk_size)
        return [[(key.request_id, g, c) for c in chunks] for g in object_groups]


@dataclass
class Key:
    request_id: str
    start: int
    end: int
    worker_id: int = 1
    cache_salt: str = ""


@dataclass
class Server:
    module: Any
    ctx: FakeServerContext
    engine_group_infos: list[Any]

    def block_ids(self, engine_block_ids: list[list[int]]) -> list[list[int]]:
        """Per-LMCache-group ids, exactly as the connector's worker adapter sends them."""
        from lmcache.v1.multiprocess.group_view import expand_engine_block_ids

        return expand_engine_block_ids(self.engine_group_infos, engine_block_ids)

    def store(self, request: str, num_tokens: int, engine_block_ids: list[list[int]]) -> bool:
        _, ok = self.module.store(
            Key(request, 0, num_tokens), 1, self.block_ids(engine_block_ids), b""
        )
        return ok

    def retrieve(self, request: str, num_tokens: int, engine_block_ids: list[list[int]]) -> bool:
        _, ok = self.module.retrieve(
            Key(request, 0, num_tokens), 1, self.block_ids(engine_block_ids), b"", 0
        )
        return ok


def layout_nbytes(layout: Any) -> int:
    """Bytes of one object of an LMCache memory layout (all its tensors)."""
    return sum(
        torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
        for s, d in zip(layout.shapes, layout.dtypes, strict=True)
    )


def host_object(raw: torch.Tensor, layout: Any = None) -> Any:
    """LMCache's real TensorMemoryObj over a flat uint8 CPU tensor, as the server holds."""
    from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

    per_layout = {"shapes": list(layout.shapes), "dtypes": list(layout.dtypes)} if layout else {}
    meta = MemoryObjMetadata(
        shape=raw.shape,
        dtype=torch.uint8,
        address=0,
        phy_size=raw.numel(),
        ref_count=1,
        **per_layout,
    )
    return TensorMemoryObj(raw, meta, None)


def connector_view(kv: HybridKV) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """What LMCacheMPConnector registers for ``kv``: the edited KV tensors and the group
    infos built from them under the layout hint."""
    from lmcache.integration.vllm.kv_cache_group_edits import apply_kv_cache_group_edits
    from lmcache.integration.vllm.kv_cache_groups import create_engine_group_infos_from_vllm

    hints = {"kv_layout": kv.layout}
    edited = apply_kv_cache_group_edits(kv.config, dict(kv.kv_caches), layout_hints=hints)
    return edited, create_engine_group_infos_from_vllm(kv.config, edited, layout_hints=hints)


def start_server(kv: HybridKV, chunk_size: int, monkeypatch: pytest.MonkeyPatch) -> Server:
    """Register ``kv`` the way LMCacheMPConnector does and return the server side."""
    from lmcache.utils import EngineType
    from lmcache.v1.gpu_connector.kv_format.detectors import vllm as vllm_detector
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as transfer

    # lmcache 0.5.3's detector forces HND on CPU; the GPU path honours the hint.
    monkeypatch.setattr(vllm_detector, "torch_device_type", "cuda")
    monkeypatch.setattr(transfer, "DeviceHostFuncDispatcher", _NoopDispatcher)
    monkeypatch.setattr(transfer, "get_event_ipc_backend", lambda device: _NoopEventBackend())
    monkeypatch.setattr(transfer, "submit_callback_to_stream", lambda *a, **k: None)

    hints = {"kv_layout": kv.layout}
    edited, infos = connector_view(kv)
    wire = over_the_queue(infos)
    ctx = FakeServerContext(chunk_size)
    module = transfer.LMCacheDrivenTransferModule(ctx)
    wrappers = [_Wrapper(t) for t in edited.values()]
    module.register_kv_cache(1, wrappers, "hybrid", 1, EngineType.VLLM, hints, wire)
    return Server(module, ctx, wire)
