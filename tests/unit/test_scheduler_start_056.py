"""The scheduler-side connector starts inside vLLM's own Scheduler (0.5.6 base).

vLLM's engine core builds the scheduler, whose constructor builds the KV connector through
vLLM's connector factory; the connector's own constructor builds LMCache's scheduler adapter,
which asks each server for its chunk size and its capabilities. Here all of it is real except
the server (a request client that answers that handshake as this build's server does) and the
model (a tiny OlmoHybrid config without weights; vLLM's CPU platform builds the engine config).
On a GPU, revision 6 of this base stopped every engine right there: the connector read an
attribute the real adapter did not have.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

from handshake_client import HandshakeClient, real_server_experimental  # noqa: E402
from vllm_sched_fakes import BLOCK, make_kv_cache_config  # noqa: E402

pytestmark = pytest.mark.bases("0.5.6")

KV_TRANSFER = {
    "kv_connector": "LMCacheMPConnector",
    "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
    "kv_role": "kv_both",
}


def engine_config(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM's own engine config of a hybrid model with this connector, on the CPU
    platform; a skip where this vLLM cannot inspect the model without packages the CPU
    test environment lacks (0.33 and later import the model's module to inspect it)."""
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
    args = EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,
        max_model_len=4096,
        block_size=BLOCK,
        enable_prefix_caching=True,
        kv_transfer_config=KV_TRANSFER,
    )
    try:
        return args.create_engine_config()
    except ValidationError as e:
        if "failed to be inspected" not in str(e):
            raise
        pytest.skip(f"this vLLM cannot inspect the model on this machine: {e.errors()[0]['msg']}")


def test_a_hybrid_engine_s_scheduler_starts_with_the_connector(tmp_path, monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from hybridfa_gate.models import MODELS, write_model_dir
    from lmcache.integration.vllm import vllm_multi_process_adapter as vmpa

    config = engine_config(write_model_dir(MODELS["olmo-r5"], tmp_path), monkeypatch)
    server = HandshakeClient(BLOCK, real_server_experimental())
    monkeypatch.setattr(vmpa.RequestClientFactory, "create", lambda *_, **__: server)
    kv_cache_config = make_kv_cache_config(0)
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )
    assert type(scheduler.connector).__name__ == "LMCacheMPConnector"
    assert scheduler.connector._cache_refused is None
