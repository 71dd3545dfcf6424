"""What a vLLM engine says about its stored KV bytes beyond its KV cache spec, and
LMCache's real worker-side connector registering a HybridKV under it.

vLLM builds the same KV cache spec and uint8 tensors for ``--kv-cache-dtype
fp8_e4m3`` and ``fp8_e5m2``; the model's revision, quantization and weights do not
show in the spec either. Only the engine's config tells them apart: vLLM's real
``CacheConfig`` and ``LoadConfig``, a duck-typed ``ModelConfig`` (a real one loads a
Hugging Face config) and, in ``compilation_config.static_forward_context``, stand-ins
for the attention layers with the fields vLLM's ``Attention`` keeps (``kv_cache_dtype``,
``calculate_kv_scales``, the ``_k_scale`` / ``_v_scale`` tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hybrid_kv import FA_DTYPE, FA_LAYERS, NUM_LAYERS, HybridKV, layer_name


@dataclass(frozen=True)
class Engine:
    """One engine's model identity and KV quantization."""

    revision: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    k_scale: float = 1.0
    weights: str | None = None  # a local directory holding the model's weights

    @property
    def fa_dtype(self) -> torch.dtype:
        """vLLM's KV cache spec dtype: uint8 for every fp8 format."""
        return torch.uint8 if self.kv_cache_dtype.startswith("fp8") else FA_DTYPE

    def vllm_config(self, model: str, kv: HybridKV) -> Any:
        from vllm.config import CacheConfig, LoadConfig

        cache = CacheConfig(
            block_size=kv.tokens_per_block,
            cache_dtype=self.kv_cache_dtype,  # type: ignore[arg-type]
            mamba_cache_mode="align",
        )
        layers = {layer_name(i): self._layer(i) for i in range(NUM_LAYERS)}
        extra: dict[str, Any] = {}
        return SimpleNamespace(
            cache_config=cache,
            load_config=LoadConfig(),
            compilation_config=SimpleNamespace(static_forward_context=layers),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=kv.tokens_per_block),
            kv_transfer_config=SimpleNamespace(
                kv_connector_extra_config=extra,
                get_from_extra_config=lambda key, default: extra.get(key, default),
            ),
            parallel_config=SimpleNamespace(
                world_size=1,
                rank=0,
                tensor_parallel_size=1,
                pipeline_parallel_size=1,
                data_parallel_size=1,
            ),
            model_config=SimpleNamespace(
                model=model,
                model_weights=self.weights or "",
                revision=self.revision,
                code_revision=None,
                quantization=self.quantization,
                dtype=torch.bfloat16,
                hf_overrides={},
                use_mla=False,
                is_hybrid=True,
            ),
        )

    def _layer(self, i: int) -> Any:
        if i not in FA_LAYERS:
            return SimpleNamespace()  # a GDN layer keeps no KV quantization
        return SimpleNamespace(
            kv_cache_dtype=self.kv_cache_dtype,
            calculate_kv_scales=False,
            _k_scale=torch.tensor(self.k_scale),
            _v_scale=torch.tensor(1.0),
        )


class _CapturingWorkerAdapter:
    """Stands in for LMCacheMPWorkerAdapter: keeps what the connector registers."""

    def __init__(self) -> None:
        self.kv_caches: dict[str, Any] = {}
        self.engine_group_infos: list[Any] = []

    def register_kv_caches(self, kv_caches: dict[str, Any], engine_group_infos: Any = None):
        self.kv_caches = dict(kv_caches)
        self.engine_group_infos = list(engine_group_infos or [])


def register_through_connector(
    engine: Engine, model: str, kv: HybridKV
) -> tuple[dict[str, Any], list[Any]]:
    """LMCacheMPConnector.register_kv_caches (real worker-side connector, real
    __init__) of ``kv`` under ``engine``: the edited KV caches and the group infos
    it sends to the server."""
    import lmcache.integration.vllm.lmcache_mp_connector as mpc

    worker = _CapturingWorkerAdapter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mpc, "LMCacheMPWorkerAdapter", lambda **_: worker)
        mp.setattr(mpc, "vllm_layout_hints", lambda: {"kv_layout": kv.layout})
        connector = mpc.LMCacheMPConnector(
            engine.vllm_config(model, kv), mpc.KVConnectorRole.WORKER, kv.config
        )
        connector.register_kv_caches(dict(kv.kv_caches))
    return worker.kv_caches, worker.engine_group_infos
