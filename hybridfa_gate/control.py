"""The control arm: pristine lmcache 0.5.3 plus only the series' patches without which pristine
stores nothing to compare, so that the gate can show that its criterion (a) bites there too.

Pristine's HND stores crash (its recurrent-state page view ignores the layout), and over a
``resp`` tier its native connector writes no recurrent object of some layouts (it sizes a batch
by the first buffer): such a pristine case restores nothing and proves nothing. The control
tree fixes those two and nothing else; its HND and resp cases must fail (a) as pristine's NHD
fs cases do.

    python -m hybridfa_gate.control --pristine /tmp/lmc-pristine --out /tmp/lmc-control
    python -m hybridfa_gate --arm control --lmcache-dir /tmp/lmc-control --cases 'qwen35-r5-HND-.*'

``--pristine``: a folder where pristine lmcache 0.5.3 is installed (``pip install --target``).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

PATCHES = Path(__file__).resolve().parent.parent / "patches"
# Subjects (file name words) of the series' patches the control applies.
CONTROL_PATCHES = (
    "Mamba-page-view-honours-the-HND-layout",
    "Native-connector-L2-adapter-one-native-batch-per-obj",
)


def control_patches(patches: Path = PATCHES) -> list[Path]:
    """The series' files of CONTROL_PATCHES, in series order."""
    series = (patches / "series").read_text().split()
    found = [patches / name for name in series if any(s in name for s in CONTROL_PATCHES)]
    missing = [s for s in CONTROL_PATCHES if not any(s in p.name for p in found)]
    if missing:
        raise SystemExit(
            f"{patches}/series has no patch named like {missing}: update CONTROL_PATCHES"
        )
    return found


def build_control(pristine: Path, out: Path, patches: Path = PATCHES) -> list[str]:
    """Copy the pristine tree to ``out`` and apply the control patches to it."""
    if not (pristine / "lmcache").is_dir():
        raise SystemExit(f"{pristine} holds no lmcache package")
    if (pristine / "lmcache" / "_hybridfa.py").exists():
        raise SystemExit(f"{pristine} holds a patched lmcache, not pristine 0.5.3")
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(pristine, out, symlinks=True)
    applied = []
    for patch in control_patches(patches):
        cmd = ["patch", "--batch", "--forward", "-p1", "-d", str(out), "-i", str(patch)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(
                f"{patch.name} does not apply to {pristine}:\n{proc.stdout}{proc.stderr}"
            )
        applied.append(patch.name)
    return applied


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m hybridfa_gate.control", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--pristine", type=Path, required=True, help="pristine lmcache 0.5.3 install folder"
    )
    ap.add_argument("--out", type=Path, required=True, help="the control tree (replaced)")
    a = ap.parse_args(argv)
    for name in build_control(a.pristine.resolve(), a.out.resolve()):
        print(f"applied {name}")
    print(a.out.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
