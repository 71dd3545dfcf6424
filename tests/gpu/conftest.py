"""Skip everything under tests/gpu unless a CUDA GPU, vLLM and FlashInfer are usable.

CI's CPU machine then shows one clear reason per test instead of import errors. The
probe imports torch/vllm/flashinfer lazily, once, at collection time.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@functools.cache
def gpu_skip_reason() -> str | None:
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means "cannot run here"
        return f"GPU restart gate: torch not importable ({type(e).__name__}: {e})"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return "GPU restart gate: no CUDA GPU on this machine"
    for mod in ("vllm", "flashinfer"):
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001
            return f"GPU restart gate: {mod} not importable ({type(e).__name__}: {e})"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Collection hooks of a sub-folder conftest see the whole session: touch only ours.
    mine = [it for it in items if HERE in Path(str(it.path)).resolve().parents]
    if not mine:
        return
    reason = gpu_skip_reason()
    for it in mine:
        it.add_marker(pytest.mark.gpu)
        if reason:
            it.add_marker(pytest.mark.skip(reason=reason))
