"""Wheels for a GPU machine without a package index, for one vLLM release.

    python -m hybridfa_gate.bundle 0.34.0 bundle [--leave-out NAME ...] [--part-mb MB]

``bundle/wheels``: the pinned set of ``requirements/vllm-<version>.txt`` (CPython 3.12, Linux
x86_64, CUDA 13), each installed without its declared dependencies, less the packages
``--leave-out`` names (those the machine has at a version that serves: its torch's CUDA
libraries, say); ``bundle/pristine``: the pristine lmcache wheel of the base that serves that
vLLM, its sha256 checked against the base's pins; ``bundle/install.sh``, which installs both on
the GPU machine. It prints the command that builds the patched wheel, which ``--kernels`` needs
to run under the set's torch.

With ``--part-mb``, ``bundle/parts/p00``, ``p01``, ...: the same files in parts of at most that
many megabytes, a larger file cut into pieces, for a machine reached by transfers of limited
size. Each part holds ``install.sh``: ``bash PART/install.sh stage PART`` copies a part into the
machine's staging folder, and after the last ``bash PART/install.sh finish`` joins the pieces and
installs (docs/gpu-node.md).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from hybridfa_build import factory, marker

REQUIREMENTS = Path(__file__).resolve().parent / "requirements"
INSTALL_SH = Path(__file__).resolve().parent / "install-bundle.sh"
TAG = "cp312"
PLATFORM = [
    "--only-binary=:all:",
    "--python-version=3.12",
    "--implementation=cp",
    "--abi=cp312",
    "--abi=abi3",
    "--abi=none",
    *(f"--platform=manylinux_2_{m}_x86_64" for m in range(34, 11, -1)),
    "--platform=manylinux2014_x86_64",
    "--platform=manylinux2010_x86_64",
    "--platform=manylinux1_x86_64",
    "--platform=any",
]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")


class BundleError(Exception):
    pass


def releases() -> list[str]:
    """The vLLM releases a pinned set exists for."""
    return sorted(p.stem.removeprefix("vllm-") for p in REQUIREMENTS.glob("vllm-*.txt"))


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(vllm: str) -> dict[str, str]:
    """The set's ``name: version`` (names normalized), from its requirements file."""
    path = REQUIREMENTS / f"vllm-{vllm}.txt"
    if not path.is_file():
        raise BundleError(f"no pinned set for vLLM {vllm}; sets exist for {', '.join(releases())}")
    found: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = PIN.match(line)
        if m is None:
            raise BundleError(f"{path.name}:{n}: not a name==version pin: {line!r}")
        name = normalized(m.group(1))
        if name in found:
            raise BundleError(f"{path.name}:{n}: {name} pinned twice")
        found[name] = m.group(2)
    return found


def base_of(vllm: str) -> str:
    """The lmcache base whose build serves ``vllm`` (hybridfa_build's BUILDS)."""
    minor = int(vllm.split(".")[1])
    return "0.5.3" if minor < 29 else "0.5.6"


def kernels_needed(base: str, torch: str) -> bool:
    """Whether the pristine base wheel's compiled kernels fail to load under ``torch``."""
    return not torch.startswith(marker.BASES[base].torch + ".")


def download(vllm: str, out: Path, leave_out: Sequence[str]) -> list[str]:
    """The set's wheels into ``out/wheels``, less ``leave_out``; returns the pins downloaded."""
    wanted = pins(vllm)
    unknown = sorted({normalized(n) for n in leave_out} - set(wanted))
    if unknown:
        raise BundleError(f"--leave-out names what the set does not hold: {', '.join(unknown)}")
    left = {normalized(n) for n in leave_out}
    chosen = [f"{n}=={v}" for n, v in sorted(wanted.items()) if n not in left]
    req = out / f"vllm-{vllm}.txt"
    req.write_text("".join(f"{p}\n" for p in chosen))
    for whl in (out / "wheels").glob("*.whl"):  # an earlier bundle's, outside this set
        name, version = whl.name.split("-")[:2]
        if f"{normalized(name)}=={version}" not in chosen:
            whl.unlink()
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM]
    rc = subprocess.call([*cmd, "-d", str(out / "wheels"), "-r", str(req)])
    if rc != 0:
        raise BundleError(f"pip download failed (exit {rc})")
    return chosen


