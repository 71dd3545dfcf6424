"""A LoRA adapter is part of its requests' keys (0.5.6 base).

LMCache 0.5.6 (as 0.5.3) keys a request by model, world size, token ids and
cache_salt: the KV that adapter A computed was restored into requests of adapter B
and of the base model (vLLM's own prefix cache keys the adapter's name). The
connector keys the adapter by its name, its path and a digest of its files, so every
adapter keeps its own cache, and one reloaded with other weights under its name
misses. vLLM's lora_int_id is not keyed: it numbers adapters in load order.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytestmark = pytest.mark.bases("0.5.6")

pytest.importorskip("vllm.lora.request")

from request_keys_056 import CHUNKS, KeyedEngine  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402


def write_adapter(path: Path, seed: int) -> str:
    """A PEFT adapter directory: its config and weights (random bytes)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    weights = random.Random(seed).randbytes(64 << 10)
    (path / "adapter_model.safetensors").write_bytes(weights)
    return str(path)


@pytest.fixture
def engine(monkeypatch) -> KeyedEngine:
    return KeyedEngine(monkeypatch)


@pytest.fixture
def adapters(tmp_path) -> tuple[LoRARequest, LoRARequest]:
    a = LoRARequest("A", 1, write_adapter(tmp_path / "lora-a", seed=1))
    b = LoRARequest("B", 2, write_adapter(tmp_path / "lora-b", seed=2))
    return a, b


@pytest.mark.fix
def test_another_adapter_misses_an_adapter_s_chunks(engine, adapters):
    a, b = adapters
    engine.store(engine.request("a", lora_request=a))
    assert engine.hit(engine.request("b", lora_request=b)) == 0, (
        "adapter B was served the KV that adapter A computed"
    )


@pytest.mark.fix
def test_the_base_model_misses_an_adapter_s_chunks(engine, adapters):
    a, _ = adapters
    engine.store(engine.request("a", lora_request=a))
    assert engine.hit(engine.request("base")) == 0


@pytest.mark.fix
def test_an_adapter_misses_the_base_model_s_chunks(engine, adapters):
    a, _ = adapters
    engine.store(engine.request("base"))
    assert engine.hit(engine.request("a", lora_request=a)) == 0


def test_an_adapter_hits_its_own_chunks(engine, adapters):
    a, _ = adapters
    engine.store(engine.request("a", lora_request=a))
    assert engine.hit(engine.request("a-again", lora_request=a)) == CHUNKS


def test_an_adapter_loaded_under_another_int_id_hits_its_chunks(engine, adapters):
    """A restarted engine numbers its adapters anew."""
    a, _ = adapters
    engine.store(engine.request("a", lora_request=a))
    renumbered = LoRARequest(a.lora_name, 7, a.lora_path)
    assert engine.hit(engine.request("a-restarted", lora_request=renumbered)) == CHUNKS


@pytest.mark.fix
def test_an_adapter_reloaded_with_other_weights_misses(engine, adapters, tmp_path):
    a, _ = adapters
    engine.store(engine.request("a", lora_request=a))
    write_adapter(tmp_path / "lora-a", seed=3)  # vLLM's load_inplace reload
    reloaded = LoRARequest(a.lora_name, a.lora_int_id, a.lora_path, load_inplace=True)
    assert engine.hit(engine.request("a-reloaded", lora_request=reloaded)) == 0
