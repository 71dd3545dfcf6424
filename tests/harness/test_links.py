"""Every relative link in the project's markdown resolves: to a file or folder of the checkout,
and where it names a section (``#anchor``), to a heading of that file. results/ stays under
5 MB: every copy of the checkout carries it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS_LIMIT = 5 * 1000 * 1000

# [text](target) and [text](target "title"), not images' own syntax differences; code spans and
# fenced blocks are removed first.
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def markdown_files() -> list[Path]:
    """The checkout's markdown: what git tracks or would track (README, docs, EXPLAINER, the
    changelogs and the folders' READMEs), not the materialized lmcache/ trees."""
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return sorted(REPO / n for n in out if n.endswith(".md") and (REPO / n).is_file())


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to
    hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(text):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    text = CODE.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))
    return LINK.findall(text)


def broken(path: Path) -> list[str]:
    """The relative links of ``path`` that do not resolve."""
    problems = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, mailto:, ...
            continue
        where, _, anchor = target.partition("#")
        dest = (path.parent / where).resolve() if where else path
        if not dest.exists():
            problems.append(f"{target}: no such file")
        elif anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading #{anchor} in {dest.name}")
    return problems


def test_there_is_markdown_to_check() -> None:
    names = {p.relative_to(REPO).as_posix() for p in markdown_files()}
    assert {"README.md", "EXPLAINER.md", "docs/results.md", "results/README.md"} <= names


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(path: Path) -> None:
    assert broken(path) == []


def test_a_broken_link_and_a_missing_section_are_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Title\n\n## A chat's second turn (25:1, `c1N`)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-chats-second-turn-251-c1n) [gone](missing.md) "
        "[bad](other.md#nowhere) [web](https://example.com/x) [self](#local)\n\n# Local\n"
        "`[not a link](nowhere.md)`\n```\n[also not](nowhere.md)\n```\n"
    )
    assert broken(page) == [
        "missing.md: no such file",
        "other.md#nowhere: no heading #nowhere in other.md",
    ]


def test_results_stay_under_5_mb() -> None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "-z", "results"],
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = [REPO / n for n in out.decode().split("\0") if n]
    size = sum(f.stat().st_size for f in files if f.is_file())
    assert size < RESULTS_LIMIT, f"results/ tracks {size} bytes, more than {RESULTS_LIMIT}"
