"""Build a base's compiled CUDA copy kernels against the torch of this interpreter.

A pristine lmcache wheel carries its copy kernels built against one torch: 0.5.3's
``lmcache.c_ops`` against the torch that vLLM 0.26 pins (2.11), 0.5.6's ``lmcache.cuda_ops``
against vLLM 0.29-0.32's (2.13). Under another torch the extension does not load, and the
patched server refuses every layout rather than copy it with LMCache's Python fallback.
``--kernels`` compiles the same sources, taken from the base's pinned and verified sdist,
with this interpreter's torch and the CUDA compiler it finds, checks that the result loads,
and puts it in the wheel in place of the pristine one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

SETUP_SCRIPT = """\
import glob, os, sys
import torch
from setuptools import setup
from torch.utils import cpp_extension

# torch takes the toolkit from CUDA_HOME, else from the nvcc on PATH; where that nvcc is a
# wrapper script outside the toolkit, the folder torch derives holds no CUDA headers.
home = cpp_extension.CUDA_HOME
if not home or not os.path.isfile(os.path.join(home, "include", "cuda_runtime.h")):
    sys.exit(f"error: torch found no CUDA toolkit headers (CUDA_HOME {home}, taken from the "
             "environment or the nvcc on PATH): set CUDA_HOME to the toolkit's folder, the one "
             "holding include/cuda_runtime.h")
abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
# pip's CUDA wheels (nvidia-cublas and friends) hold headers that torch's own include
# (cublas_v2.h, cusparse.h). Searched after the compiler's own, so that the toolkit's
# headers win where a wheel of a newer CUDA holds them too.
headers = sorted(glob.glob(os.path.join(os.path.dirname(os.path.dirname(torch.__file__)),
                                        "nvidia", "*", "include")))
module, sources, include_dirs = sys.argv.pop(1), sys.argv.pop(1), sys.argv.pop(1)
setup(
    name="hybridfa_kernels",
    ext_modules=[cpp_extension.CUDAExtension(
        module,
        sources=sources.split(","),
        include_dirs=[os.path.abspath(d) for d in include_dirs.split(",") if d],
        extra_compile_args={"cxx": [abi, *(f"-idirafter{h}" for h in headers)],
                            "nvcc": [abi, *(f"-Xcompiler=-idirafter{h}" for h in headers)]})],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)
"""

PROBE = """\
import importlib.util, sys
import torch
spec = importlib.util.spec_from_file_location(sys.argv[1], sys.argv[2])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
missing = [name for name in sys.argv[3].split(",") if not hasattr(module, name)]
sys.exit(f"it binds no {', '.join(missing)}" if missing else 0)
"""


class KernelBuildError(Exception):
    """The kernels could not be built or do not load; the message names the cause."""


@dataclass(frozen=True)
class KernelSpec:
    """What a base's pins say about its compiled copy kernels."""

    module: str  # e.g. "lmcache.c_ops"
    sources: tuple[str, ...]  # relative to the sdist's root
    entry_points: tuple[str, ...]  # names the built module must bind
    include_dirs: tuple[str, ...] = ()  # relative to the sdist's root, within its csrc/

    @classmethod
    def from_pins(cls, data: dict) -> KernelSpec:
        return cls(
            data["module"],
            tuple(data["sources"]),
            tuple(data["entry_points"]),
            tuple(data.get("include_dirs", ())),
        )


def torch_cuda() -> str:
    """This interpreter's torch, or why it cannot build CUDA kernels."""
    probe = "import torch; print(torch.__version__, torch.version.cuda or '')"
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise KernelBuildError(f"torch does not import in {sys.executable}")
    version, _, cuda = proc.stdout.strip().rpartition("\n")[2].partition(" ")
    if not cuda:
        raise KernelBuildError(f"torch {version} here is a CPU build: no CUDA kernels to build")
    return f"torch {version} (CUDA {cuda})"


def extract_sources(sdist: Path, spec: KernelSpec, dest: Path) -> None:
    """Unpack the sdist's ``csrc/`` (the sources and the headers they include) into ``dest``."""
    with tarfile.open(sdist) as tar:
        members = tar.getmembers()
        root = members[0].name.split("/", 1)[0]
        members = [m for m in members if m.name.startswith(f"{root}/csrc/")]
        missing = set(spec.sources) - {m.name[len(root) + 1 :] for m in members}
        if missing:
            raise KernelBuildError(f"{sdist.name} lacks {', '.join(sorted(missing))}")
        for member in members:
            if member.isfile() or member.isdir():
                member.name = member.name[len(root) + 1 :]
                if ".." in Path(member.name).parts:
                    raise KernelBuildError(f"{sdist.name}: {member.name} leaves csrc/")
                if hasattr(tarfile, "data_filter"):
                    tar.extract(member, dest, filter="data")
                else:  # no PEP 706 filters: Python before 3.10.12 / 3.11.4
                    tar.extract(member, dest)  # noqa: S202


def build(spec: KernelSpec, sdist: Path, tree: Path, against: str) -> None:
    """Compile ``spec`` from ``sdist`` into the unpacked wheel ``tree`` in place of the
    pristine module, with the torch ``against`` (``torch_cuda()``) names. Nothing in
    ``tree`` changes on error."""
    package, _, name = spec.module.rpartition(".")
    pristine = sorted((tree / package.replace(".", "/")).glob(f"{name}.*.so"))
    if len(pristine) != 1:
        raise KernelBuildError(f"the base wheel holds {len(pristine)} {spec.module} modules")
    with tempfile.TemporaryDirectory(prefix="hybridfa-kernels-") as tmp:
        work = Path(tmp)
        extract_sources(sdist, spec, work)
        (work / "setup.py").write_text(SETUP_SCRIPT)
        cmd = [
            sys.executable,
            "setup.py",
            spec.module,
            ",".join(spec.sources),
            ",".join(spec.include_dirs),
        ]
        proc = subprocess.run(
            [*cmd, "build_ext", "--build-lib", "built"],
            cwd=work,
            capture_output=True,
            text=True,
            check=False,
        )
        built = sorted((work / "built" / package.replace(".", "/")).glob(f"{name}.*.so"))
        if proc.returncode != 0 or len(built) != 1:
            lines = (proc.stdout + proc.stderr).strip().splitlines()
            shown = [line for line in lines if "error" in line.lower()][:10] or lines[-15:]
            raise KernelBuildError(
                f"compiling {spec.module} against {against} failed:\n" + "\n".join(shown)
            )
        if built[0].name != pristine[0].name:
            raise KernelBuildError(f"built {built[0].name}, the wheel holds {pristine[0].name}")
        # The wheel's own package goes first: 0.5.6's module imports lmcache.lmcache_native.
        path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
        probe = subprocess.run(
            [sys.executable, "-c", PROBE, spec.module, str(built[0]), ",".join(spec.entry_points)],
            cwd=work,
            env={**os.environ, "PYTHONPATH": path},
            capture_output=True,
            text=True,
            check=False,
        )
        if probe.returncode != 0:
            tail = "\n".join((probe.stdout + probe.stderr).strip().splitlines()[-5:])
            raise KernelBuildError(f"the built {spec.module} does not load:\n{tail}")
        pristine[0].write_bytes(built[0].read_bytes())
