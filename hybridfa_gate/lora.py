"""LoRA adapters of a tiny Qwen3.5 model, as PEFT adapter folders vLLM loads.

An adapter targets the full-attention layers' k_proj, v_proj and o_proj (the recurrent layers
have none of them), rank ``RANK``, with random A and B matrices drawn from a seed, so the KV of
every FA layer differs between two adapters and the base model. Written with the standard
library only (``adapter_model.safetensors`` is a JSON header and little-endian float32).
"""

from __future__ import annotations

import json
import os
import random
import struct
import threading
from pathlib import Path
from typing import Any

from hybridfa_gate.models import ModelSpec, atomic_write, fa_layers

RANK = 8
ALPHA = 16
STD = 0.05  # of A and B: the update B @ A * ALPHA / RANK is of the order of the base weights
TARGETS = ("k_proj", "v_proj", "o_proj")
# The checkpoint names of Qwen3_5ForConditionalGeneration's text model; vLLM maps
# "model.language_model." to its own "language_model.model." (hf_to_vllm_mapper).
PREFIX = "base_model.model.model.language_model.layers"
SEEDS = {"A": 1, "B": 2}  # the gate's two adapters


def module_shapes(m: ModelSpec) -> dict[str, tuple[int, int]]:
    """(out, in) of each target module in one attention layer."""
    kv = m.num_kv_heads * m.head_dim
    return {
        "k_proj": (kv, m.hidden_size),
        "v_proj": (kv, m.hidden_size),
        "o_proj": (m.hidden_size, m.num_attention_heads * m.head_dim),
    }


def adapter_tensors(m: ModelSpec, seed: int) -> dict[str, tuple[tuple[int, int], list[float]]]:
    """{tensor name: (shape, values)} of the adapter drawn from ``seed``."""
    if m.family != "qwen3_5":
        raise ValueError(f"{m.name}: the gate's LoRA adapters are for the Qwen3.5 family")
    rng = random.Random(f"hybridfa-lora-{seed}")
    out: dict[str, tuple[tuple[int, int], list[float]]] = {}
    for layer in fa_layers(m):
        for module, (dout, din) in module_shapes(m).items():
            name = f"{PREFIX}.{layer}.self_attn.{module}"
            for part, shape in (("lora_A", (RANK, din)), ("lora_B", (dout, RANK))):
                values = [rng.gauss(0.0, STD) for _ in range(shape[0] * shape[1])]
                out[f"{name}.{part}.weight"] = (shape, values)
    return out


def safetensors_bytes(tensors: dict[str, tuple[tuple[int, int], list[float]]]) -> bytes:
    """A safetensors file of float32 tensors: u64 header length, JSON header, data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        shape, values = tensors[name]
        blob = struct.pack(f"<{len(values)}f", *values)
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def adapter_config(model_dir: Path | str) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def write_adapter(m: ModelSpec, name: str, root: Path, model_dir: Path | str) -> Path:
    """The PEFT folder of adapter ``name`` (a key of SEEDS) of ``m`` under ``root``."""
    d = Path(root) / f"{m.name}-lora-{name}"
    d.mkdir(parents=True, exist_ok=True)
    data = safetensors_bytes(adapter_tensors(m, SEEDS[name]))
    tmp = d / f".adapter_model.safetensors.{os.getpid()}.{threading.get_ident()}"
    tmp.write_bytes(data)
    tmp.replace(d / "adapter_model.safetensors")
    atomic_write(d / "adapter_config.json", json.dumps(adapter_config(model_dir), indent=1) + "\n")
    return d
