"""``--kernels``: LMCache's copy kernels compiled against this interpreter's torch, or a clear
refusal that writes nothing."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
import torch
from factory_cli import factory

from hybridfa_build import factory as wheel_factory
from hybridfa_build import kernels


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch can build CUDA kernels")
@pytest.mark.parametrize("base", ["0.5.3", "0.5.6"])
def test_kernels_on_a_cpu_torch_are_refused_with_the_cause_and_nothing_written(
    tmp_path: Path, base: str
) -> None:
    proc = factory("wheel", "--base", base, "--kernels", "--no-materialize", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert f"torch {torch.__version__} here is a CPU build" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_kernels_for_another_interpreter_are_refused(tmp_path: Path) -> None:
    other = "cp310" if wheel_factory.running_tag() != "cp310" else "cp311"
    proc = factory("wheel", "--kernels", "--tag", other, "--out", str(tmp_path))
    assert proc.returncode == 2
    assert f"built for this interpreter ({wheel_factory.running_tag()}), not {other}" in (
        proc.stderr
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("base", "module", "sources_under", "include_dirs"),
    [
        ("0.5.3", "lmcache.c_ops", "csrc/", ()),
        ("0.5.6", "lmcache.cuda_ops", "csrc/cuda/", ("csrc",)),
    ],
)
def test_the_pins_name_the_kernel_module_the_patches_check_for(
    base: str, module: str, sources_under: str, include_dirs: tuple[str, ...]
) -> None:
    spec = wheel_factory.get_base(base).pins().kernel_spec
    assert spec is not None
    assert spec.module == module
    assert spec.entry_points == ("execute_object_group_transfer",)
    assert all(s.startswith(sources_under) for s in spec.sources)
    assert spec.include_dirs == include_dirs


def _sdist(tmp_path: Path, files: list[str]) -> Path:
    path = tmp_path / "lmcache-0.5.3.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name in files:
            info = tarfile.TarInfo(f"lmcache-0.5.3/{name}")
            info.size = 3
            tar.addfile(info, io.BytesIO(b"x;\n"))
    return path


def test_a_source_missing_from_the_sdist_is_named_and_the_wheel_tree_is_untouched(
    tmp_path: Path,
) -> None:
    spec = kernels.KernelSpec("lmcache.c_ops", ("csrc/a.cu", "csrc/b.cpp"), ("f",))
    sdist = _sdist(tmp_path, ["csrc/a.cu", "setup.py"])
    with pytest.raises(kernels.KernelBuildError, match="lmcache-0.5.3.tar.gz lacks csrc/b.cpp"):
        kernels.extract_sources(sdist, spec, tmp_path / "work")
    assert not (tmp_path / "work" / "csrc").exists()


def test_only_the_sdists_csrc_is_extracted(tmp_path: Path) -> None:
    spec = kernels.KernelSpec("lmcache.c_ops", ("csrc/a.cu",), ("f",))
    sdist = _sdist(tmp_path, ["csrc/a.cu", "csrc/sub/h.h", "setup.py"])
    kernels.extract_sources(sdist, spec, tmp_path / "work")
    got = sorted(
        p.relative_to(tmp_path / "work").as_posix() for p in (tmp_path / "work").rglob("*")
    )
    assert got == ["csrc", "csrc/a.cu", "csrc/sub", "csrc/sub/h.h"]


def python_without_tar_filters(monkeypatch: pytest.MonkeyPatch) -> None:
    """tarfile as a Python before PEP 706 has it (3.11.2, e.g.): no ``data_filter``, and an
    ``extract`` that takes no ``filter``. On such a Python, tarfile stays as it is."""
    if not hasattr(tarfile, "data_filter"):
        return
    monkeypatch.delattr(tarfile, "data_filter")
    extract = tarfile.TarFile.extract

    def old_extract(self: tarfile.TarFile, member: tarfile.TarInfo, path: str | Path = "") -> None:
        extract(self, member, path, filter="fully_trusted")

    monkeypatch.setattr(tarfile.TarFile, "extract", old_extract)


@pytest.mark.parametrize("pep706", [True, False], ids=["filters", "no-filters"])
def test_an_sdist_member_that_leaves_csrc_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pep706: bool
) -> None:
    if pep706 and not hasattr(tarfile, "data_filter"):
        pytest.skip("this Python has no tar filters")
    if not pep706:
        python_without_tar_filters(monkeypatch)
    spec = kernels.KernelSpec("lmcache.c_ops", ("csrc/a.cu",), ("f",))
    sdist = _sdist(tmp_path, ["csrc/a.cu", "csrc/../../escaped.cu"])
    with pytest.raises(kernels.KernelBuildError, match="leaves csrc/"):
        kernels.extract_sources(sdist, spec, tmp_path / "work")
    assert not (tmp_path / "escaped.cu").exists()


def test_the_sources_unpack_on_a_python_without_tar_filters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python_without_tar_filters(monkeypatch)
    spec = kernels.KernelSpec("lmcache.c_ops", ("csrc/a.cu",), ("f",))
    kernels.extract_sources(_sdist(tmp_path, ["csrc/a.cu"]), spec, tmp_path / "work")
    assert (tmp_path / "work" / "csrc" / "a.cu").read_bytes() == b"x;\n"


def test_a_toolkit_without_headers_is_named_and_the_wheel_tree_is_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch takes CUDA_HOME from the nvcc on PATH; where that nvcc is a wrapper script outside
    the toolkit, the headers are not there and the build must say what to set."""
    fake = tmp_path / "fake-torch" / "torch"
    (fake / "utils").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "utils" / "__init__.py").write_text("")
    (fake / "utils" / "cpp_extension.py").write_text(f"CUDA_HOME = {str(tmp_path / 'usr')!r}\n")
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))
    tree = tmp_path / "tree"
    (tree / "lmcache").mkdir(parents=True)
    pristine = tree / "lmcache" / "c_ops.cpython-312-x86_64-linux-gnu.so"
    pristine.write_bytes(b"pristine")
    spec = kernels.KernelSpec("lmcache.c_ops", ("csrc/a.cu",), ("f",))
    with pytest.raises(kernels.KernelBuildError, match="set CUDA_HOME to the toolkit's folder"):
        kernels.build(spec, _sdist(tmp_path, ["csrc/a.cu"]), tree, "torch 2.14.0 (CUDA 13.0)")
    assert pristine.read_bytes() == b"pristine"
