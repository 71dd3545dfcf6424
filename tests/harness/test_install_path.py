"""The README's GPU path from a fresh checkout: `python -m hybridfa_build install -- --no-deps`
then `python -m pytest tests/gpu -q` from the checkout root must test the installed wheel, and
`python -m lmcache._hybridfa` from there must check the installed wheel. `install` says which
torch the wheel's compiled kernels need and whether they load with the environment's torch.

`install` writes no lmcache/ tree into the checkout (`wheel` does, for reading), and
tests/conftest.py puts the checkout root last on sys.path, so even a tree left by `wheel` does
not shadow the installed wheel. Here in a copy of the checkout and a fresh virtual environment
(whose further packages, pip and pytest among them, come from this interpreter's).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from hybridfa_build import factory

REPO = Path(__file__).resolve().parents[2]


def _checkout_copy(dest: Path) -> Path:
    """The working tree's files that git tracks or would track, without results/."""
    try:
        out = subprocess.run(
            [
                "git",
                "-C",
                str(REPO),
                "ls-files",
                "-z",
                "--cached",
                "--others",
                "--exclude-standard",
            ],
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    for name in filter(None, out.decode().split("\0")):
        src = REPO / name
        if name.startswith("results/") or not src.is_file():
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / name)
    return dest


def _venv(dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    py = dest / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # after the venv's own site-packages: what is installed there wins
    (Path(site) / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, str], str]:
    tmp = tmp_path_factory.mktemp("install-path")
    checkout = _checkout_copy(tmp / "checkout")
    py = _venv(tmp / "venv")
    pins = factory.load_pins()
    base = factory.fetch_base_wheel(pins, factory.running_tag())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYBRIDFA_ARM")}
    cmd = [str(py), "-m", "hybridfa_build", "install", "--base-wheel", str(base), "--", "--no-deps"]
    proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return checkout, py, env, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def installed(install: tuple[Path, Path, dict[str, str], str]) -> tuple[Path, Path, dict[str, str]]:
    return install[:3]


def _pytest_gpu(checkout: Path, py: Path, env: dict[str, str], *flags: str) -> str:
    """The README's `python -m pytest tests/gpu`: without -q its header names the lmcache."""
    cmd = [str(py), "-m", "pytest", "-p", "no:cacheprovider", "tests/gpu", *flags]
    proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _site(py: Path) -> Path:
    out = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return Path(out.strip()).resolve()


def test_install_names_the_torch_of_the_kernels_and_checks_the_install(install) -> None:
    _, py, _, out = install
    assert "the wheel's compiled copy kernels (lmcache.c_ops) need torch 2.11.x" in out
    assert f"module         {_site(py) / 'lmcache'}" in out  # the installed build's own check
    assert "RECORD         ok" in out and "kernels load   " in out


def test_install_writes_no_lmcache_tree_into_the_checkout(installed) -> None:
    checkout, _, _ = installed
    assert not (checkout / "lmcache").exists()


def test_python_m_pytest_from_the_checkout_root_tests_the_installed_wheel(installed) -> None:
    checkout, py, env = installed
    out = _pytest_gpu(checkout, py, env)
    venv = py.parent.parent
    header = next(line for line in out.splitlines() if line.startswith("hybridfa arm:"))
    assert f"lmcache: {venv}" in header and "(patched)" in header, header
    assert "materialized" not in out
    assert "GPU restart gate" in out  # collected, then skipped: this machine has no GPU


def test_pytest_tests_gpu_q_names_why_it_skipped_without_rs(installed) -> None:
    checkout, py, env = installed
    out = _pytest_gpu(checkout, py, env, "-q")
    assert "tests/gpu: 1 skipped: GPU restart gate: " in out, out


def test_the_check_from_the_checkout_root_reads_the_installed_wheel(installed) -> None:
    """A tree `python -m hybridfa_build wheel` materialized in the checkout root is not what
    `python -m lmcache._hybridfa` checks there."""
    checkout, py, env = installed
    site = _site(py)
    tree = checkout / "lmcache"
    tree.mkdir()
    (tree / "__init__.py").write_text("")
    (tree / "_hybridfa.py").write_bytes((site / "lmcache" / "_hybridfa.py").read_bytes())
    try:
        proc = subprocess.run(
            [str(py), "-m", "lmcache._hybridfa"],
            cwd=checkout,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        shutil.rmtree(tree)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"(checking the installed lmcache at {site / 'lmcache'}" in proc.stdout
    assert "RECORD         ok" in proc.stdout


def test_a_tree_that_wheel_materialized_does_not_shadow_the_installed_wheel(installed) -> None:
    checkout, py, env = installed
    tree = checkout / "lmcache"
    tree.mkdir()
    (tree / "__init__.py").write_text("raise ImportError('the materialized tree was imported')\n")
    try:
        out = _pytest_gpu(checkout, py, env)
    finally:
        shutil.rmtree(tree)
    assert f"lmcache: {py.parent.parent}" in out
