"""vLLM's own engine config of a tiny hybrid model (a config without weights), built on
vLLM's CPU platform (vLLM 0.29 and later; the connector's modules must import)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

KV_TRANSFER = {
    "kv_connector": "LMCacheMPConnector",
    "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
    "kv_role": "kv_both",
}


def create_engine_config(engine_args: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """``EngineArgs(**engine_args).create_engine_config()``; a skip where this vLLM cannot
    inspect the model without packages this machine lacks (0.33 and later import the model's
    module to inspect it)."""
    import vllm.platforms
    from pydantic import ValidationError
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.cpu import CpuPlatform

    # vLLM's modules bind the platform when first imported (here by earlier imports).
    cpu = CpuPlatform()
    monkeypatch.setattr(vllm.platforms, "_current_platform", cpu)
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.") and "current_platform" in vars(module):
            monkeypatch.setattr(module, "current_platform", cpu)
    # vLLM 0.34's CPU platform asks for triton-cpu, which no kernel here runs.
    monkeypatch.setattr("vllm.triton_utils.HAS_TRITON", True, raising=False)
    try:
        return EngineArgs(**engine_args).create_engine_config()
    except ValidationError as e:
        if "failed to be inspected" not in str(e):
            raise
        pytest.skip(f"this vLLM cannot inspect the model on this machine: {e.errors()[0]['msg']}")


def engine_config(model_dir: Path, block_size: int, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The engine config of the model in ``model_dir`` with LMCache's multiprocess connector."""
    args = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "max_model_len": 4096,
        "block_size": block_size,
        "enable_prefix_caching": True,
        "kv_transfer_config": KV_TRANSFER,
    }
    return create_engine_config(args, monkeypatch)
