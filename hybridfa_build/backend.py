"""PEP 517 backend: ``pip install .`` builds the patched wheel for the running interpreter.

Offline: ``pip install . --config-settings base-wheel=/path/to/lmcache-0.5.3-...whl``
or ``LMCACHE_HYBRIDFA_BASE_WHEEL=/path``. The lmcache 0.5.6 base:
``pip install . --config-settings base=0.5.6``.
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
    settings = config_settings or {}
    base = settings.get("base-wheel")
    wheel = factory.build_wheel(
        factory.running_tag(),
        Path(wheel_directory),
        Path(base) if base else None,
        base_name=settings.get("base", factory.DEFAULT_BASE),
    )
    return wheel.name
