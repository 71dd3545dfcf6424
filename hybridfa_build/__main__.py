"""Command line: ``python -m hybridfa_build wheel|install|pq|export|sdist``."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from hybridfa_build import factory, kernels, marker, patchqueue

# Which build serves which vLLM: the answer to a base this factory does not build.
BUILDS = (
    "vLLM 0.26: `python -m hybridfa_build install`; vLLM 0.27/0.28: `install --kernels`; "
    "vLLM 0.29-0.32: `install --base 0.5.6`; vLLM 0.33/0.34: `install --base 0.5.6 --kernels`"
)
# pip options that install somewhere this interpreter does not import from by default
ELSEWHERE = ("--target", "-t", "--prefix", "--root")


def _wheels(args: argparse.Namespace) -> list[Path]:
    base = factory.get_base(args.base)
    pins = base.pins()
    tags = sorted(pins.wheels) if args.all_tags else [args.tag or factory.running_tag()]
    try:
        here = factory.running_tag()
    except factory.BuildError:
        here = None
    built = []
    for tag in tags:
        materialize = None  # install never: a tree in the checkout would shadow what it installs
        if args.command == "wheel" and not args.no_materialize and tag == here:
            materialize = base.materialize_dir
        wheel = factory.build_wheel(
            tag, Path(args.out), args.base_wheel, materialize, args.patches, args.base, args.kernels
        )
        print(f"built {wheel}")
        built.append(wheel)
    if built and args.command == "wheel":
        print(_kernels_note(args.base, built[-1]))
    return built


def _kernels_note(base: str, wheel: Path) -> str:
    """Which torch the wheel's compiled copy kernels load with (its marker says what
    ``--kernels`` built them against)."""
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read(factory.MARKER_PATH).decode()
    found = re.search(r'^KERNELS = "(.*)"', text, re.MULTILINE)
    need = marker.kernels_need(base, found.group(1) if found else "")
    known = marker.BASES.get(base)
    module = known.module if known is not None else "the compiled copy kernels"
    return f"the wheel's compiled copy kernels ({module}) need {need}"


def _install(args: argparse.Namespace) -> int:
    (wheel,) = _wheels(args)
    extra = [a for a in args.pip_args if a != "--"]
    pip = [sys.executable, "-m", "pip", "install"]
    rc = subprocess.call([*pip, "--force-reinstall", "--no-deps", str(wheel)])
    if rc == 0 and "--no-deps" not in extra:
        rc = subprocess.call([*pip, *extra, str(wheel)])
    if rc != 0:
        return rc
    print(_kernels_note(args.base, wheel))
    if any(a.split("=", 1)[0] in ELSEWHERE for a in extra):
        print("check it where it was installed: python -m lmcache._hybridfa")
        return 0
    # The installed build's own check, away from the checkout (whose lmcache/ tree, if
    # `wheel` wrote one, is not what was installed).
    with tempfile.TemporaryDirectory(prefix="hybridfa-check-") as away:
        check = subprocess.run(
            [sys.executable, "-m", "lmcache._hybridfa"],
            cwd=away,
            capture_output=True,
            text=True,
            check=False,
        )
    print(check.stdout, end="")
    if check.returncode != 0:
        print(check.stderr[-2000:], end="", file=sys.stderr)
        print("error: the installed build does not check out (above)", file=sys.stderr)
        return 1
    if marker.kernels_refused(check.stdout.splitlines()):
        print(
            "warning: installed, but this environment's torch cannot load the wheel's compiled "
            "copy kernels, so a CUDA LMCache server here refuses every model (above)",
            file=sys.stderr,
        )
    return 0


def _base(value: str) -> str:
    """A base this factory builds; any other answers which build serves its user."""
    names = factory.base_names()
    if value in names:
        return value
    raise argparse.ArgumentTypeError(
        f"this project builds lmcache {' and '.join(names)}, not {value}. A user of lmcache "
        f"{value} takes the build of their vLLM, which replaces the installed lmcache: "
        f"{BUILDS}"
    )


def _add_base(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base",
        default=factory.DEFAULT_BASE,
        type=_base,
        help=f"pristine lmcache release to patch: {', '.join(factory.base_names())} "
        f"(default: {factory.DEFAULT_BASE}). {BUILDS}",
    )


def _queue_dir(args: argparse.Namespace) -> Path:
    if args.dir is not None:
        return Path(args.dir)
    name = "pq" if args.base == factory.DEFAULT_BASE else f"pq-{args.base}"
    return factory.ROOT / "build" / name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridfa_build")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("wheel", "build dist/lmcache-<version>+hybridfa.<rev>-<tag>.whl"),
        ("install", "build the wheel for this interpreter and pip-install it"),
    ):
        p = sub.add_parser(name, help=text)
        if name == "wheel":
            p.add_argument(
                "--tag", help="CPython tag to build for, e.g. cp312 (default: this interpreter)"
            )
            p.add_argument("--all-tags", action="store_true", help="build every pinned tag")
        else:  # install: always this interpreter's tag
            p.set_defaults(tag=None, all_tags=False)
        p.add_argument(
            "--base-wheel",
            type=Path,
            help="local pristine lmcache wheel of the base (or a folder of them): offline build",
        )
        _add_base(p)
        p.add_argument(
            "--kernels",
            action="store_true",
            help="compile LMCache's CUDA copy kernels from the pinned sdist against this "
            "interpreter's torch (needs nvcc): for a torch other than the base wheel's",
        )
        p.add_argument("--out", default=str(factory.ROOT / "dist"), help="output folder")
        p.add_argument(
            "--patches",
            type=Path,
            help="patch folder holding a series file (default: the base's series, for "
            "0.5.3 patches/, for another base bases/VERSION/patches/)",
        )
        if name == "wheel":
            p.add_argument(
                "--no-materialize",
                action="store_true",
                help="do not refresh the top-level lmcache/ tree (written for reading the "
                "patched source; `install` never writes it)",
            )
        else:  # accepted, as before; install writes no tree anyway
            p.add_argument("--no-materialize", action="store_true", help=argparse.SUPPRESS)
        if name == "install":
            p.add_argument(
                "pip_args",
                nargs=argparse.REMAINDER,
                help="extra pip arguments after --, e.g. -- --no-deps",
            )
    p = sub.add_parser(
        "pq", help="make a git patch-queue checkout: pristine + one commit per patch"
    )
    p.add_argument("dir", nargs="?", help="default: build/pq (0.5.3), build/pq-VERSION")
    _add_base(p)
    p = sub.add_parser("export", help="write the patch-queue commits back to the base's series")
    p.add_argument("dir", nargs="?", help="default: build/pq (0.5.3), build/pq-VERSION")
    _add_base(p)
    p = sub.add_parser("sdist", help="fetch and verify the pristine sdist; print its path")
    _add_base(p)
    args = parser.parse_args(argv)
    try:
        if args.command == "wheel":
            _wheels(args)
        elif args.command == "install":
            return _install(args)
        elif args.command == "pq":
            print(patchqueue.make_queue(_queue_dir(args), base_name=args.base))
        elif args.command == "export":
            for patch in patchqueue.export_queue(_queue_dir(args), base_name=args.base):
                print(f"wrote {patch}")
        elif args.command == "sdist":
            print(factory.fetch_sdist(factory.get_base(args.base).pins()))
    except (factory.BuildError, kernels.KernelBuildError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
