"""PEP 517 backend: ``pip install .`` builds the patched wheel for the running interpreter.

Offline: ``pip install . --config-settings base-wheel=/path/to/lmcache-0.5.3-...whl``
or ``LMCACHE_HYBRIDFA_BASE_WHEEL=/path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridfa_build import factory


def get_requires_for_build_wheel(config_settings: dict[str, Any] | None = None) -> list[str]:
    return []


def build_wheel(
    wheel_directory: str,
    config_settings: dict[str, Any] | None = None,
    metadata_directory: str | None = None,
) -> str:
    base = (config_settings or {}).get("base-wheel")
    wheel = factory.build_wheel(
        factory.running_tag(), Path(wheel_directory), Path(base) if base else None
    )
    return wheel.name
