"""The control arm's lmcache tree (hybridfa_gate.control): pristine plus two named patches."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hybridfa_gate import control

REPO = Path(__file__).resolve().parents[2]


def test_the_control_patches_are_in_the_series() -> None:
    found = control.control_patches()
    assert len(found) == len(control.CONTROL_PATCHES)
    assert all(p.is_file() for p in found)


def test_a_series_without_them_is_refused(tmp_path: Path) -> None:
    (tmp_path / "series").write_text("0001-other.patch\n")
    with pytest.raises(SystemExit, match="update CONTROL_PATCHES"):
        control.control_patches(tmp_path)


def test_the_control_tree_is_pristine_plus_the_two_patches(tmp_path: Path) -> None:
    if shutil.which("patch") is None:
        pytest.skip("GNU patch is not installed")
    pristine = REPO / "build" / "lmc-pristine"
    if not (pristine / "lmcache").is_dir():
        pytest.skip("no pristine lmcache 0.5.3 in build/lmc-pristine (tests/run installs one)")
    applied = control.build_control(pristine, tmp_path / "control")
    assert applied == [p.name for p in control.control_patches()]
    assert not (tmp_path / "control" / "lmcache" / "_hybridfa.py").exists()  # not the patched arm
    edits = tmp_path / "control" / "lmcache" / "integration" / "vllm" / "kv_cache_group_edits.py"
    assert edits.read_text() != (pristine / edits.relative_to(tmp_path / "control")).read_text()


def test_a_patched_tree_is_not_a_pristine_one(tmp_path: Path) -> None:
    (tmp_path / "lmcache").mkdir()
    (tmp_path / "lmcache" / "_hybridfa.py").write_text("")
    with pytest.raises(SystemExit, match="not pristine"):
        control.build_control(tmp_path, tmp_path / "out")
