"""Wheel factory: a pinned pristine lmcache wheel + its patch series -> patched wheel.

Fetch (pip, cached), verify sha256 against the base's pins, unpack, add the whole new modules
every base shares (sources/), apply the whole series or nothing, add the marker module, repack
with a fresh RECORD and a PEP 440 local version.
Output is reproducible: fixed timestamps, sorted entries, fixed compression.

Two bases: lmcache 0.5.3 (the default: pins.json, patches/, ``REVISION`` of this package)
and lmcache 0.5.6 (bases/0.5.6/: pins.json, patches/, REVISION).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from hybridfa_build import REVISION, kernels

ROOT = Path(__file__).resolve().parent.parent
PINS_FILE = ROOT / "pins.json"
PATCHES_DIR = ROOT / "patches"
BASES_DIR = ROOT / "bases"
SOURCES_DIR = ROOT / "sources"
DEFAULT_BASE = "0.5.3"
MARKER_SOURCE = Path(__file__).resolve().parent / "marker.py"
MARKER_PATH = "lmcache/_hybridfa.py"
# 1980-01-01 is the earliest time a zip entry can carry; SOURCE_DATE_EPOCH overrides it.
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)
REGULAR_FILE_ATTR = 0o100644 << 16


class BuildError(Exception):
    """A build input is wrong; the message names the cause."""


@dataclass(frozen=True)
class Pins:
    package: str
    version: str
    wheels: dict[str, dict[str, str]]
    sdist: dict[str, str] | None
    revision: int = REVISION
    kernel_spec: kernels.KernelSpec | None = None

    @property
    def local_version(self) -> str:
        return f"{self.version}+hybridfa.{self.revision}"


def load_pins(path: Path = PINS_FILE, revision: int = REVISION) -> Pins:
    data = json.loads(path.read_text())
    spec = kernels.KernelSpec.from_pins(data["kernels"]) if "kernels" in data else None
    return Pins(data["package"], data["version"], data["wheels"], data.get("sdist"), revision, spec)


@dataclass(frozen=True)
class Base:
    """One pristine lmcache release the factory patches: its pins, series and revision."""

    name: str
    pins_file: Path
    patches_dir: Path
    revision_file: Path | None  # None: this package's REVISION (the 0.5.3 base)
    materialize_dir: Path  # where ``wheel``/``install`` refresh the patched lmcache/ tree

    @property
    def revision(self) -> int:
        if self.revision_file is None:
            return REVISION
        try:
            return int(self.revision_file.read_text().strip())
        except (OSError, ValueError) as exc:
            raise BuildError(f"base {self.name}: no revision in {self.revision_file}") from exc

    def pins(self) -> Pins:
        pins = load_pins(self.pins_file, self.revision)
        if pins.version != self.name:
            raise BuildError(f"base {self.name}: {self.pins_file} pins lmcache {pins.version}")
        return pins


def _other_base(name: str) -> Base:
    folder = BASES_DIR / name
    return Base(
        name, folder / "pins.json", folder / "patches", folder / "REVISION", folder / "lmcache"
    )


def base_names() -> list[str]:
    others = sorted(p.name for p in BASES_DIR.glob("*") if (p / "pins.json").is_file())
    return [DEFAULT_BASE, *others]


def get_base(name: str = DEFAULT_BASE) -> Base:
    if name == DEFAULT_BASE:
        return Base(DEFAULT_BASE, PINS_FILE, PATCHES_DIR, None, ROOT / "lmcache")
    if name not in base_names():
        raise BuildError(f"unknown base {name!r}: this factory builds {', '.join(base_names())}")
    return _other_base(name)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_series(patches_dir: Path = PATCHES_DIR) -> list[Path]:
    series = patches_dir / "series"
    if not series.is_file():
        raise BuildError(f"no series file at {series}")
    patches = []
    for line in series.read_text().splitlines():
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        patch = (patches_dir / name).resolve()
        if not patch.is_file():
            raise BuildError(f"series names {name}, but {patch} does not exist")
        patches.append(patch)
    return patches


def shared_sources(sources_dir: Path = SOURCES_DIR) -> list[str]:
    """The modules every base gets whole from ``sources_dir``, as paths in the tree."""
    files = (p for p in sources_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return sorted(p.relative_to(sources_dir).as_posix() for p in files)


def series_digest(patches_dir: Path = PATCHES_DIR, sources_dir: Path = SOURCES_DIR) -> str:
    """sha256 over the shared sources (path and bytes), the series file and every patch it
    lists, in order."""
    digest = hashlib.sha256()
    for name in shared_sources(sources_dir):
        digest.update(name.encode() + b"\0" + (sources_dir / name).read_bytes() + b"\0")
    digest.update((patches_dir / "series").read_bytes())
    for patch in read_series(patches_dir):
        digest.update(patch.name.encode() + b"\0" + patch.read_bytes())
    return digest.hexdigest()


def running_tag() -> str:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        raise BuildError(
            f"lmcache ships wheels for Linux x86_64 only; this is "
            f"{sys.platform} {platform.machine()}"
        )
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "lmcache-hybridfa"
    return Path(os.environ.get("LMCACHE_HYBRIDFA_CACHE", default))


def _pip_env() -> dict[str, str]:
    # Inside a PEP 517 build, pip's isolation variables would hide pip itself.
    env = dict(os.environ)
    for name in ("PYTHONPATH", "PYTHONNOUSERSITE"):
        env.pop(name, None)
    return env


def _pip_download(args: list[str], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest)]
    proc = subprocess.run(cmd + args, capture_output=True, text=True, env=_pip_env(), check=False)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise BuildError(
            "could not download the pristine base with pip (no network or no index?) "
            "and no local file was given; pass --base-wheel PATH (or set "
            f"LMCACHE_HYBRIDFA_BASE_WHEEL). pip said:\n{tail}"
        )


def verify(path: Path, expected_sha256: str, what: str) -> Path:
    actual = sha256_file(path)
    if actual != expected_sha256:
        raise BuildError(
            f"sha256 mismatch for {what} {path}: expected {expected_sha256}, got "
            f"{actual}. Refusing to build on an unverified base."
        )
    return path


def check_tag(pins: Pins, tag: str) -> dict[str, str]:
    if tag not in pins.wheels:
        raise BuildError(
            f"unknown Python tag {tag!r}: lmcache {pins.version} is pinned for "
            f"{', '.join(sorted(pins.wheels))}"
        )
    return pins.wheels[tag]


def fetch_base_wheel(pins: Pins, tag: str, base_wheel: Path | None = None) -> Path:
    """Return a verified pristine wheel for ``tag``: local, cached, or downloaded."""
    pin = check_tag(pins, tag)
    if base_wheel is None and os.environ.get("LMCACHE_HYBRIDFA_BASE_WHEEL"):
        base_wheel = Path(os.environ["LMCACHE_HYBRIDFA_BASE_WHEEL"])
    if base_wheel is not None:
        if base_wheel.is_dir():
            base_wheel = base_wheel / pin["filename"]
        if not base_wheel.is_file():
            raise BuildError(f"local base wheel {base_wheel} does not exist")
        return verify(base_wheel, pin["sha256"], f"pristine {tag} wheel")
    cached = cache_dir() / pin["filename"]
    if cached.is_file():
        return verify(cached, pin["sha256"], f"cached pristine {tag} wheel")
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
        version = f"{tag[2]}.{tag[3:]}"
        _pip_download(
            [
                "--only-binary=:all:",
                "--python-version",
                version,
                "--implementation",
                "cp",
                "--abi",
                tag,
                "--platform",
                "manylinux_2_28_x86_64",
                f"{pins.package}=={pins.version}",
            ],
            Path(tmp),
        )
        got = Path(tmp) / pin["filename"]
        if not got.is_file():
            raise BuildError(f"pip did not produce {pin['filename']} for {tag}")
        verify(got, pin["sha256"], f"downloaded pristine {tag} wheel")
        os.replace(got, cached)
    return cached


def fetch_sdist(pins: Pins, local: Path | None = None) -> Path:
    """Return the verified pristine sdist (LMCache's own test suite, the --kernels sources)."""
    if pins.sdist is None:
        raise BuildError(f"no sdist is pinned for lmcache {pins.version}")
    if local is not None:
        return verify(local, pins.sdist["sha256"], "pristine sdist")
    cached = cache_dir() / pins.sdist["filename"]
    if cached.is_file():
        return verify(cached, pins.sdist["sha256"], "cached pristine sdist")
    cached.parent.mkdir(parents=True, exist_ok=True)
    # From its pinned URL: pip would build the sdist's metadata first, in an environment with
    # its build requirements (torch, and for 0.5.6 CUDA).
    url = pins.sdist["url"]
    with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
        got = Path(tmp) / pins.sdist["filename"]
        try:
            with urllib.request.urlopen(url, timeout=300) as src:
                got.write_bytes(src.read())
        except OSError as e:
            raise BuildError(f"fetching {url} failed: {e}") from e
        verify(got, pins.sdist["sha256"], "downloaded pristine sdist")
        os.replace(got, cached)
    return cached


def add_sources(tree: Path, sources_dir: Path = SOURCES_DIR) -> None:
    """Copy the shared modules into ``tree``; each must be new to the pristine base."""
    for name in shared_sources(sources_dir):
        target = tree / name
        if target.exists():
            raise BuildError(f"{name} is in pristine lmcache; sources/ carries new modules only")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(sources_dir / name, target)


def patched_paths(patch: Path) -> set[str]:
    """The files a patch changes, as paths in the tree."""
    found = re.findall(r"^diff --git a/(\S+) b/", patch.read_text(errors="replace"), re.M)
    return set(found)


def check_no_shared_changes(patches: list[Path], sources_dir: Path = SOURCES_DIR) -> None:
    shared = set(shared_sources(sources_dir))
    for patch in patches:
        touched = sorted(patched_paths(patch) & shared)
        if touched:
            raise BuildError(
                f"patch {patch.name} changes {', '.join(touched)}, which sources/ carries "
                "whole for every base: change it there"
            )


def apply_series(tree: Path, patches: list[Path]) -> None:
    """Apply every patch to ``tree`` in order; raise on the first that does not apply."""
    check_no_shared_changes(patches)
    if shutil.which("git") is None:
        raise BuildError("git is needed to apply the patch series and was not found")
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent))
    for patch in patches:
        proc = subprocess.run(
            ["git", "apply", "-p1", "--whitespace=nowarn", str(patch)],
            cwd=tree,
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if proc.returncode != 0:
            raise BuildError(
                f"patch {patch.name} does not apply cleanly to pristine lmcache; "
                f"nothing was written. git apply said:\n{proc.stderr.strip()}"
            )


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def _date_time() -> tuple[int, int, int, int, int, int]:
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if not epoch:
        return ZIP_EPOCH
    stamp = time.gmtime(max(int(epoch), 315532800))
    return stamp[:6]


def tree_digest(tree: Path) -> str:
    """sha256 over the patched ``lmcache`` package (each file's path and bytes, in path
    order), the marker module aside: two series that build the same code for one Python
    tag share it."""
    digest = hashlib.sha256()
    for path in sorted((tree / "lmcache").rglob("*")):
        name = path.relative_to(tree).as_posix()
        if path.is_file() and name != MARKER_PATH and "__pycache__" not in name:
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def marker_source(
    pins: Pins, patches: list[Path], digest: str, tree_sha256: str, kernels_built: str = ""
) -> bytes:
    text = MARKER_SOURCE.read_text()
    for key, value in {
        "KERNELS": kernels_built,
        "BASE_VERSION": pins.version,
        "REVISION": str(pins.revision),
        "VERSION": pins.local_version,
        "SERIES_SHA256": digest,
        "TREE_SHA256": tree_sha256,
        "PATCHES": ",".join(p.name for p in patches),
    }.items():
        text = text.replace(f"@{key}@", value)
    return text.encode()


def wheel_name(pins: Pins, base_filename: str) -> str:
    rest = base_filename.split("-", 2)[2]  # python tag, abi tag, platform tag(s)
    return f"{pins.package}-{pins.local_version}-{rest}"


def _patched_entries(base: Path, tree: Path, pins: Pins, marker: bytes) -> dict:
    """Name -> (bytes, external_attr) for the new wheel, dist-info renamed."""
    old_info = f"{pins.package}-{pins.version}.dist-info/"
    new_info = f"{pins.package}-{pins.local_version}.dist-info/"
    entries: dict[str, tuple[bytes, int]] = {}
    with zipfile.ZipFile(base) as zf:
        for info in zf.infolist():
            if info.is_dir() or info.filename == old_info + "RECORD":
                continue
            data = (tree / info.filename).read_bytes()
            name = info.filename
            if name.startswith(old_info):
                name = new_info + name[len(old_info) :]
                if name == new_info + "METADATA":
                    data = data.replace(
                        f"\nVersion: {pins.version}\n".encode(),
                        f"\nVersion: {pins.local_version}\n".encode(),
                        1,
                    )
            entries[name] = (data, info.external_attr or REGULAR_FILE_ATTR)
    # Files a patch adds to the tree (not in the base wheel).
    for path in sorted(p for p in (tree / "lmcache").rglob("*") if p.is_file()):
        name = path.relative_to(tree).as_posix()
        if name not in entries and "__pycache__" not in name:
            entries[name] = (path.read_bytes(), REGULAR_FILE_ATTR)
    entries[MARKER_PATH] = (marker, REGULAR_FILE_ATTR)
    return entries


def _write_wheel(target: Path, entries: dict, record_name: str) -> None:
    date_time = _date_time()
    names = sorted(n for n in entries if ".dist-info/" not in n)
    names += sorted(n for n in entries if ".dist-info/" in n)
    record_lines = [f"{n},{_record_hash(entries[n][0])},{len(entries[n][0])}" for n in names]
    record_lines.append(f"{record_name},,")
    entries = dict(entries)
    entries[record_name] = (("\n".join(record_lines) + "\n").encode(), REGULAR_FILE_ATTR)
    names.append(record_name)
    with zipfile.ZipFile(target, "w") as zf:
        for name in names:
            data, attr = entries[name]
            info = zipfile.ZipInfo(name, date_time=date_time)
            info.external_attr = attr
            info.compress_type = zipfile.ZIP_DEFLATED
            info.create_system = 3
            zf.writestr(info, data, compresslevel=6)


def _replace_dir(src: Path, dest: Path) -> None:
    """Swap ``dest`` for ``src``'s contents with no half-written state left behind."""
    staging = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    if staging.exists():
        shutil.rmtree(staging)
    shutil.copytree(src, staging)
    old = dest.with_name(f"{dest.name}.old-tmp-{os.getpid()}")
    if dest.exists():
        os.replace(dest, old)
    os.replace(staging, dest)
    if old.exists():
        shutil.rmtree(old)


def build_wheel(
    tag: str,
    out_dir: Path,
    base_wheel: Path | None = None,
    materialize: Path | None = None,
    patches_dir: Path | None = None,
    base_name: str = DEFAULT_BASE,
    build_kernels: bool = False,
) -> Path:
    """Build the patched wheel of base ``base_name`` for ``tag`` into ``out_dir``.

    ``patches_dir``: a folder with a series file (default: the base's own series).
    ``materialize``: if given, that folder is replaced by the patched ``lmcache`` tree.
    ``build_kernels``: compile the base's CUDA copy kernels against this interpreter's torch
    (``tag`` must be this interpreter's) in place of the pristine wheel's.
    Nothing is written to ``out_dir`` or ``materialize`` unless the whole build succeeds.
    """
    base_def = get_base(base_name)
    pins = base_def.pins()
    patches_dir = patches_dir or base_def.patches_dir
    check_tag(pins, tag)
    patches = read_series(patches_dir)
    digest = series_digest(patches_dir)
    spec, against = None, ""  # the kernels to build, and the torch they are built against
    if build_kernels:
        spec = pins.kernel_spec
        if spec is None:
            raise BuildError(f"lmcache {pins.version}: no kernels to build are pinned")
        if tag != running_tag():
            raise BuildError(f"kernels are built for this interpreter ({running_tag()}), not {tag}")
        against = kernels.torch_cuda()
    base = fetch_base_wheel(pins, tag, base_wheel)
    with tempfile.TemporaryDirectory(prefix="hybridfa-build-") as tmp:
        tree = Path(tmp) / "tree"
        with zipfile.ZipFile(base) as zf:
            zf.extractall(tree)
        add_sources(tree)
        apply_series(tree, patches)
        if spec is not None:
            kernels.build(spec, fetch_sdist(pins), tree, against)
        marker = marker_source(pins, patches, digest, tree_digest(tree), against)
        entries = _patched_entries(base, tree, pins, marker)
        out_dir.mkdir(parents=True, exist_ok=True)
        name = wheel_name(pins, base.name)
        partial = Path(tmp) / name
        _write_wheel(partial, entries, f"{pins.package}-{pins.local_version}.dist-info/RECORD")
        if materialize is not None:
            (tree / MARKER_PATH).write_bytes(marker)
            _replace_dir(tree / "lmcache", materialize)
        target = out_dir / name
        shutil.copyfile(partial, out_dir / f".{name}.partial")
        os.replace(out_dir / f".{name}.partial", target)
    return target
