"""The gate's tiny models and the geometry vLLM derives from them (hybridfa_gate.models)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from hybridfa_gate import models
from hybridfa_gate.models import MODELS, Geometry, expected_geometry

pytestmark = pytest.mark.bases("0.5.3", "0.5.6")  # the gate's models, on either base's vLLMs


@pytest.mark.parametrize("name", sorted(MODELS))
def test_expected_geometry_of_each_tiny_model(name: str) -> None:
    ratio = int(name.rsplit("-r", 1)[1])
    n = {5: 80, 17: 544, 25: 1600}[ratio]  # N of each ratio
    assert expected_geometry(MODELS[name]) == Geometry(n, n // ratio, ratio)


def test_expected_geometry_matches_the_three_required_ratios() -> None:
    got = {(g.block_size, g.kernel_page, g.ratio) for g in map(expected_geometry, MODELS.values())}
    assert got == {(80, 16, 5), (544, 32, 17), (1600, 64, 25)}


def test_select_kernel_page_is_largest_dividing_size() -> None:
    assert models.select_kernel_page(80) == 16
    assert models.select_kernel_page(544) == 32
    assert models.select_kernel_page(1600) == 64
    assert models.select_kernel_page(32) == 32
    with pytest.raises(ValueError):
        models.select_kernel_page(40)


def test_an_fp8_kv_cache_halves_the_fa_bytes_and_about_doubles_n() -> None:
    m = MODELS["qwen35-r5"]
    assert models.attn_bytes_per_token(m, kv_cache_dtype="fp8_e4m3") * 2 == (
        models.attn_bytes_per_token(m)
    )
    assert models.mamba_page_bytes(m) == 137_216  # the state dtypes do not change
    assert expected_geometry(m, kv_cache_dtype="fp8_e5m2") == Geometry(144, 16, 9)


class _FlashInferLike:
    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: object = None) -> list[int]:
        return list(models.FLASHINFER_KERNEL_SIZES)  # vLLM 0.33+ passes the spec


def _config_class(module: str, name: str) -> type:
    """vLLM's config class of a model type; vLLM 0.33+ dropped its own where the
    transformers it pins has one, and loads that."""
    try:
        return getattr(importlib.import_module(f"vllm.transformers_utils.configs.{module}"), name)
    except ModuleNotFoundError:
        return getattr(importlib.import_module(f"transformers.models.{module}"), name)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_geometry_agrees_with_vllm_specs(name: str, kv_cache_dtype: str) -> None:
    """Page sizes from vLLM's own spec classes and state-shape calculator."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    m = MODELS[name]
    dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        1,
        m.linear_num_key_heads,
        m.linear_num_value_heads,
        m.linear_key_head_dim,
        m.linear_value_head_dim,
        m.conv_kernel,
        0,
    )
    mamba = MambaSpec(shapes=shapes, dtypes=(dt[m.kv_dtype], dt[m.ssm_dtype]), block_size=-1)
    fa_dtype = dt[m.kv_dtype] if kv_cache_dtype == "auto" else torch.float8_e4m3fn
    attn = FullAttentionSpec(
        block_size=1, num_kv_heads=m.num_kv_heads, head_size=m.head_dim, dtype=fa_dtype
    )
    assert mamba.page_size_bytes == models.mamba_page_bytes(m)
    assert attn.page_size_bytes == models.attn_bytes_per_token(m, 1, kv_cache_dtype)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_kernel_page_agrees_with_vllm_select_common_block_size(name: str) -> None:
    # vllm.v1.worker.utils pulls in einops (absent from the CPU venv): skip there.
    utils = pytest.importorskip("vllm.v1.worker.utils")
    g = expected_geometry(MODELS[name])
    assert utils.select_common_block_size(g.block_size, [_FlashInferLike]) == g.kernel_page


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_config_loads_in_vllm_config_classes(name: str) -> None:
    pytest.importorskip("transformers")
    m = MODELS[name]
    cfg = models.model_config_dict(m)
    if m.family == "olmo_hybrid":
        c = _config_class("olmo_hybrid", "OlmoHybridConfig")(**cfg)
        text = c
        assert c.hidden_size // c.num_attention_heads == m.head_dim
    else:
        c = _config_class("qwen3_5", "Qwen3_5Config")(**cfg)
        text = c.text_config
        assert text.head_dim == m.head_dim
        assert text.mamba_ssm_dtype == "float32"
        rope = text.rope_parameters
        assert sum(rope["mrope_section"]) == int(m.head_dim * 0.25) // 2
    assert text.layer_types.count("full_attention") == 2
    assert text.layer_types.count("linear_attention") == 6
    assert text.linear_num_value_heads == m.linear_num_value_heads


