"""The vLLM interfaces the gate's engine process relies on, checked against the installed vLLM
(tests/run also runs this file over vLLM 0.27.1's and 0.28.0's Python code). Where a module
cannot be imported on a CPU machine, its source is read instead."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

from hybridfa_gate import engine_proc, lora
from hybridfa_gate.cases import named_cases
from hybridfa_gate.models import MODELS
from hybridfa_gate.specs import RunConfig, engine_spec

pytest.importorskip("vllm")


def _source(module: str) -> str:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return Path(spec.origin).read_text()


def test_every_engine_spec_is_a_set_of_llm_arguments_vllm_knows(tmp_path: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    rc = RunConfig(arm="patched", lmcache_dir=tmp_path, out=tmp_path, kv_cache_memory_bytes=1 << 30)
    adapters = {"A": "/a", "B": "/b"}
    seen: set[str] = set()
    for case in named_cases():
        for role in ("cold", "store", "restore"):
            spec = engine_spec(case, role, tmp_path, rc, 5555, None, adapters=adapters)
            spec["log_stats"] = True
            kwargs = engine_proc.llm_kwargs(spec)
            assert set(kwargs) <= known, set(kwargs) - known
            seen |= set(kwargs)
    assert {"kv_cache_dtype", "enable_lora", "max_lora_rank", "max_loras"} <= seen


def test_lora_requests_and_timed_requests_take_an_adapter() -> None:
    from vllm.v1.engine.llm_engine import LLMEngine

    reqs = engine_proc.lora_requests({"lora": {"adapters": {"B": "/b", "A": "/a"}}})
    assert {n: (r.lora_name, r.lora_int_id, r.lora_path) for n, r in reqs.items()} == {
        "A": ("A", 1, "/a"),
        "B": ("B", 2, "/b"),
    }
    assert "lora_request" in inspect.signature(LLMEngine.add_request).parameters


def test_the_prefill_stats_split_local_and_external_hits() -> None:
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.metrics.stats import PrefillStats

    assert "prefill_stats" in EngineCoreOutput.__struct_fields__
    fields = {f.name for f in dataclasses.fields(PrefillStats)}
    assert {"num_local_cached_tokens", "num_external_cached_tokens"} <= fields


def test_the_v1_model_runner_has_what_the_worker_hooks_read() -> None:
    src = _source("vllm.v1.worker.gpu_model_runner")
    assert re.search(r"def _update_states\(self, scheduler_output", src)
    assert "self.requests: dict[str, CachedRequestState] = {}" in src
    assert "static_forward_context" in src and "self.kv_cache_config" in src
    state = _source("vllm.v1.worker.gpu_input_batch")
    assert "block_ids: tuple[list[int], ...]" in state and "prompt_token_ids" in state
    assert "num_computed_tokens: int" in state


def test_hybrid_models_default_to_the_v1_model_runner_and_the_env_can_pin_it() -> None:
    src = _source("vllm.config.vllm")
    assert "envs.VLLM_USE_V2_MODEL_RUNNER" in src and "is_hybrid" in src
    assert "VLLM_USE_V2_MODEL_RUNNER" in _source("vllm.envs")


def test_the_attention_backends_take_the_fp8_kv_caches_the_cases_ask_for() -> None:
    flashinfer = _source("vllm.v1.attention.backends.flashinfer")
    listed = flashinfer[flashinfer.index("supported_kv_cache_dtypes") :][:400]
    assert '"fp8_e4m3"' in listed and '"fp8_e5m2"' in listed
    flash_attn = _source("vllm.v1.attention.backends.flash_attn")
    listed = flash_attn[flash_attn.index("supported_kv_cache_dtypes") :][:200]
    supports = flash_attn[flash_attn.index("def supports_kv_cache_dtype") :][:600]
    assert '"fp8_e4m3"' in supports or '"fp8_e4m3"' in listed  # 0.26 names it in the method
    fp8_fa = {c.kv_dtype for c in named_cases() if c.backend == "FLASH_ATTN"} - {"auto"}
    assert fp8_fa <= {"fp8", "fp8_e4m3"}


def test_the_gates_adapter_loads_as_qwen35_lora_modules(tmp_path: Path) -> None:
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name
    from vllm.model_executor.models.utils import WeightsMapper

    # Qwen3_5ForConditionalGeneration inherits Qwen3-VL's mapper and LoRA support
    vl = _source("vllm.model_executor.models.qwen3_vl")
    assert '"model.language_model.": "language_model.model."' in vl
    qwen35 = _source("vllm.model_executor.models.qwen3_5")
    assert "class Qwen3_5ForConditionalGeneration(Qwen3VLForConditionalGeneration" in qwen35
    assert re.search(r"class Qwen3VLForConditionalGeneration\([^)]*SupportsLoRA", vl, re.S)
    m = MODELS["qwen35-r5"]
    folder = lora.write_adapter(m, "A", tmp_path, tmp_path / "model")
    helper = PEFTHelper.from_local_dir(str(folder), max_position_embeddings=None)
    assert helper.r == lora.RANK and not helper._validate_features()
    mapper = WeightsMapper(orig_to_new_prefix={"model.language_model.": "language_model.model."})
    names = {parse_fine_tuned_lora_name(n, mapper) for n in lora.adapter_tensors(m, 1)}
    assert {n for n, _ in names} == {
        f"language_model.model.layers.{i}.self_attn.{p}" for i in (3, 7) for p in lora.TARGETS
    }


def test_the_in_process_engine_loop_the_timed_requests_drive() -> None:
    """LLMEngine.step over an in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0): the
    client whose get_output the prefill tap wraps, and the scheduler's connector whose lookups
    the restore timeline records."""
    core_client = _source("vllm.v1.engine.core_client")
    inproc = core_client[core_client.index("class InprocClient") :][:3000]
    assert "self.engine_core = EngineCore(" in inproc and "def get_output(self)" in inproc
    assert "def step(self)" in _source("vllm.v1.engine.llm_engine")
    assert "def collective_rpc(" in _source("vllm.entrypoints.llm")
    base = _source("vllm.distributed.kv_transfer.kv_connector.v1.base")
    assert "def get_num_new_matched_tokens(" in base


def test_vllm_configs_name_the_compilation_and_cuda_graph_modes_the_gate_reads_back() -> None:
    """``engine_proc.resolved_compilation`` and ``worker.rpc_compilation`` read these fields."""
    from vllm.config import CompilationConfig, ModelConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    fields = {f.name for f in dataclasses.fields(CompilationConfig)}
    assert {"mode", "cudagraph_mode", "max_cudagraph_capture_size"} <= fields
    assert "enforce_eager" in {f.name for f in dataclasses.fields(ModelConfig)}
    assert CUDAGraphMode.NONE.name == "NONE" and CompilationMode.VLLM_COMPILE.name == "VLLM_COMPILE"
