"""A LoRA adapter is keyed by the files vLLM loads for it, however its path is written.

vLLM resolves ``lora_path`` itself (``vllm.lora.utils.get_adapter_absolute_path``): ``~``
expanded, a relative path that exists, or a Hugging Face repository id, whose snapshot
it downloads. The keys digested the adapter's files only where ``lora_path`` was a local
directory as written: new files under ``~/adapters/a`` or a new revision of
``org/adapter`` kept the old key, and the old KV was restored under the new adapter.
Where the files cannot be read, no key can tell the adapter from another: its requests
are neither looked up nor stored.

The real scheduler-side connector and a whole server on CPU (request_keys, or
request_keys_056 on the 0.5.6 base); a Hugging Face cache in tmp_path, offline.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.bases("0.5.3", "0.5.6")

pytest.importorskip("vllm.lora.request")
pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_l2_adapter")

from vllm.lora.request import LoRARequest  # noqa: E402

REPO = "org/adapter"
CHUNKS = 4  # a prompt's chunks in request_keys and request_keys_056


def write_adapter(path: Path, seed: int) -> Path:
    """A PEFT adapter directory: its config and weights (random bytes)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (path / "adapter_model.safetensors").write_bytes(random.Random(seed).randbytes(64 << 10))
    return path


@pytest.fixture
def engine(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from lmcache._version import version_tuple

    if tuple(version_tuple[:3]) >= (0, 5, 6):
        from request_keys_056 import KeyedEngine

        return KeyedEngine(monkeypatch)
    from request_keys import KeyedEngine

    return KeyedEngine(request.getfixturevalue("real_servers"), tmp_path / "l2", monkeypatch)


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An offline Hugging Face cache; ``publish(seed)`` makes a new revision of REPO
    the one vLLM resolves, as a download of it would."""
    import huggingface_hub.constants as hf

    cache = tmp_path / "hf"
    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", True)
    repo = cache / f"models--{REPO.replace('/', '--')}"

    def publish(seed: int) -> None:
        revision = f"{seed:040x}"
        write_adapter(repo / "snapshots" / revision, seed)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(revision)

    return publish


def restarted() -> None:
    """A new engine process resolves hub adapters anew."""
    try:
        from lmcache.integration.vllm import identity
    except ImportError:  # pristine: it keys no adapter at all
        return
    identity._hub_snapshot.cache_clear()  # noqa: SLF001


@pytest.mark.fix
def test_new_files_under_a_home_relative_path_miss(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    write_adapter(tmp_path / "home" / "adapters" / "a", seed=1)
    lora = LoRARequest("A", 1, "~/adapters/a")
    engine.store(engine.request("a", lora_request=lora))
    assert engine.hit(engine.request("a-again", lora_request=lora)) == CHUNKS
    write_adapter(tmp_path / "home" / "adapters" / "a", seed=2)
    assert engine.hit(engine.request("a-new", lora_request=lora)) == 0, (
        "new files under ~/adapters/a were served the old adapter's KV"
    )


@pytest.mark.fix
def test_a_new_revision_of_a_hub_adapter_misses(engine, hub):
    hub(seed=1)
    restarted()
    lora = LoRARequest("A", 1, REPO)
    engine.store(engine.request("a", lora_request=lora))
    assert engine.hit(engine.request("a-again", lora_request=lora)) == CHUNKS
    hub(seed=2)
    restarted()
    assert engine.hit(engine.request("a-new", lora_request=lora)) == 0, (
        "a new revision of the hub adapter was served the old revision's KV"
    )


@pytest.mark.fix
def test_an_adapter_whose_files_cannot_be_read_is_neither_looked_up_nor_stored(engine):
    lora = LoRARequest("A", 1, "/nonexistent/adapter")
    result = engine.driver.step({engine.request("a", lora_request=lora).request_id: -1})
    stores = [m for m in result.metadata.requests if m.direction == "STORE"]
    assert stores == [], "a request of an unreadable adapter was stored"
    assert engine.hit(engine.request("a-again", lora_request=lora)) == 0
