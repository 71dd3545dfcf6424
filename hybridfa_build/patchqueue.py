"""A gbp-pq style patch queue: pristine tree as one commit, one commit per patch.

``make_queue`` builds it from the verified pristine wheel, commits the shared modules of
sources/ on top (tag ``sources``) and ``git am``s the series; edit, commit (one logical
change per commit, DEP-3 fields in the message body), then ``export_queue`` regenerates
patches/ and patches/series with ``git format-patch``. The shared modules are changed in
sources/ itself, never in a queue: a patch that changes one is refused on export.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

from hybridfa_build import factory

PRISTINE_TAG = "pristine"
SOURCES_TAG = "sources"
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "hybridfa",
    "GIT_AUTHOR_EMAIL": "hybridfa@localhost",
    "GIT_COMMITTER_NAME": "hybridfa",
    "GIT_COMMITTER_EMAIL": "hybridfa@localhost",
    "GIT_AUTHOR_DATE": "2026-08-05T21:14:00Z",
    "GIT_COMMITTER_DATE": "2026-08-05T21:14:00Z",
}
# ``git am`` takes each patch's author from its header; only the committer comes from here,
# so a queue can be made where git knows no identity.
_COMMITTER_ENV = {k: v for k, v in _GIT_ENV.items() if k.startswith("GIT_COMMITTER_")}


def _git(queue: Path, *args: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        ["git", *args],
        cwd=queue,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        check=False,
    )
    if proc.returncode != 0:
        raise factory.BuildError(f"git {' '.join(args)} failed:\n{proc.stderr.strip()}")
    return proc.stdout


def make_queue(queue: Path, tag: str | None = None, base_name: str = factory.DEFAULT_BASE) -> Path:
    base_def = factory.get_base(base_name)
    pins = base_def.pins()
    base = factory.fetch_base_wheel(pins, tag or factory.running_tag())
    if queue.exists():
        shutil.rmtree(queue)
    queue.mkdir(parents=True)
    with zipfile.ZipFile(base) as zf:
        members = [n for n in zf.namelist() if n.startswith("lmcache/") and not n.endswith(".so")]
        zf.extractall(queue, members)
    _git(queue, "init", "-q", "-b", "main")
    # Every file of the wheel, also those its own .gitignore names (0.5.6's generated
    # protobuf bindings), so that a patch can change them.
    _git(queue, "add", "-A", "--force")
    _git(queue, "commit", "-q", "-m", f"pristine {base.name}", env=_GIT_ENV)
    _git(queue, "tag", PRISTINE_TAG)
    factory.add_sources(queue)
    _git(queue, "add", "-A")
    _git(queue, "commit", "-q", "--allow-empty", "-m", "sources: the shared modules", env=_GIT_ENV)
    _git(queue, "tag", SOURCES_TAG)
    try:
        for patch in factory.read_series(base_def.patches_dir):
            _git(queue, "am", "-q", "--keep-non-patch", str(patch), env=_COMMITTER_ENV)
    except factory.BuildError:
        shutil.rmtree(queue)  # no half-made queue to export by mistake
        raise
    return queue


def queue_version(queue: Path) -> str:
    """The lmcache version of the pristine wheel a queue was made from."""
    subject = _git(queue, "log", "-1", "--format=%s", PRISTINE_TAG).strip()
    parts = subject.split("-")
    if not subject.startswith("pristine lmcache-") or len(parts) < 2:
        raise factory.BuildError(f"{queue}: its {PRISTINE_TAG} commit names no lmcache wheel")
    return parts[1]


def export_queue(
    queue: Path, patches_dir: Path | None = None, base_name: str = factory.DEFAULT_BASE
) -> list[Path]:
    base_def = factory.get_base(base_name)
    version = queue_version(queue)
    if version != base_def.pins().version:
        raise factory.BuildError(
            f"{queue} is a patch queue of lmcache {version}, not of base {base_name}; "
            f"export it with --base {version}"
        )
    patches_dir = patches_dir or base_def.patches_dir
    with tempfile.TemporaryDirectory() as tmp:
        out = _git(
            queue,
            "format-patch",
            "--zero-commit",
            "--no-signature",
            "--full-index",
            "--no-numbered",
            "-o",
            tmp,
            f"{SOURCES_TAG}..HEAD",
        )
        made = [Path(line) for line in out.split()]
        factory.check_no_shared_changes(made)
        patches_dir.mkdir(parents=True, exist_ok=True)
        for old in patches_dir.glob("*.patch"):
            old.unlink()
        written = [Path(shutil.copy2(p, patches_dir / p.name)) for p in made]
    (patches_dir / "series").write_text("".join(f"{p.name}\n" for p in written))
    return written
