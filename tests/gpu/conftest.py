"""Skip everything under tests/gpu unless a CUDA GPU, vLLM and FlashInfer are usable.

CI's CPU machine then shows one clear reason instead of import errors, at the end of the
run whatever the verbosity (no -rs needed). The probe imports torch/vllm/flashinfer lazily,
once, at collection time.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
SKIPPED = pytest.StashKey[tuple[int, str]]()  # (tests skipped here, why)


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
    if reason:
        config.stash[SKIPPED] = (len(mine), reason)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    skipped = config.stash.get(SKIPPED, None)
    if skipped is not None:
        count, reason = skipped
        terminalreporter.write_line(f"tests/gpu: {count} skipped: {reason}", yellow=True)
