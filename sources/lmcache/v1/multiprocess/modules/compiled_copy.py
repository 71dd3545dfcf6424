# SPDX-License-Identifier: Apache-2.0
"""Layouts are refused on a CUDA server without LMCache's compiled copy kernels.

LMCache copies KV between an engine's GPU pages and its objects with compiled CUDA
kernels (``lmcache.c_ops`` up to LMCache 0.5.5, ``lmcache.cuda_ops`` from 0.5.6). Where
the extension does not load (it is built against one torch, and the vLLM releases a
base serves pin more than one), LMCache logs one warning and copies with a Python
fallback of its own. Through 0.5.3's fallback a hybrid layout's restore on a GPU (vLLM
0.27.1, torch 2.13.0) put stored blocks at other positions of the prompt: a full hit
with wrong KV. The fallback's staging copy is a synchronous ``cudaMemcpy`` on the legacy
stream while its block copies are queued on the server's transfer stream, so a staging
buffer can be rewritten before a queued copy reads it; nothing of that is
hybrid-specific, and 0.5.6's fallback copies the same way. A layout registered with a
CUDA server whose compiled kernels are not loaded is therefore refused like an
undeclared client: the server logs one error naming the cause, stores nothing for the
model and keys its lookups where nothing is stored. The engine keeps serving without the
cache. CPU servers keep pristine behaviour.
"""

# Future
from __future__ import annotations

# Third Party
import torch

# First Party
from lmcache._version import version_tuple
from lmcache.v1.platform import resolve_device_ops, torch_device_type

EXTENSION = (
    "lmcache.c_ops" if tuple(version_tuple[:3]) < (0, 5, 6) else "lmcache.cuda_ops"
)
"""The compiled extension's module name in the installed LMCache release."""


def compiled_copy_missing(device: torch.device | str) -> str | None:
    """Why a layout on ``device`` would be copied by the Python fallback, or
    ``None`` where the compiled kernels serve it (or the device is not CUDA)."""
    # LMCache's own tests register contexts whose device is a mock: not a CUDA device.
    if not isinstance(device, (torch.device, str)):
        return None
    if torch.device(device).type != "cuda":
        return None
    # bound from the native module onto the device ops only where the extension loaded
    if hasattr(resolve_device_ops(torch_device_type), "execute_object_group_transfer"):
        return None
    return (
        f"LMCache's compiled CUDA copy kernels ({EXTENSION}) did not load with "
        f"torch {torch.__version__}"
    )
