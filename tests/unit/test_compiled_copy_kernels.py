"""A layout on a CUDA server without LMCache's compiled copy kernels is refused.

The 0.5.3 wheel's compiled kernels (``lmcache.c_ops``) are built against vLLM 0.26's torch;
under vLLM 0.27 and 0.28 (torch 2.13) they do not load, and LMCache copies with a Python
fallback. Through it, a hybrid restore on a GPU put stored blocks at other positions of
the prompt: a 99 % hit with wrong KV; nothing in the fallback is hybrid-specific. The patched
server refuses any such registration with the cause named (it then stores nothing for the
model and keys its lookups where nothing is stored, as for its other refusals). A whole
CPU server (restore_server) whose cache context reports a CUDA device, as a GPU server's does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm.v1.kv_cache_interface")

from cuda_context import report_cuda_device  # noqa: E402
from hybrid_kv import build_fa_only_kv, build_hybrid_kv  # noqa: E402
from log_recorder import Recorder  # noqa: E402

N, PAGE, CHUNKS, NUM_BLOCKS = 80, 16, 3, 32


def _on_cuda(monkeypatch: pytest.MonkeyPatch, compiled: bool) -> Recorder:
    """Registrations get a cache context on a CUDA device; ``compiled``: with the compiled
    kernels bound (as where lmcache.c_ops loads). The transfer module's errors are kept."""
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as transfer
    from lmcache.v1.platform import resolve_device_ops, torch_device_type

    report_cuda_device(monkeypatch, transfer)
    if compiled:
        ops = resolve_device_ops(torch_device_type)
        monkeypatch.setattr(ops, "execute_object_group_transfer", print, raising=False)
    recorder = Recorder()
    monkeypatch.setattr(transfer, "logger", recorder)
    return recorder


def _hybrid_server(real_servers: Any, tmp_path: Path) -> Any:
    kv = build_hybrid_kv(N, PAGE, "NHD", NUM_BLOCKS)
    return real_servers(kv, N, tmp_path / "l2", False)


def _kv(hybrid: bool) -> Any:
    return (
        build_hybrid_kv(N, PAGE, "NHD", NUM_BLOCKS)
        if hybrid
        else build_fa_only_kv(16, "NHD", num_blocks=NUM_BLOCKS)
    )


@pytest.mark.fix
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "dense"])
def test_a_server_without_the_compiled_kernels_serves_no_hit(
    real_servers, tmp_path, monkeypatch, hybrid
):
    """What a server that copies with the kernels stored is a miss on a CUDA server
    without them: a hit there is restored through the fallback."""
    tokens_per_block = N if hybrid else 16
    tokens = list(range(1000, 1000 + CHUNKS * tokens_per_block + 1))
    ids = [[1 + g * CHUNKS + i for i in range(CHUNKS)] for g in range(4 if hybrid else 1)]
    stored = real_servers(_kv(hybrid), tokens_per_block, tmp_path / "l2", False)
    assert stored.store("store", tokens, ids)
    stored.wait_l2_objects(CHUNKS)
    stored.close()
    _on_cuda(monkeypatch, compiled=False)
    server = real_servers(_kv(hybrid), tokens_per_block, tmp_path / "l2", False)
    assert server.lookup("again", tokens[:-1]) == 0, (
        "a CUDA server without its compiled copy kernels hit what another server stored"
    )


@pytest.mark.feature
def test_a_hybrid_layout_is_refused_without_the_compiled_kernels(
    real_servers, tmp_path, monkeypatch
):
    recorder = _on_cuda(monkeypatch, compiled=False)
    _hybrid_server(real_servers, tmp_path)
    refusals = [e for e in recorder.errors if "lmcache.c_ops" in e]
    assert len(refusals) == 1, recorder.errors
    assert f"torch {torch.__version__}" in refusals[0]
    assert "python -m hybridfa_build install --kernels" in refusals[0]


def test_a_hybrid_layout_is_served_with_the_compiled_kernels(real_servers, tmp_path, monkeypatch):
    recorder = _on_cuda(monkeypatch, compiled=True)
    _hybrid_server(real_servers, tmp_path)
    assert not [e for e in recorder.errors if "lmcache.c_ops" in e]


@pytest.mark.feature
def test_a_dense_layout_is_refused_without_the_compiled_kernels(
    real_servers, tmp_path, monkeypatch
):
    recorder = _on_cuda(monkeypatch, compiled=False)
    kv = build_fa_only_kv(16, "NHD", num_blocks=NUM_BLOCKS)
    real_servers(kv, 16, tmp_path / "l2", False)
    refusals = [e for e in recorder.errors if "lmcache.c_ops" in e]
    assert len(refusals) == 1, recorder.errors
    from restore_server import MODEL

    from lmcache.v1.distributed.layout_namespace import namespaced_model_name

    assert "refused-" in namespaced_model_name(MODEL, 1)


def test_a_cpu_server_keeps_its_hits(real_servers, tmp_path):
    server = _hybrid_server(real_servers, tmp_path)
    tokens = list(range(1000, 1000 + CHUNKS * N + 1))
    ids = [[1 + g * CHUNKS + i for i in range(CHUNKS)] for g in range(4)]
    assert server.store("store", tokens, ids)
    assert server.lookup("again", tokens[:-1]) == CHUNKS
