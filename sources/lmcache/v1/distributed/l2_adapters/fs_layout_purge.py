# SPDX-License-Identifier: Apache-2.0
"""List or remove fs L2 objects written under another KV layout.

Usage::

    # what the folder holds, per model and layout fingerprint
    python -m lmcache.v1.distributed.l2_adapters.fs_layout_purge BASE_PATH

    # objects of MODEL not in layout FINGERPRINT (dry run, then for real)
    python -m lmcache.v1.distributed.l2_adapters.fs_layout_purge BASE_PATH \\
        --model MODEL --keep FINGERPRINT [--delete]

The server logs the fingerprint of a model keyed in a layout namespace when its
engine registers ("... keyed as 'MODEL~hfa-FINGERPRINT'"). Only objects of
MODEL under another layout fingerprint are selected, and the command removes
nothing when no object of MODEL has the fingerprint FINGERPRINT (a mistyped
--keep). Two kinds of objects are kept unless a flag asks for them:

- objects of MODEL without a fingerprint (written by pristine LMCache, or for
  a model of the same name without a hybrid layout): --include-unnamespaced;
- objects of a layout that a server may still be using: one with a file
  written in the last ten minutes: --include-live.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from lmcache.v1.distributed.layout_namespace import split_model_name

_FILE_EXT = ".data"
_KEY_SEP = "@"
_PATH_SLASH_REPLACEMENT = "-SEP-"


def scan(base_path: Path) -> Iterator[tuple[os.DirEntry[str], str, str | None]]:
    """Yield (entry, model, fingerprint or None) for each object file."""
    with os.scandir(base_path) as entries:
        for entry in entries:
            if not entry.name.endswith(_FILE_EXT) or _KEY_SEP not in entry.name:
                continue
            safe_model = entry.name.split(_KEY_SEP, 1)[0]
            model, fingerprint = split_model_name(
                safe_model.replace(_PATH_SLASH_REPLACEMENT, "/")
            )
            yield entry, model, fingerprint


LIVE_WINDOW_S = 600.0
"""A layout with an object file written this recently may still be in use."""


class Refusal(Exception):
    """The command removes nothing; the message says why."""


def stale_files(
    base_path: Path,
    model: str,
    keep: str,
    include_unnamespaced: bool = False,
    include_live: bool = False,
) -> tuple[list[Path], dict[str | None, float]]:
    """Object files of *model* whose layout fingerprint is not *keep*, and the layouts
    left out as live (fingerprint: seconds since their newest file was written).
    Raises Refusal when no object of *model* has the fingerprint *keep*."""
    by_layout: dict[str | None, list[os.DirEntry[str]]] = {}
    for entry, name, fingerprint in scan(base_path):
        if name == model:
            by_layout.setdefault(fingerprint, []).append(entry)
    if keep not in by_layout:
        found = ", ".join(sorted(f or "(none)" for f in by_layout)) or "none"
        raise Refusal(
            f"no object of model {model} has layout fingerprint {keep!r} (its "
            f"fingerprints here: {found}); check --keep against the fingerprint the "
            "server logs. Nothing removed."
        )
    now = time.time()
    stale: list[Path] = []
    live: dict[str | None, float] = {}
    for fingerprint, entries in by_layout.items():
        if fingerprint == keep or (fingerprint is None and not include_unnamespaced):
            continue
        age = now - max(e.stat().st_mtime for e in entries)
        if age < LIVE_WINDOW_S and not include_live:
            live[fingerprint] = age
            continue
        stale.extend(Path(e.path) for e in entries)
    return stale, live


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lmcache.v1.distributed.l2_adapters.fs_layout_purge",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("base_path", type=Path, help="the fs L2 adapter's base_path")
    parser.add_argument("--model", help="model name, as passed to the engine")
    parser.add_argument("--keep", help="the layout fingerprint to keep")
    parser.add_argument("--delete", action="store_true", help="remove the files")
    parser.add_argument(
        "--include-unnamespaced",
        action="store_true",
        help="also select the model's objects without a layout fingerprint",
    )
    parser.add_argument(
        "--include-live",
        action="store_true",
        help="also select layouts with objects written in the last ten minutes",
    )
    args = parser.parse_args(argv)

    if (args.model is None) != (args.keep is None):
        parser.error("--model and --keep go together")
    if args.model is None:
        summary: dict[tuple[str, str | None], list[float]] = {}
        for entry, model, fingerprint in scan(args.base_path):
            st = entry.stat()
            row = summary.setdefault((model, fingerprint), [0, 0, 0.0])
            row[0] += 1
            row[1] += st.st_size
            row[2] = max(row[2], st.st_mtime)
        now = time.time()
        for (model, fingerprint), (count, size, newest) in sorted(
            summary.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")
        ):
            print(
                f"{model}\t{fingerprint or '-'}\t{count:.0f} objects\t"
                f"{size:.0f} bytes\t"
                f"newest {now - newest:.0f} s ago"
            )
        return 0

    try:
        stale, live = stale_files(
            args.base_path,
            args.model,
            args.keep,
            include_unnamespaced=args.include_unnamespaced,
            include_live=args.include_live,
        )
    except Refusal as e:
        print(f"refused: {e}", file=sys.stderr)
        return 2
    for fingerprint, age in live.items():
        print(
            f"kept: layout {fingerprint or '(none)'} of {args.model} was written "
            f"{age:.0f} s "
            "ago, a server may still use it (--include-live when none does)",
            file=sys.stderr,
        )
    for path in stale:
        if args.delete:
            path.unlink(missing_ok=True)
        print(("removed " if args.delete else "stale ") + path.name)
    verb = "removed" if args.delete else "would remove (dry run; add --delete)"
    print(f"{verb}: {len(stale)} objects", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
