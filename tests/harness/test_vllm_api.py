"""The vLLM interfaces the gate's engine process relies on, checked against the installed vLLM
(tests/run also runs this file over other vLLMs' Python code). Where a module cannot be imported
on a CPU machine, its source is read instead."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import re
from pathlib import Path

import pytest
from runner_fakes import DRAFTER

from hybridfa_gate import engine_proc, lora, procs, worker
from hybridfa_gate.cases import named_cases, release
from hybridfa_gate.models import MODELS, model_config_dict
from hybridfa_gate.specs import RunConfig, engine_spec

vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.bases("0.5.3", "0.5.6")  # the gate's engines, on either base's vLLMs

V1_MODULE, V2_MODULE = "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"


def _source(module: str) -> str:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return Path(spec.origin).read_text()


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _method(src: str, name: str) -> str:
    """The source of method ``name`` of a class in ``src`` (to the next method)."""
    m = re.search(rf"\n    def {name}\(.*?(?=\n    (?:@|def )|\n\S|\Z)", src, re.S)
    assert m is not None, name
    return m.group(0)


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


def _holds(src: str, attrs: tuple[str, ...]) -> None:
    """Each of ``attrs`` (what worker.runner_kind looks for) is set or defined in ``src``."""
    for a in attrs:
        assert re.search(rf"self\.{a}(: [^=]+)? = |\n    def {a}\(", src), a


def _runner_vllm_picks(arch: str, mtp: bool, graphs: bool, tp: int) -> str:
    """The model runner vLLM picks for a gate engine of a hybrid model ``arch``
    (``VllmConfig.use_v2_model_runner``, VLLM_USE_V2_MODEL_RUNNER unset), over the settings it
    reads, as ``engine_proc.llm_kwargs`` makes them: "V1" or "V2"."""
    from types import SimpleNamespace as NS

    from vllm.config import vllm as config
    from vllm.config.compilation import CompilationMode

    mode = CompilationMode.VLLM_COMPILE if graphs else CompilationMode.NONE
    settings = {
        "model_config": NS(
            runner_type="generate",
            architectures=[arch],
            is_hybrid=True,
            is_attention_free=False,
            is_moe=False,
            is_diffusion=False,
            use_mla=False,
            logits_processors=None,
            enable_prompt_embeds=False,
            enable_return_routed_experts=False,
        ),
        "speculative_config": (
            NS(method="mtp", parallel_drafting=False, use_heterogeneous_vocab=False)
            if mtp
            else None
        ),
        "parallel_config": NS(
            tensor_parallel_size=tp,
            pipeline_parallel_size=1,
            prefill_context_parallel_size=1,
            distributed_executor_backend=None,
            enable_dbo=False,
            use_ubatching=False,
            enable_elastic_ep=False,
        ),
        "compilation_config": NS(mode=mode, pass_config=NS(enable_sp=False)),
        "cache_config": NS(mamba_cache_mode="align", kv_sharing_fast_prefill=False),
        "attention_config": NS(hisparse_config=None),
        "ec_transfer_config": None,
    }
    cfg = object.__new__(config.VllmConfig)  # the property's own code, on these settings only
    for name, value in settings.items():
        object.__setattr__(cfg, name, value)
    return "V2" if cfg.use_v2_model_runner else "V1"


def test_hybrid_models_run_on_the_model_runner_vllm_picks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM 0.26-0.28 run hybrid models on the V1 model runner; 0.29-0.33 on Model Runner V2
    (where no feature it lacks is asked for: none the gate asks for); 0.34 has V2 only and
    refuses VLLM_USE_V2_MODEL_RUNNER=0. The gate sets no VLLM_USE_V2_MODEL_RUNNER."""
    from vllm.config import vllm as config

    expected = "V1" if release(vllm.__version__) < (0, 29) else "V2"
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert "VLLM_USE_V2_MODEL_RUNNER" not in procs.child_env(None, "NHD")
    worker_src = _source("vllm.v1.worker.gpu_worker")
    assert f"from {V2_MODULE} import" in worker_src
    if not hasattr(config.VllmConfig, "use_v2_model_runner"):  # V1 removed (0.34)
        assert expected == "V2" and not _has(V1_MODULE)
        refusal = _source("vllm.platforms.interface")
        assert re.search(r"VLLM_USE_V2_MODEL_RUNNER=\{value\} is no longer supported", refusal)
        return
    assert "self.use_v2_model_runner = vllm_config.use_v2_model_runner" in worker_src
    monkeypatch.setattr(config, "HAS_TRITON", True)  # the GPU node's vLLM has Triton
    archs = {model_config_dict(m)["architectures"][0] for m in MODELS.values()}
    assert archs == {"OlmoHybridForCausalLM", "Qwen3_5ForConditionalGeneration"}
    for arch in sorted(archs):
        for mtp, graphs, tp in ((False, False, 1), (True, True, 2)):
            assert _runner_vllm_picks(arch, mtp, graphs, tp) == expected, (arch, mtp, graphs)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # still honoured before 0.34
    assert _runner_vllm_picks("Qwen3_5ForConditionalGeneration", False, False, 1) == "V1"


