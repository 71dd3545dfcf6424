"""The LoRA adapters of the gate's LoRA cases (hybridfa_gate.lora)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridfa_gate import lora
from hybridfa_gate.models import MODELS


def test_an_adapter_is_drawn_from_its_seed_alone(tmp_path: Path) -> None:
    m = MODELS["qwen35-r5"]
    a = lora.write_adapter(m, "A", tmp_path / "one", tmp_path / "model")
    again = lora.write_adapter(m, "A", tmp_path / "two", tmp_path / "model")
    b = lora.write_adapter(m, "B", tmp_path / "one", tmp_path / "model")
    data = (a / "adapter_model.safetensors").read_bytes()
    assert data == (again / "adapter_model.safetensors").read_bytes()
    assert data != (b / "adapter_model.safetensors").read_bytes()
    config = json.loads((a / "adapter_config.json").read_text())
    assert config["r"] == lora.RANK and config["target_modules"] == list(lora.TARGETS)
    assert config["base_model_name_or_path"] == str(tmp_path / "model")


def test_the_adapter_file_is_a_safetensors_file_of_the_fa_layers_projections(
    tmp_path: Path,
) -> None:
    safetensors = pytest.importorskip("safetensors")
    torch = pytest.importorskip("torch")
    m = MODELS["qwen35-r5"]
    folder = lora.write_adapter(m, "B", tmp_path, tmp_path / "model")
    with safetensors.safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    assert len(tensors) == 2 * 3 * 2  # FA layers 3 and 7, k/v/o, A and B
    kv = m.num_kv_heads * m.head_dim
    prefix = "base_model.model.model.language_model.layers.7.self_attn"
    assert tuple(tensors[f"{prefix}.k_proj.lora_A.weight"].shape) == (lora.RANK, m.hidden_size)
    assert tuple(tensors[f"{prefix}.v_proj.lora_B.weight"].shape) == (kv, lora.RANK)
    o_in = m.num_attention_heads * m.head_dim
    assert tuple(tensors[f"{prefix}.o_proj.lora_A.weight"].shape) == (lora.RANK, o_in)
    b = tensors[f"{prefix}.k_proj.lora_B.weight"]
    assert b.dtype == torch.float32 and 0.03 < float(b.std()) < 0.07  # not PEFT's zero B


def test_only_the_qwen35_family_has_adapters() -> None:
    with pytest.raises(ValueError, match="Qwen3.5"):
        lora.adapter_tensors(MODELS["olmo-r5"], 1)
