"""The wheel factory's command line, as the factory tests run it (from the checkout root)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"


def factory(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m hybridfa_build ARGS`` in the checkout root."""
    return subprocess.run(
        [sys.executable, "-m", "hybridfa_build", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        check=False,
    )
