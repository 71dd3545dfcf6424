"""The wheel factory's second base: ``--base 0.5.6`` builds lmcache-0.5.6+hybridfa.N from
the pinned 0.5.6 wheels and bases/0.5.6/'s series; the 0.5.3 base stays the default."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
from factory_cli import ROOT, TAG, factory

from hybridfa_build import factory as wheel_factory

BASE = ROOT / "bases" / "0.5.6"
PINS = json.loads((BASE / "pins.json").read_text())
CACHE = Path(os.environ.get("LMCACHE_HYBRIDFA_CACHE", Path.home() / ".cache" / "lmcache-hybridfa"))
REVISION = int((BASE / "REVISION").read_text())


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist056")
    proc = factory("wheel", "--base", "0.5.6", "--no-materialize", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def pristine_wheel(built: Path) -> Path:
    return CACHE / PINS["wheels"][TAG]["filename"]


def _files(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as zf:
        return {i.filename: zf.read(i) for i in zf.infolist() if not i.is_dir()}


def _patched_paths() -> set[str]:
    paths = set()
    for name in (BASE / "patches" / "series").read_text().split():
        text = (BASE / "patches" / name).read_text()
        paths |= set(re.findall(r"^diff --git a/(\S+) b/", text, re.M))
    return paths


def test_every_pinned_tag_is_a_0_5_6_wheel() -> None:
    assert PINS["version"] == "0.5.6"
    assert sorted(PINS["wheels"]) == ["cp310", "cp311", "cp312", "cp313"]
    for tag, pin in PINS["wheels"].items():
        assert pin["filename"].startswith(f"lmcache-0.5.6-{tag}-{tag}-")
        assert re.fullmatch(r"[0-9a-f]{64}", pin["sha256"])


def test_name_and_version_are_the_0_5_6_base_and_its_own_revision(built: Path) -> None:
    assert built.name.startswith(f"lmcache-0.5.6+hybridfa.{REVISION}-")
    assert built.name.endswith(PINS["wheels"][TAG]["filename"].split("-", 2)[2])
    files = _files(built)
    meta = files[f"lmcache-0.5.6+hybridfa.{REVISION}.dist-info/METADATA"].decode()
    assert f"\nVersion: 0.5.6+hybridfa.{REVISION}\n" in meta


def test_wheel_differs_from_pristine_0_5_6_only_in_its_series_and_marker(
    built: Path, pristine_wheel: Path
) -> None:
    ours, base = _files(built), _files(pristine_wheel)
    patched = _patched_paths()
    for name, data in base.items():
        if name.startswith("lmcache-0.5.6.dist-info/"):
            continue
        if name in patched:
            assert ours[name] != data, f"{name} is in the series but unchanged"
        else:
            assert ours[name] == data, f"{name} differs from pristine but no patch touches it"
    info = f"lmcache-0.5.6+hybridfa.{REVISION}.dist-info/"
    extra = {n for n in set(ours) - set(base) if not n.startswith(info)}
    shared = set(wheel_factory.shared_sources())
    assert extra == {"lmcache/_hybridfa.py"} | (patched - set(base)) | shared


def test_marker_reports_the_0_5_6_base_and_its_series(built: Path) -> None:
    marker = _files(built)["lmcache/_hybridfa.py"].decode()
    assert 'BASE_VERSION = "0.5.6"' in marker
    assert f'REVISION = "{REVISION}"' in marker
    assert f'VERSION = "0.5.6+hybridfa.{REVISION}"' in marker
    series = ",".join((BASE / "patches" / "series").read_text().split())
    assert f'tuple("{series}".split(",")) if "{series}"' in marker


def test_two_0_5_6_builds_are_byte_identical(built: Path, tmp_path: Path) -> None:
    proc = factory("wheel", "--base", "0.5.6", "--no-materialize", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / built.name).read_bytes() == built.read_bytes()


def test_a_base_wheel_other_than_the_pinned_0_5_6_is_refused(tmp_path: Path) -> None:
    wrong = tmp_path / PINS["wheels"][TAG]["filename"]
    wrong.write_bytes(b"not the pinned 0.5.6 wheel")
    out = tmp_path / "out"
    args = ("--no-materialize", "--base-wheel", str(wrong), "--out", str(out))
    proc = factory("wheel", "--base", "0.5.6", *args)
    assert proc.returncode == 2
    assert "sha256 mismatch" in proc.stderr and PINS["wheels"][TAG]["sha256"] in proc.stderr
    assert not out.exists() or not any(out.iterdir())


def test_an_unknown_base_is_refused_naming_the_known_ones(tmp_path: Path) -> None:
    proc = factory("wheel", "--base", "0.5.4", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert "0.5.3" in proc.stderr and "0.5.6" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_the_default_base_is_still_0_5_3(tmp_path: Path) -> None:
    proc = factory("wheel", "--no-materialize", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("*.whl")
    assert wheel.name.startswith("lmcache-0.5.3+hybridfa.")


@pytest.mark.skipif(shutil.which("git") is None, reason="the patch queue needs git")
def test_patch_queue_of_0_5_6_round_trips_and_is_not_exported_into_another_base(
    tmp_path: Path,
) -> None:
    queue = tmp_path / "pq"
    proc = factory("pq", "--base", "0.5.6", str(queue))
    assert proc.returncode == 0, proc.stderr
    subject = subprocess.run(
        ["git", "log", "-1", "--format=%s", "pristine"], cwd=queue, capture_output=True, text=True
    ).stdout
    assert subject.startswith("pristine lmcache-0.5.6-")
    count = subprocess.run(
        ["git", "rev-list", "--count", "sources..HEAD"], cwd=queue, capture_output=True, text=True
    ).stdout
    assert int(count) == len((BASE / "patches" / "series").read_text().split())
    refused = factory("export", str(queue))  # the default base is 0.5.3
    assert refused.returncode == 2
    assert "--base 0.5.6" in refused.stderr
    assert (ROOT / "patches" / "series").read_text().split()  # 0.5.3's series untouched
