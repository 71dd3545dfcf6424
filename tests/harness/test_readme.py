"""README.md is an operator's page: at most 12,000 characters, what holds today, no history.
Revision numbers and run dates belong to CHANGELOG.md and docs/results.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
LIMIT = 12_000

# what names a revision of this project's builds, or a date
HISTORY = {
    "a revision number": re.compile(r"\brevisions?\s+\d+", re.IGNORECASE),
    "a build's local version": re.compile(r"hybridfa\.\d+"),
    "a short revision": re.compile(r"\brev\.?\s*\d+", re.IGNORECASE),
    "an ISO date": re.compile(r"\b(19|20)\d\d-\d\d-\d\d\b"),
    "a date with a month name": re.compile(
        r"\b\d{1,2}\s+(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.?,?\s+(19|20)\d\d\b"
        r"|\b(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.?\s+\d{1,2},?\s+(19|20)\d\d\b",
        re.IGNORECASE,
    ),
}


def history_in(text: str) -> list[str]:
    """What in ``text`` is history: each finding as 'kind: match'."""
    return [f"{kind}: {m.group(0)!r}" for kind, rx in HISTORY.items() for m in rx.finditer(text)]


def test_readme_is_at_most_12000_characters() -> None:
    size = len(README.read_text(encoding="utf-8"))
    assert size <= LIMIT, f"README.md has {size} characters, more than {LIMIT}"


def test_readme_names_no_revision_and_no_date() -> None:
    assert history_in(README.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize(
    "text",
    [
        "measured at revision 12 on an H200",
        "lmcache 0.5.3+hybridfa.20 for cp312",
        "rev 8 of the 0.5.6 base",
        "one H100, 2026-12-05",
        "run on 5 December 2026",
        "run on Dec 5, 2026",
    ],
)
def test_history_is_found(text: str) -> None:
    assert history_in(text)


@pytest.mark.parametrize(
    "text",
    [
        "python -m hybridfa_build install --base 0.5.6 --kernels",
        "its version `0.5.3+hybridfa.N` satisfies a pin",
        "vLLM 0.26.0, torch 2.11.0+cu130, N = 1600 over 64-slot pages, 6,400 tokens",
        "`dist/lmcache-<version>+hybridfa.<n>-<tag>.whl`",
    ],
)
def test_versions_and_figures_are_not_history(text: str) -> None:
    assert history_in(text) == []


def test_the_readme_names_the_command_of_each_vllm() -> None:
    text = README.read_text(encoding="utf-8")
    for row in (
        "| 0.26 | 2.11 | `python -m hybridfa_build install` |",
        "| 0.27, 0.28 | 2.13 | `python -m hybridfa_build install --kernels` |",
        "| 0.29-0.32 | 2.13 | `python -m hybridfa_build install --base 0.5.6` |",
        "| 0.33, 0.34 | 2.14 | `python -m hybridfa_build install --base 0.5.6 --kernels` |",
    ):
        assert row in text
    assert "./tests/run" in text and "python -m lmcache._hybridfa block-size" in text
