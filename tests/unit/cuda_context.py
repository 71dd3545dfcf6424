"""A CPU box's registrations with a cache context that reports a CUDA device, as a GPU server's
does: what a server decides from the device at registration, without a GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def report_cuda_device(monkeypatch: pytest.MonkeyPatch, transfer: Any) -> None:
    """Every cache context ``transfer`` (the lmcache_driven_transfer module) creates from now on
    reports cuda:0 as its device; its tensors stay where they are."""
    real = transfer.create_cache_context

    def on_cuda(*args: Any, **kwargs: Any) -> Any:
        ctx = real(*args, **kwargs)
        cuda = property(lambda self: torch.device("cuda", 0))
        ctx.__class__ = type("OnCuda", (type(ctx),), {"device": cuda})
        return ctx

    monkeypatch.setattr(transfer, "create_cache_context", on_cuda)