def test_the_v1_model_runner_holds_what_the_worker_hooks_read() -> None:
    """runner_fakes.V1Runner's names, in vllm/v1/worker/gpu_model_runner.py (0.26-0.33)."""
    if not _has(V1_MODULE):
        pytest.skip("this vLLM has no V1 model runner")
    src = _source(V1_MODULE)
    _holds(src, worker.V1_ATTRS)
    assert re.search(r"def _update_states\(self, scheduler_output", src)
    assert "self.requests: dict[str, CachedRequestState] = {}" in src
    assert re.search(r"self\.drafter(: .*)? = ", src) and DRAFTER["V1"] == "drafter"
    assert "static_forward_context" in src and "self.kv_cache_config" in src
    assert "def get_model(self)" in src
    state = _source("vllm.v1.worker.gpu_input_batch")
    assert "block_ids: tuple[list[int], ...]" in state and "prompt_token_ids" in state
    assert "num_computed_tokens: int" in state
    # each step's state update (block ids included) runs before the forward pass
    execute = _method(src, "execute_model")
    assert execute.index("self._update_states(scheduler_output)") < execute.index("_model_forward(")


def test_the_v2_model_runner_holds_what_the_worker_hooks_read() -> None:
    """runner_fakes.V2Runner's names, in vllm/v1/worker/gpu/ (Model Runner V2): the request
    rows and computed tokens (states.py), the block tables (block_table.py: a row's ids are
    written by append_block_ids alone, which add_requests and update_requests call; the
    GPU table gets them from staged writes), the MTP layer (spec_decode)."""
    if not _has(V2_MODULE):
        pytest.skip("this vLLM has no Model Runner V2")
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    src = _source(V2_MODULE)
    _holds(src, worker.V2_ATTRS)
    assert "self.req_states = RequestState(" in src and "self.block_tables = BlockTables(" in src
    assert re.search(r"self\.speculator(: .*)? = ", src) and DRAFTER["V2"] == "speculator"
    assert "self.kv_cache_config = kv_cache_config" in src and "def get_model(self)" in src
    assert "self.compilation_config.static_forward_context" in src  # the layers' KV caches
    # each step: requests dropped and added, then update_requests (the hook records after
    # it), then the staged block-table writes reach the GPU, then the inputs and forward
    execute = _method(src, "execute_model")
    order = [
        "self.finish_requests(scheduler_output)",
        "self.add_requests(scheduler_output)",
        "self.update_requests(scheduler_output)",
        "self.block_tables.apply_staged_writes()",
        "self.prepare_inputs(",
    ]
    at = [execute.index(s) for s in order]
    assert at == sorted(at), dict(zip(order, at, strict=True))
    methods = re.findall(r"\n    def (\w+)\(", src)
    writers = [m for m in methods if "block_tables.append_block_ids(" in _method(src, m)]
    assert writers == ["add_requests", "update_requests"]
    tables = _source("vllm.v1.worker.gpu.block_table")
    assert re.search(
        r"def append_block_ids\(\s*self,\s*req_index: int,\s*new_block_ids: tuple\[list\[int\], "
        r"\.\.\.\],\s*overwrite: bool,",
        tables,
    )
    assert tables.count("stage_write(") == 1 and ".stage_write(" in _method(
        tables, "append_block_ids"
    )
    assert "self.block_tables: list[StagedWriteTensor] = []" in tables
    assert "self.num_blocks = UvaBackedTensor(" in tables
    assert "self.num_blocks.np[i, req_index] = " in _method(tables, "append_block_ids")
    buffers = _source("vllm.v1.worker.gpu.buffer_utils")
    assert "self.gpu = " in buffers and "self.np = self.cpu.numpy()" in buffers
    states = _source("vllm.v1.worker.gpu.states")
    assert "self.req_id_to_index: dict[str, int] = {}" in states
    assert "self.num_computed_tokens_np = np.zeros(" in states
    assert "num_computed_tokens_np[req_index] = num_computed_tokens" in _method(
        src, "update_requests"
    )
    speculator = _source("vllm.v1.worker.gpu.spec_decode.speculator")
    assert "class DraftModelSpeculator(" in speculator and "self.model = " in speculator
    # what the hook reads of each step's SchedulerOutput (and the fakes' step() holds)
    assert {"req_id", "prompt_token_ids", "block_ids", "num_computed_tokens"} <= {
        f.name for f in dataclasses.fields(NewRequestData)
    }
    assert {"req_ids", "num_computed_tokens", "new_block_ids"} <= {
        f.name for f in dataclasses.fields(CachedRequestData)
    }
    fields = {f.name for f in dataclasses.fields(SchedulerOutput)}
    assert {"scheduled_new_reqs", "scheduled_cached_reqs", "finished_req_ids"} <= fields


def test_the_gate_sets_only_vllm_variables_this_vllm_knows() -> None:
    """vLLM 0.34 refuses an engine whose environment holds a VLLM_ variable it removed
    (warns of one it does not know)."""
    from vllm import envs

    env = procs.child_env(None, "HND")
    ours = {k for k in env if k.startswith("VLLM_") and k not in os.environ}
    assert ours == {
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "VLLM_ALLOW_INSECURE_SERIALIZATION",
        "VLLM_KV_CACHE_LAYOUT",
    }
    assert ours <= set(envs.environment_variables)
    assert not ours & set(getattr(envs, "removed_environment_variables", {}))


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
