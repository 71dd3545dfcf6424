"""The product's code passes LMCache's own lint: every file the series adds or changes,
and every shared module of sources/, checked with ruff under the pristine sdist's
pyproject.toml (line length 88, its rules and per-file ignores), in a patched tree of
each base."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from factory_cli import TAG

from hybridfa_build import factory


def _ruff() -> list[str]:
    beside = Path(sys.executable).with_name("ruff")
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (tests/env/setup-venv.sh installs it)")
    return [found]


def _lmcache_pyproject(base: str, into: Path) -> None:
    """The pristine sdist's pyproject.toml (LMCache's ruff settings) into ``into``."""
    sdist = factory.fetch_sdist(factory.get_base(base).pins())
    with tarfile.open(sdist) as tf:
        (member,) = [m for m in tf.getmembers() if m.name.count("/") == 1 and
                     m.name.endswith("/pyproject.toml")]  # fmt: skip
        extracted = tf.extractfile(member)
        assert extracted is not None
        (into / "pyproject.toml").write_bytes(extracted.read())


@pytest.mark.parametrize("base", factory.base_names())
def test_the_series_and_the_shared_modules_pass_lmcache_s_lint(base: str, tmp_path: Path) -> None:
    base_def = factory.get_base(base)
    factory.build_wheel(TAG, tmp_path / "dist", materialize=tmp_path / "tree" / "lmcache",
                        base_name=base)  # fmt: skip
    _lmcache_pyproject(base, tmp_path / "tree")
    changed = set(factory.shared_sources())
    for patch in factory.read_series(base_def.patches_dir):
        changed |= factory.patched_paths(patch)
    files = sorted(p for p in changed if p.endswith(".py") and (tmp_path / "tree" / p).is_file())
    proc = subprocess.run(
        [*_ruff(), "check", "--no-cache", "--output-format", "concise", *files],
        cwd=tmp_path / "tree",
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, f"{base}: {proc.stdout}{proc.stderr}"
