"""The offline bundle (hybridfa_gate.bundle, install-bundle.sh): the pinned sets, what is left
out, the parts of a cut bundle and their reassembly on the GPU machine. No download."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest

from hybridfa_gate import bundle


@pytest.mark.parametrize("vllm", bundle.releases())
def test_each_set_pins_its_vllm_a_torch_and_no_lmcache(vllm: str) -> None:
    found = bundle.pins(vllm)
    assert found["vllm"] == vllm
    assert "torch" in found and "lmcache" not in found  # pristine goes into a folder of its own


def test_there_are_sets_for_the_056_base_on_both_torches() -> None:
    torches = {
        bundle.pins(v)["torch"][:4] for v in bundle.releases() if bundle.base_of(v) == "0.5.6"
    }
    assert torches == {"2.13", "2.14"}


def test_a_release_without_a_set_is_refused_naming_those_that_exist() -> None:
    with pytest.raises(bundle.BundleError, match=f"sets exist for {bundle.releases()[0]}"):
        bundle.pins("0.25.0")


def test_a_pin_that_is_not_exact_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "vllm-9.9.9.txt").write_text("# a set\nvllm==9.9.9\ntorch>=2.14\n")
    monkeypatch.setattr(bundle, "REQUIREMENTS", tmp_path)
    with pytest.raises(bundle.BundleError, match="vllm-9.9.9.txt:3: not a name==version pin"):
        bundle.pins("9.9.9")


def test_the_base_and_the_kernels_follow_the_release() -> None:
    assert [bundle.base_of(v) for v in ("0.26.0", "0.28.0", "0.29.0", "0.34.0")] == [
        "0.5.3",
        "0.5.3",
        "0.5.6",
        "0.5.6",
    ]
    assert not bundle.kernels_needed("0.5.6", "2.13.0")
    assert bundle.kernels_needed("0.5.6", "2.14.0")
    assert bundle.kernels_needed("0.5.3", "2.13.0")


def test_the_download_leaves_out_what_the_machine_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vllm = bundle.releases()[-1]
    seen: list[list[str]] = []

    def call(cmd: list[str]) -> int:
        seen.append(cmd)
        return 0

    monkeypatch.setattr(bundle.subprocess, "call", call)
    stale = tmp_path / "wheels" / f"torch-{bundle.pins(vllm)['torch']}-cp312-cp312-linux.whl"
    kept = tmp_path / "wheels" / f"vllm-{vllm}-cp38-abi3-manylinux_2_28_x86_64.whl"
    for whl in (stale, kept):  # an earlier bundle of the full set
        whl.parent.mkdir(exist_ok=True)
        whl.write_bytes(b"PK")
    chosen = bundle.download(vllm, tmp_path, ["Torch", "nvidia_nccl_cu13"])
    assert not stale.exists() and kept.exists()
    (cmd,) = seen
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd
    listed = Path(cmd[cmd.index("-r") + 1]).read_text().split()
    assert listed == chosen and f"vllm=={vllm}" in listed
    assert not any(p.startswith(("torch==", "nvidia-nccl-cu13==")) for p in listed)
    assert len(listed) == len(bundle.pins(vllm)) - 2


def test_a_leave_out_the_set_does_not_hold_is_refused_before_any_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bundle.subprocess, "call", lambda cmd: pytest.fail("downloaded"))
    with pytest.raises(bundle.BundleError, match="does not hold: tensorflow"):
        bundle.download(bundle.releases()[-1], tmp_path, ["tensorflow"])


def _fake_bundle(out: Path, sizes: dict[str, int]) -> dict[str, bytes]:
    rng = random.Random(7)
    made = {}
    for rel, size in sizes.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        made[rel] = rng.randbytes(size)
        (out / rel).write_bytes(made[rel])
    return made


def test_a_cut_bundle_fits_its_parts_and_reassembles_into_one_install(tmp_path: Path) -> None:
    part = 40_000
    out = tmp_path / "bundle"
    wheels = _fake_bundle(
        out,
        {
            "wheels/torch-2.14.0-cp312-cp312-manylinux_2_28_x86_64.whl": 3 * part + 123,
            "wheels/vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl": part - 9_000,
            "wheels/six-1.17.0-py2.py3-none-any.whl": 3_000,
            "pristine/lmcache-0.5.6-cp312-cp312-manylinux_2_28_x86_64.whl": 20_000,
        },
    )
    parts = bundle.split_parts(out, part)
    for p in parts:
        assert sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) <= part
        assert (p / "install.sh").is_file()
    assert len(parts) == 5  # 4 torch pieces, and the rest fit beside them

    # The machine's side: stage every part, finish with a python that records its pip calls.
    log = tmp_path / "calls"
    fake_py = tmp_path / "python3"
    fake_py.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexit 0\n')
    fake_py.chmod(0o755)
    stage, own = tmp_path / "stage", tmp_path / "own-site"
    (own / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    for lib in ("libcublas.so.13", "libnvrtc.so.13"):  # the machine's, one of them carried too
        (own / "nvidia" / "cu13" / "lib" / lib).write_text("the machine's")
    (tmp_path / "site" / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    (tmp_path / "site" / "nvidia" / "cu13" / "lib" / "libnvrtc.so.13").write_text("carried")
    env = {**os.environ, "STAGE": str(stage), "SITE": str(tmp_path / "site"), "PY": str(fake_py)}
    env["PRISTINE"] = str(tmp_path / "lmc-pristine")
    for p in parts:
        subprocess.run(["bash", str(p / "install.sh"), "stage", str(p)], env=env, check=True)
    fake_py.write_text(
        f'#!/bin/sh\necho "$@" >> {log}\ncase "$1" in -c) case "$2" in *sysconfig*) '
        f"echo {own};; esac;; esac\nexit 0\n"
    )
    subprocess.run(["bash", str(parts[0] / "install.sh"), "finish"], env=env, check=True)
    for rel, data in wheels.items():
        assert (stage / rel).read_bytes() == data
    assert not list(stage.rglob("*.piece*"))
    pip_calls = [c for c in log.read_text().splitlines() if c.startswith("-m pip install")]
    assert len(pip_calls) == 2  # one for every wheel of the set, one for the pristine lmcache
    assert pip_calls[0].count(".whl") == 3 and "torch-2.14.0" in pip_calls[0]
    libs = tmp_path / "site" / "nvidia" / "cu13" / "lib"
    assert (
        libs / "libcublas.so.13"
    ).resolve() == own / "nvidia" / "cu13" / "lib" / "libcublas.so.13"
    assert not (libs / "libnvrtc.so.13").is_symlink()
    assert (libs / "libnvrtc.so.13").read_text() == "carried"
    assert f"PYTHONPATH={tmp_path / 'site'} " in (tmp_path / "site" / "env.sh").read_text()