def test_write_model_dir(tmp_path: Path) -> None:
    d = models.write_model_dir(MODELS["olmo-r5"], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["OlmoHybridForCausalLM"]
    assert sorted(p.name for p in d.iterdir()) == ["config.json"]  # no tokenizer to load


def test_the_qwen35_tokenizer_holds_the_vision_tokens_at_the_configs_ids(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    d = models.write_model_dir(MODELS["qwen35-r5"], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(d)
    text = cfg["text_config"]
    assert len(tokenizer) == text["vocab_size"]
    assert tokenizer.pad_token_id == text["pad_token_id"]
    assert tokenizer.eos_token_id == text["eos_token_id"]
    keys = ("image", "video", "vision_start", "vision_end")
    for token, key in zip(models.VISION_TOKENS, keys, strict=True):
        assert tokenizer.convert_tokens_to_ids(token) == cfg[f"{key}_token_id"]


def test_engines_load_the_tokenizer_of_a_folder_that_has_one(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from hybridfa_gate.engine_proc import llm_kwargs

    spec = {"gpu_memory_utilization": 0.1, "max_model_len": 512, "max_num_batched_tokens": 159}
    spec["tensor_parallel_size"] = 1
    for name, skips in (("qwen35-r5", False), ("olmo-r5", True)):
        spec["model_dir"] = str(models.write_model_dir(MODELS[name], tmp_path))
        assert llm_kwargs(spec)["skip_tokenizer_init"] is skips


def test_a_qwen35_store_engine_builds_its_input_processor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On vLLM 0.31 an engine with a KV connector builds a multimodal model's processor even
    in language-model-only mode (it accepts pre-computed embeddings), and the processor loads
    the tokenizer and the image processor's settings: the gate's store engine, as the gate
    writes its spec and model folder, on vLLM's CPU platform. A skip where vLLM cannot
    inspect Qwen3.5 there (its module imports torchvision)."""
    pytest.importorskip("lmcache")
    processor = pytest.importorskip("vllm.v1.engine.input_processor")
    from vllm_cpu_engine import create_engine_config

    from hybridfa_gate import engine_proc
    from hybridfa_gate.cases import select_cases
    from hybridfa_gate.specs import RunConfig, store_spec

    case = select_cases("qwen35-r5-HND-c2N-exact")[0]
    model_dir = models.write_model_dir(case.spec, tmp_path / "models")
    rc = RunConfig(arm="patched", lmcache_dir=tmp_path, out=tmp_path)
    spec = store_spec(case, model_dir, rc, port=1, l2=tmp_path / "l2")
    config = create_engine_config(engine_proc.llm_kwargs(spec), monkeypatch)
    assert config.model_config.multimodal_config.language_model_only
    assert processor.InputProcessor(config).renderer.tokenizer is not None


def test_mtp_lengthens_the_conv_state_in_the_expected_page() -> None:
    m = MODELS["qwen35-r5"]
    conv_dim = 2 * 4 * 64 + 8 * 64
    assert models.mamba_page_bytes(m, spec_tokens=2) - models.mamba_page_bytes(m) == conv_dim * 4


def test_mtp_model_config_takes_vllms_mtp_path() -> None:
    pytest.importorskip("transformers")
    from vllm.config.speculative import SpeculativeConfig

    config = _config_class("qwen3_5", "Qwen3_5Config")
    cfg = config(**models.model_config_dict(MODELS["qwen35-r5"], mtp=True))
    assert cfg.text_config.mtp_num_hidden_layers == 1
    draft = SpeculativeConfig.hf_config_override(cfg)
    assert draft.architectures == ["Qwen3_5MTP"] and draft.n_predict == 1
    with pytest.raises(ValueError, match="MTP"):
        models.model_config_dict(MODELS["olmo-r5"], mtp=True)


def test_a_correct_chunk_holds_every_layers_pages() -> None:
    # olmo-r5: a correct 80-token chunk is 8 layers x 81,920 B.
    assert models.expected_chunk_bytes(MODELS["olmo-r5"], 80) == 655_360


def test_a_patched_chunk_is_an_fa_object_of_the_chunk_and_a_gdn_object_of_one_block() -> None:
    # olmo-r5, chunk 2N, as measured on an H200 (2026-11-30): FA 327,720 B and GDN 491,560 B
    # objects, each with its 40-byte trailer.
    m = MODELS["olmo-r5"]
    assert models.fa_object_bytes(m, 160) + 40 == 327_720
    assert models.gdn_object_bytes(m) + 40 == 491_560
