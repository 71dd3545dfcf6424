"""The weights behind a model path, and k/v scales no key can name.

vLLM's KV cache spec says nothing of the weights an engine computes its KV with: new
weights under the same path (a new checkpoint copied over the old one) kept hitting
the old KV. The connector keys a digest of every byte of the weight files (their
names and contents, not their times or inodes: two nodes holding the same files share
the cache). Each test stores through a whole LMCache server on CPU over an fs L2 folder,
registered through the real worker-side connector, and restarts it.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_cache_interface")
pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_l2_adapter")

from restore_server import (  # noqa: E402
    BASE,
    BLOCKS,
    hit_after_restart,
    restore_compared,
    store,
)
from vllm_engine import Engine  # noqa: E402
from vllm_sched_fakes import (  # noqa: E402
    BLOCK,
    SchedDriver,
    make_connector,
    make_kv_cache_config,
)

WEIGHTS_BYTES = 6 << 20


def write_model(path: Path, seed: int) -> Path:
    """A model directory: its config and one weights file of random bytes."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "qwen3_next"}')
    (path / "model.safetensors").write_bytes(random.Random(seed).randbytes(WEIGHTS_BYTES))
    return path


@pytest.mark.fix
def test_new_weights_under_the_same_path_miss(real_servers, tmp_path):
    l2, weights = tmp_path / "l2", write_model(tmp_path / "model", seed=1)
    setup = BASE.but(engine=Engine(weights=str(weights)))
    store(real_servers, l2, setup)
    # a new checkpoint copied over the old one, its times kept (cp -p, rsync -a)
    before = (weights / "model.safetensors").stat()
    write_model(weights, seed=2)
    os.utime(weights / "model.safetensors", ns=(before.st_atime_ns, before.st_mtime_ns))
    assert hit_after_restart(real_servers, l2, setup) == 0, (
        "KV computed with the old weights hit in an engine with new weights"
    )


@pytest.mark.fix
def test_a_small_edit_in_place_of_a_large_shard_misses(real_servers, tmp_path):
    l2, weights = tmp_path / "l2", tmp_path / "model"
    write_model(weights, seed=1)
    shard = weights / "model.safetensors"
    shard.write_bytes(random.Random(1).randbytes(64 << 20))
    setup = BASE.but(engine=Engine(weights=str(weights)))
    store(real_servers, l2, setup)
    before = shard.stat()
    with shard.open("r+b") as f:  # 4 KiB between two of the samples a digest could take
        f.seek(32 << 10)
        f.write(random.Random(2).randbytes(4 << 10))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert hit_after_restart(real_servers, l2, setup) == 0, (
        "KV computed before a 4 KiB edit of the weights hit after it"
    )


@pytest.mark.feature
def test_the_same_weights_on_another_node_share_the_cache(real_servers, tmp_path):
    here = write_model(tmp_path / "node-a" / "model", seed=1)
    there = tmp_path / "node-b" / "model"
    shutil.copytree(here, there)  # other inodes and times, the same bytes
    os.utime(there / "model.safetensors", ns=(0, 0))
    l2 = tmp_path / "l2"
    src = store(real_servers, l2, BASE.but(engine=Engine(weights=str(here))))
    restored = restore_compared(real_servers, l2, BASE.but(engine=Engine(weights=str(there))), src)
    assert restored == BLOCKS


def _calculated_scales_driver(monkeypatch: pytest.MonkeyPatch) -> SchedDriver:
    """A hybrid engine with --kv-cache-dtype fp8_e4m3 --calculate-kv-scales."""
    import vllm_sched_fakes

    original = vllm_sched_fakes._fake_vllm_config

    def fp8_calculated(*args: Any, **kwargs: Any) -> Any:
        config = original(*args, **kwargs)
        config.cache_config.cache_dtype = "fp8_e4m3"
        config.cache_config.calculate_kv_scales = True
        return config

    monkeypatch.setattr(vllm_sched_fakes, "_fake_vllm_config", fp8_calculated)
    config = make_kv_cache_config(num_spec_blocks=0)
    return SchedDriver(config, make_connector(config, BLOCK, monkeypatch))


@pytest.mark.feature
def test_calculated_kv_scales_load_nothing(monkeypatch):
    """vLLM computes such scales from each engine's first batch, after registration:
    no key can name them, so no other engine may read the bytes."""
    driver = _calculated_scales_driver(monkeypatch)
    request = driver.add_request("r", list(range(1, 1 + 4 * BLOCK)))
    driver.connector.scheduler_adapter.hits["r"] = 2 * BLOCK
    assert driver.connector.get_num_new_matched_tokens(request, 0) == (0, False)


@pytest.mark.feature
def test_calculated_kv_scales_store_nothing(monkeypatch):
    driver = _calculated_scales_driver(monkeypatch)
    driver.add_request("r", list(range(1, 1 + 4 * BLOCK)))
    assert [op for _ in range(4) for op in driver.step({"r": BLOCK}).stores] == []
