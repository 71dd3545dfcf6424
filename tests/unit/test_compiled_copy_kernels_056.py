"""lmcache 0.5.6: a layout on a CUDA server without the compiled copy kernels is refused.

Where ``lmcache.cuda_ops`` does not load (built against another torch than the server's),
LMCache copies with a Python fallback; the 0.5.3 base's fallback restored a hybrid prompt's
blocks at other positions on a GPU, nothing in it tied to a hybrid layout, and this base's
copies the same way but has not run on one. The patched server refuses any such
registration with the cause named and the model's lookups miss. A real
server context (mp_server_056) whose cache context reports a CUDA device, as a GPU server's
does, on the in-memory mock adapter.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.bases("0.5.6")

from cuda_context import report_cuda_device  # noqa: E402
from log_recorder import Recorder  # noqa: E402
from mp_server_056 import Server  # noqa: E402

MOCK = '{"type":"mock","max_size_gb":0.25,"mock_bandwidth_gb":100}'


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    srv = Server(tmp_path, MOCK)
    try:
        yield srv
    finally:
        srv.close()


def _on_cuda(monkeypatch: pytest.MonkeyPatch, compiled: bool) -> Recorder:
    """Registrations get a cache context on a CUDA device; ``compiled``: with the compiled
    kernels bound (as where lmcache.cuda_ops loads). The transfer module's errors are kept."""
    from lmcache import device_ops
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as transfer

    report_cuda_device(monkeypatch, transfer)
    monkeypatch.setattr(transfer, "get_event_ipc_backend", lambda device: _NoEvents())
    if compiled:
        monkeypatch.setattr(device_ops, "execute_object_group_transfer", print, raising=False)
    recorder = Recorder()
    monkeypatch.setattr(transfer, "logger", recorder)
    return recorder


class _NoEvents:
    """The event backend of a CUDA device, which a CPU box cannot create."""

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


@pytest.mark.fix
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "dense"])
def test_a_server_without_the_compiled_kernels_serves_no_hit(tmp_path, monkeypatch, hybrid):
    """Objects of the registered layout in the fs tier, as a server that copies with the
    kernels stores them, are a miss on a CUDA server without them: a hit there is restored
    through the fallback."""
    fs = Server(tmp_path, f'{{"type":"fs","base_path":"{tmp_path / "l2"}"}}')
    fs.base = tmp_path / "l2"
    try:
        _on_cuda(monkeypatch, compiled=False)
        fs.register(hybrid=hybrid)
        assert fs.seed_l2(fill=7) > 0
        assert fs.hit_chunks("again") == 0, (
            "a CUDA server without its compiled copy kernels hit objects of its layout"
        )
    finally:
        fs.close()


@pytest.mark.feature
def test_a_hybrid_layout_is_refused_without_the_compiled_kernels(server, monkeypatch):
    recorder = _on_cuda(monkeypatch, compiled=False)
    server.register(hybrid=True)
    refusals = [e for e in recorder.errors if "lmcache.cuda_ops" in e]
    assert len(refusals) == 1, recorder.errors
    assert f"torch {torch.__version__}" in refusals[0]
    assert "python -m hybridfa_build install --base 0.5.6 --kernels" in refusals[0]


def test_a_hybrid_layout_is_served_with_the_compiled_kernels(server, monkeypatch):
    recorder = _on_cuda(monkeypatch, compiled=True)
    server.register(hybrid=True)
    assert not [e for e in recorder.errors if "cuda_ops" in e]


@pytest.mark.feature
def test_a_dense_layout_is_refused_without_the_compiled_kernels(server, monkeypatch):
    recorder = _on_cuda(monkeypatch, compiled=False)
    server.register(hybrid=False)
    refusals = [e for e in recorder.errors if "lmcache.cuda_ops" in e]
    assert len(refusals) == 1, recorder.errors
    from mp_server_056 import MODEL

    from lmcache.v1.distributed.layout_namespace import namespaced_model_name

    assert "refused-" in namespaced_model_name(MODEL, 1)