def split_parts(out: Path, part_bytes: int) -> list[Path]:
    """The bundle's files in parts of at most ``part_bytes``, first fit decreasing; a file
    larger than a part is cut into ``NAME.pieceNN``, which ``install.sh finish`` joins."""
    files = [p for d in ("wheels", "pristine") for p in sorted((out / d).glob("*.whl"))]
    room = part_bytes - INSTALL_SH.stat().st_size
    pieces: list[tuple[Path, str, int, int]] = []  # (file, name in the part, offset, size)
    for f in files:
        rel = f.relative_to(out).as_posix()
        size = f.stat().st_size
        if size <= room:
            pieces.append((f, rel, 0, size))
            continue
        if size > 100 * room:
            raise BundleError(f"{rel}: more than 100 pieces of {room} bytes; raise --part-mb")
        for i, off in enumerate(range(0, size, room)):
            pieces.append((f, f"{rel}.piece{i:02d}", off, min(room, size - off)))
    bins: list[list[tuple[Path, str, int, int]]] = []
    free: list[int] = []
    for piece in sorted(pieces, key=lambda p: -p[3]):
        i = next((i for i, r in enumerate(free) if r >= piece[3]), None)
        if i is None:
            bins.append([])
            free.append(room)
            i = len(bins) - 1
        bins[i].append(piece)
        free[i] -= piece[3]
    shutil.rmtree(out / "parts", ignore_errors=True)
    made = []
    for n, content in enumerate(bins):
        part = out / "parts" / f"p{n:02d}"
        for f, name, off, size in content:
            (part / name).parent.mkdir(parents=True, exist_ok=True)
            with f.open("rb") as src, (part / name).open("wb") as dst:
                src.seek(off)
                dst.write(src.read(size))
        shutil.copy(INSTALL_SH, part / "install.sh")
        made.append(part)
    return made


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridfa_gate.bundle", description=__doc__)
    ap.add_argument("vllm", help=f"the vLLM release: {', '.join(releases())}")
    ap.add_argument("out", type=Path)
    ap.add_argument("--leave-out", nargs="+", default=[], metavar="NAME")
    ap.add_argument("--part-mb", type=float, default=0.0)
    a = ap.parse_args(argv)
    try:
        torch = pins(a.vllm)["torch"]
        base = base_of(a.vllm)
        a.out.mkdir(parents=True, exist_ok=True)
        chosen = download(a.vllm, a.out, a.leave_out)
        pristine = factory.fetch_base_wheel(factory.get_base(base).pins(), TAG)
        shutil.rmtree(a.out / "pristine", ignore_errors=True)
        (a.out / "pristine").mkdir()
        shutil.copy(pristine, a.out / "pristine" / pristine.name)
        shutil.copy(INSTALL_SH, a.out / "install.sh")
        parts = split_parts(a.out, int(a.part_mb * 1e6)) if a.part_mb > 0 else []
    except (BundleError, factory.BuildError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"{len(chosen)} wheels in {a.out / 'wheels'}; pristine lmcache {base} in {a.out}/pristine"
    )
    if parts:
        print(f"{len(parts)} parts in {a.out / 'parts'}: stage each in turn, then finish")
    kernels = " --kernels" if kernels_needed(base, torch) else ""
    print(
        f"the patched wheel: python -m hybridfa_build wheel --base {base} --tag {TAG}{kernels} "
        f"--no-materialize --out {a.out / 'patched'}"
        + (f"  (under torch {torch}, nvcc 13.0: docs/gpu-node.md)" if kernels else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
