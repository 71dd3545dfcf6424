# SPDX-License-Identifier: Apache-2.0
"""The vLLM versions this build serves.

The connector relies on vLLM internals that change between releases, so each LMCache
base of this series serves the vLLM releases it was tested against:

- lmcache 0.5.3 (vLLM 0.26-0.28): the KV layout hint
  (``vllm.v1.attention.backends.utils.get_kv_cache_layout``, removed in 0.29),
  ``MambaSpec.mamba_cache_mode``, ``KVCacheConfig.has_mamba_layers`` and
  ``CachedRequestData.resumed_req_ids``;
- lmcache 0.5.6 (vLLM 0.29-0.34): the resolved KV layout
  (``CacheConfig.get_resolved_kv_cache_layout``, from 0.29), the strided
  ``KVCacheTensor`` placement (``layers``, ``layer_stride``, from 0.29),
  ``MambaSpec.mamba_cache_mode`` and the scheduler output's request lists (0.34 re-sends
  a resumed request as a new one and drops ``CachedRequestData.resumed_req_ids``).

Outside its range the connector refuses at engine start with one error that names the
build serving the engine's vLLM, rather than misreading a layout deep inside a transfer.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from typing import Any, NamedTuple

from lmcache._version import version_tuple


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in version)


class Served(NamedTuple):
    first: tuple[int, int, int]
    end: tuple[int, int, int]
    install: str  # the factory command that builds this base
    interfaces: dict[tuple[str, str], tuple[str, ...]]  # (module, class) -> attributes

    @property
    def text(self) -> str:
        return f"vLLM >= {_dotted(self.first)}, < {_dotted(self.end[:2])}"


BASES = {
    (0, 5, 3): Served(
        (0, 26, 0),
        (0, 29, 0),
        "python -m hybridfa_build install",
        {
            ("vllm.v1.attention.backends.utils", ""): ("get_kv_cache_layout",),
            ("vllm.v1.kv_cache_interface", "MambaSpec"): ("mamba_cache_mode",),
            ("vllm.v1.kv_cache_interface", "KVCacheConfig"): ("has_mamba_layers",),
            ("vllm.v1.core.sched.output", "CachedRequestData"): ("resumed_req_ids",),
        },
    ),
    (0, 5, 6): Served(
        (0, 29, 0),
        (0, 35, 0),
        "python -m hybridfa_build install --base 0.5.6",
        {
            ("vllm.config.cache", "CacheConfig"): ("get_resolved_kv_cache_layout",),
            ("vllm.v1.kv_cache_interface", "KVCacheTensor"): ("layers", "layer_stride"),
            ("vllm.v1.kv_cache_interface", "MambaSpec"): ("mamba_cache_mode",),
            ("vllm.v1.core.sched.output", "CachedRequestData"): (
                "req_ids",
                "new_block_ids",
            ),
        },
    ),
}
"""Each LMCache base of this series and the vLLM releases [first, end) it serves."""

SERVED = BASES[tuple(version_tuple[:3])]
"""What the installed build serves."""
SUPPORTED_VLLM = (SERVED.first, SERVED.end)
RANGE_TEXT = SERVED.text

EXTENSIBLE_KV_CACHE_OFF = "--no-enable-extensible-kv-cache"


def _parse(version: str) -> tuple[int, int, int] | None:
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def _has(owner: Any, name: str) -> bool:
    if dataclasses.is_dataclass(owner):
        return name in {f.name for f in dataclasses.fields(owner)} or hasattr(
            owner, name
        )
    return hasattr(owner, name)


def _missing_interfaces() -> list[str]:
    missing = []
    for (module, cls), names in SERVED.interfaces.items():
        where = f"{module}.{cls}" if cls else module
        try:
            owner = importlib.import_module(module)
            owner = getattr(owner, cls) if cls else owner
        except (ImportError, AttributeError):
            missing.append(where)
            continue
        missing += [f"{where}.{n}" for n in names if not _has(owner, n)]
    return missing


def _serving_build(parsed: tuple[int, int, int] | None) -> str:
    if parsed is not None:
        for base, served in BASES.items():
            if served.first <= parsed < served.end:
                return (
                    f"vLLM {_dotted(parsed[:2])} is served by the lmcache "
                    f"{_dotted(base)} "
                    f"based build of lmcache-hybridfa: {served.install}."
                )
    ranges = "; ".join(f"{s.text} ({s.install})" for s in BASES.values())
    return f"No build of lmcache-hybridfa serves it: they serve {ranges}."


def check_vllm_compatibility(version: str | None = None) -> None:
    """Raise RuntimeError unless the installed vLLM is one this build serves."""
    if version is None:
        import vllm

        version = str(getattr(vllm, "__version__", ""))
    parsed = _parse(version)
    if parsed is None or not (SERVED.first <= parsed < SERVED.end):
        raise RuntimeError(
            f"lmcache-hybridfa (lmcache {_dotted(version_tuple[:3])} base) serves "
            f"{RANGE_TEXT}; this engine runs vLLM {version!r}. The LMCache connector "
            "reads KV layout and scheduler interfaces that differ between vLLM "
            "releases, so LMCache is refused here rather than restoring KV it cannot "
            f"check. {_serving_build(parsed)}"
        )
    missing = _missing_interfaces()
    if missing:
        raise RuntimeError(
            f"lmcache-hybridfa serves {RANGE_TEXT}; this vLLM {version} lacks "
            f"{', '.join(missing)}, which the LMCache connector relies on."
        )


def check_extensible_kv_cache(vllm_config: Any) -> None:
    """Refuse vLLM's extensible (driver-mapped) KV cache.

    The connector shares the KV cache with the LMCache server through legacy CUDA
    IPC handles, which cannot export driver-mapped memory. The connector declares
    this (``kv_cache_access``), so vLLM turns the extensible cache off by itself;
    this is the backstop for a config that turned it on regardless.
    """
    cache_config = getattr(vllm_config, "cache_config", None)
    if getattr(cache_config, "enable_extensible_kv_cache", None) is True:
        raise RuntimeError(
            "lmcache-hybridfa: the LMCache connector shares the KV cache with the "
            "LMCache server through CUDA IPC handles, which vLLM's extensible KV cache "
            "(driver-mapped memory) cannot export. Start vLLM with "
            f"{EXTENSIBLE_KV_CACHE_OFF}."
        )
