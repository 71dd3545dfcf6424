"""What a bench piece records of its machine and software (bench/machine.py), on CPU."""

from __future__ import annotations

import re
from pathlib import Path

from bench import machine


def test_this_wheels_revision_is_read_from_its_marker_without_importing_it(
    tmp_path: Path,
) -> None:
    (tmp_path / "lmcache").mkdir()
    marker = 'VERSION = "0.5.3+hybridfa.20"\nREVISION = "20"\nTREE_SHA256 = "abc"\n'
    (tmp_path / "lmcache" / "_hybridfa.py").write_text(marker + "raise SystemExit\n")
    got = machine.wheel_revision(tmp_path)
    assert got == {"version": "0.5.3+hybridfa.20", "revision": "20", "tree_sha256": "abc"}
    assert machine.wheel_revision(tmp_path / "none") == {}


def test_a_distributions_version_is_read_from_its_install_folder(tmp_path: Path) -> None:
    info = tmp_path / "lmcache-0.5.6.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lmcache\nVersion: 0.5.6\n")
    assert machine.dist_version(tmp_path, "lmcache") == "0.5.6"
    assert machine.dist_version(tmp_path, "vllm") is None


def test_the_host_is_named_by_hashes_of_its_ids(tmp_path: Path) -> None:
    facts = machine.host(tmp_path)
    assert facts["cpus_usable"] >= 1 and facts["cores"] >= facts["cpus_usable"]
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{16}", facts["boot_id"]) and boot not in facts["boot_id"]


def test_the_identity_is_the_gpu_model_the_revision_and_the_software() -> None:
    run = {
        "gpus": [{"name": "NVIDIA H100 80GB HBM3", "driver": "580"}],
        "revision": {"version": "0.5.3+hybridfa.20", "tree_sha256": "t", "revision": "20"},
        "software": {"vllm": "0.26.0"},
        "host": {"host_id": "a"},
    }
    ident = machine.identity(run)
    assert ident == {
        "gpu_model": "NVIDIA H100 80GB HBM3",
        "revision": ["0.5.3+hybridfa.20", "t"],
        "software": {"vllm": "0.26.0"},
    }
    other_host = machine.identity({**run, "host": {"host_id": "b"}})
    other_driver = machine.identity({**run, "gpus": [{"name": "NVIDIA H100 80GB HBM3"}]})
    assert machine.identity_key(ident) == machine.identity_key(other_host)
    assert machine.identity_key(ident) == machine.identity_key(other_driver)


def test_the_code_digest_changes_with_the_bench_code(tmp_path: Path) -> None:
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "a.py").write_text("x = 1\n")
    first = machine.code_digest(tmp_path)
    (tmp_path / "bench" / "a.py").write_text("x = 2\n")
    assert machine.code_digest(tmp_path) != first


def test_a_folder_is_summarized_by_its_files_and_bytes(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"12345")
    (tmp_path / "g").write_bytes(b"1")
    assert machine.folder_summary(tmp_path) == {"files": 2, "bytes": 6}
    assert machine.folder_summary(tmp_path / "absent") == {"files": 0, "bytes": 0}
