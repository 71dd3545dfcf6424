"""The wheel factory: file-by-file against pristine, reproducible, and clear refusals."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from factory_cli import ROOT, TAG, factory

from hybridfa_build import factory as wheel_factory

PINS = json.loads((ROOT / "pins.json").read_text())


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, pristine_wheel: Path) -> Path:
    out = tmp_path_factory.mktemp("dist")
    proc = factory("wheel", "--no-materialize", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    (wheel,) = out.glob("*.whl")
    return wheel


def _files(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as zf:
        return {i.filename: zf.read(i) for i in zf.infolist() if not i.is_dir()}


def _patched_paths() -> set[str]:
    series = (ROOT / "patches" / "series").read_text().split()
    paths = set()
    for name in series:
        text = (ROOT / "patches" / name).read_text()
        paths |= set(re.findall(r"^diff --git a/(\S+) b/", text, re.M))
    return paths


def test_wheel_name_and_version_are_a_local_version_of_the_base(built: Path) -> None:
    version = f"{PINS['version']}+hybridfa."
    assert built.name.startswith(f"lmcache-{version}")
    assert built.name.endswith(PINS["wheels"][TAG]["filename"].split("-", 2)[2])


def test_wheel_differs_from_pristine_only_in_patched_files_dist_info_and_marker(
    built: Path, pristine_wheel: Path
) -> None:
    ours, base = _files(built), _files(pristine_wheel)
    patched = _patched_paths()
    assert patched, "the series patches no file"
    base_info = f"lmcache-{PINS['version']}.dist-info/"
    (our_info,) = {n.split("/")[0] + "/" for n in ours if ".dist-info/" in n}
    for name, data in base.items():
        if name.startswith(base_info):
            continue
        assert name in ours, f"{name} missing from the patched wheel"
        if name in patched:
            assert ours[name] != data, f"{name} is in the series but unchanged"
        else:
            assert ours[name] == data, f"{name} differs from pristine but no patch touches it"
    extra = set(ours) - set(base) - {n for n in ours if n.startswith(our_info)}
    shared = set(wheel_factory.shared_sources())
    assert extra == {"lmcache/_hybridfa.py"} | (patched - set(base)) | shared
    for name in ("WHEEL", "entry_points.txt", "top_level.txt", "licenses/LICENSE"):
        assert ours[our_info + name] == base[base_info + name]
    meta, base_meta = ours[our_info + "METADATA"].decode(), base[base_info + "METADATA"].decode()
    assert re.search(r"^Version: 0\.5\.3\+hybridfa\.\d+$", meta, re.M)
    assert meta.replace(re.search(r"^Version: .*$", meta, re.M).group(0), "Version: 0.5.3") == (
        base_meta
    )


def test_record_lists_every_file_with_its_hash_and_size(built: Path) -> None:
    files = _files(built)
    (record_name,) = [n for n in files if n.endswith(".dist-info/RECORD")]
    rows = [r.split(",") for r in files[record_name].decode().splitlines()]
    assert {r[0] for r in rows} == set(files)
    for name, digest, size in rows:
        if name == record_name:
            assert digest == size == ""
            continue
        data = files[name]
        expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
        assert digest == f"sha256={expected.decode()}" and int(size) == len(data)


def test_two_builds_are_byte_identical(built: Path, tmp_path: Path) -> None:
    proc = factory("wheel", "--no-materialize", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / built.name).read_bytes() == built.read_bytes()


def test_base_with_wrong_hash_is_refused_and_nothing_is_written(
    pristine_wheel: Path, tmp_path: Path
) -> None:
    tampered = tmp_path / pristine_wheel.name
    shutil.copyfile(pristine_wheel, tampered)
    with tampered.open("ab") as f:
        f.write(b"\0")
    out = tmp_path / "out"
    proc = factory("wheel", "--no-materialize", "--base-wheel", str(tampered), "--out", str(out))
    assert proc.returncode == 2
    assert "sha256 mismatch" in proc.stderr and PINS["wheels"][TAG]["sha256"] in proc.stderr
    assert not out.exists() or not any(out.iterdir())


def test_patch_that_does_not_apply_names_it_and_writes_nothing(tmp_path: Path) -> None:
    patches = tmp_path / "patches"
    shutil.copytree(ROOT / "patches", patches)
    bad = patches / "9999-bad.patch"
    bad.write_text(
        "--- a/lmcache/_version.py\n+++ b/lmcache/_version.py\n@@ -1,2 +1,2 @@\n"
        "-this line is not in lmcache\n+nor is this one\n context\n"
    )
    with (patches / "series").open("a") as f:
        f.write("9999-bad.patch\n")
    out, tree = tmp_path / "out", ROOT / "lmcache"
    before = sorted(p.name for p in tree.iterdir()) if tree.exists() else None
    proc = factory("wheel", "--patches", str(patches), "--out", str(out))
    assert proc.returncode == 2
    assert "9999-bad.patch does not apply" in proc.stderr
    assert not out.exists() or not any(out.iterdir())
    assert (sorted(p.name for p in tree.iterdir()) if tree.exists() else None) == before
    assert not list(ROOT.glob("lmcache.*tmp*"))


def test_unknown_python_tag_is_refused(tmp_path: Path) -> None:
    proc = factory("wheel", "--tag", "cp39", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert (
        "unknown Python tag 'cp39'" in proc.stderr and "cp310, cp311, cp312, cp313" in proc.stderr
    )


def test_no_network_and_no_local_wheel_is_a_clear_error(tmp_path: Path) -> None:
    env = {
        "LMCACHE_HYBRIDFA_CACHE": str(tmp_path / "empty-cache"),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": "",
    }
    proc = factory("wheel", "--no-materialize", "--out", str(tmp_path / "out"), env=env)
    assert proc.returncode == 2
    assert "could not download" in proc.stderr and "--base-wheel" in proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_marker_reports_a_clobbered_install(built: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-compile",
            "--target",
            str(target),
            str(built),
        ],
        check=True,
        capture_output=True,
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    probe = [
        sys.executable,
        "-c",
        "import runpy; runpy.run_module('lmcache._hybridfa', run_name='__main__')",
    ]
    ok = subprocess.run(probe, env=env, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert ok.returncode == 0 and "RECORD         ok" in ok.stdout, ok.stdout + ok.stderr
    assert "kernels        as in the base wheel" in ok.stdout
    victim = target / "lmcache" / "v1" / "kv_layer_groups.py"
    victim.write_text(victim.read_text() + "\n# overwritten by another install\n")
    bad = subprocess.run(probe, env=env, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert bad.returncode == 1
    assert "modified: lmcache/v1/kv_layer_groups.py" in bad.stdout
    assert "Reinstall the hybrid-FA wheel" in bad.stdout


def test_marker_holds_the_digest_of_the_patched_tree(built: Path) -> None:
    files = _files(built)
    digest = hashlib.sha256()
    marker_name = "lmcache/_hybridfa.py"
    for name in sorted(n for n in files if n.startswith("lmcache/") and n != marker_name):
        digest.update(name.encode() + b"\0" + files[name] + b"\0")
    marker = files[marker_name].decode()
    assert f'TREE_SHA256 = "{digest.hexdigest()}"' in marker


def _sdist_pins(tmp_path: Path, payload: bytes, sha256: str) -> tuple[wheel_factory.Pins, Path]:
    src = tmp_path / "served" / "lmcache-1.0.tar.gz"
    src.parent.mkdir()
    src.write_bytes(payload)
    sdist = {"filename": src.name, "sha256": sha256, "url": src.as_uri()}
    return wheel_factory.Pins("lmcache", "1.0", {}, sdist), src


def test_the_sdist_is_fetched_from_its_pinned_url_and_checked(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LMCACHE_HYBRIDFA_CACHE", str(tmp_path / "cache"))
    payload = b"an sdist"
    pins, _ = _sdist_pins(tmp_path, payload, hashlib.sha256(payload).hexdigest())
    got = wheel_factory.fetch_sdist(pins)
    assert got == tmp_path / "cache" / "lmcache-1.0.tar.gz"
    assert got.read_bytes() == payload


def test_an_sdist_of_another_digest_is_refused_and_not_cached(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LMCACHE_HYBRIDFA_CACHE", str(tmp_path / "cache"))
    pins, _ = _sdist_pins(tmp_path, b"another sdist", "0" * 64)
    with pytest.raises(wheel_factory.BuildError):
        wheel_factory.fetch_sdist(pins)
    assert list((tmp_path / "cache").iterdir()) == []


def test_an_unreachable_sdist_url_is_named(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LMCACHE_HYBRIDFA_CACHE", str(tmp_path / "cache"))
    pins, src = _sdist_pins(tmp_path, b"x", "0" * 64)
    src.unlink()
    with pytest.raises(wheel_factory.BuildError, match=f"fetching {src.as_uri()} failed"):
        wheel_factory.fetch_sdist(pins)


@pytest.mark.parametrize("base", ["", "bases/0.5.6"], ids=["0.5.3", "0.5.6"])
def test_each_bases_pinned_sdist_url_names_the_pinned_file(base: str) -> None:
    sdist = json.loads((ROOT / base / "pins.json").read_text())["sdist"]
    assert sdist["url"].startswith("https://files.pythonhosted.org/")
    assert sdist["url"].endswith("/" + sdist["filename"])
