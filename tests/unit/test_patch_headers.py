"""The series' headers are true DEP-3 and the series applies exactly.

Every patch in patches/series (the 0.5.3 base) and bases/0.5.6/patches/series is a ``git
format-patch`` file whose message is a DEP-3 header: a ``From:`` naming the project and an
address, a ``Date:`` (when the patch's content last changed), a Description ending with a
whole sentence, ``Origin: vendor``, a ``Bug:`` where an upstream issue is known, a Forwarded
value DEP-3 reads as intended (``no``, ``not-needed`` or the URL it was sent to), and a
Last-Update: the same fields in both series. A header may point back to an
earlier patch of its series, never forward, and names the tests that pin it, which must
exist. History and measurements live in the changelogs and docs/results.md, not in headers.
"""

from __future__ import annotations

import datetime
import email.utils
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCHES = ROOT / "patches"


def _series(folder: Path) -> list[str]:
    return [line.strip() for line in (folder / "series").read_text().splitlines() if line.strip()]


SERIES = _series(PATCHES)
# Both bases' patches, by their path from the checkout root.
ALL_SERIES = [f"patches/{n}" for n in SERIES]
ALL_SERIES += [f"bases/0.5.6/patches/{n}" for n in _series(ROOT / "bases/0.5.6/patches")]


def _header(name: str) -> str:
    """The mail header and message of a patch, up to its diffstat."""
    text = (ROOT / name).read_text()
    return text[: text.index("\n---\n")]


def _field(header: str, name: str) -> str | None:
    """A DEP-3 field's value, continuation lines joined."""
    m = re.search(rf"^{name}: (.*(?:\n [^\n]*)*)", header, re.M)
    return " ".join(m.group(1).split()) if m else None


@pytest.mark.parametrize("name", ALL_SERIES)
def test_header_names_the_project_and_real_dates(name: str) -> None:
    header = _header(name)
    author = _field(header, "From")
    assert author and "lmcache-hybridfa" in author and re.search(r"<[^@\s]+@[^>\s]+>", author)
    assert "localhost" not in author
    date = email.utils.parsedate_to_datetime(_field(header, "Date") or "")
    last_update = datetime.date.fromisoformat(_field(header, "Last-Update") or "")
    assert datetime.date(2026, 11, 1) <= date.date() <= last_update


@pytest.mark.parametrize("name", ALL_SERIES)
def test_header_has_a_description_and_a_true_forwarded_value(name: str) -> None:
    header = _header(name)
    assert len(_field(header, "Description") or "") > 80
    forwarded = _field(header, "Forwarded") or ""
    assert re.match(r"(no|not-needed)\b|https?://", forwarded), forwarded


FIELDS = ("From", "Date", "Subject", "Description", "Origin", "Forwarded", "Last-Update")


@pytest.mark.parametrize("name", ALL_SERIES)
def test_header_carries_the_dep3_fields_of_both_series(name: str) -> None:
    header = _header(name)
    missing = [f for f in FIELDS if _field(header, f) is None]
    assert not missing, missing
    assert _field(header, "Origin") == "vendor"
    bug = _field(header, "Bug")
    assert bug is None or re.fullmatch(r"https://github\.com/\S+/issues/\d+", bug), bug


@pytest.mark.parametrize("name", ALL_SERIES)
def test_header_description_ends_with_a_whole_sentence(name: str) -> None:
    description = _field(_header(name), "Description") or ""
    assert re.search(r"[.)!]$", description), description[-80:]


@pytest.mark.parametrize("name", ALL_SERIES)
def test_header_points_only_to_earlier_patches(name: str) -> None:
    number = int(Path(name).name[:4])
    message = " ".join(_header(name).split("\nDescription: ", 1)[1].split())
    named = {
        int(n)
        for m in re.finditer(r"[Pp]atch(?:es)?((?:,? (?:and )?0\d{3}\b)+)", message)
        for n in re.findall(r"0\d{3}", m.group(1))
    }
    assert all(1 <= n < number for n in named), sorted(named)


@pytest.mark.parametrize("name", ALL_SERIES)
def test_header_names_tests_that_exist(name: str) -> None:
    tests = _field(_header(name), "Description") or ""
    named = set(re.findall(r"\b(?:tests/unit/)?(test_\w+\.py)", tests))
    assert named, "the header names no test that pins the patch"
    assert all((ROOT / "tests" / "unit" / t).is_file() for t in named), sorted(named)


@pytest.mark.parametrize("name", ALL_SERIES)
def test_header_carries_no_history(name: str) -> None:
    header = _header(name)
    assert not re.search(r"\brevision \d+|\bmeasured\b|\bH200\b|GB/s", header, re.I)


def test_the_series_applies_without_offset_or_fuzz(pristine_wheel: Path, tmp_path: Path) -> None:
    from hybridfa_build import factory

    with zipfile.ZipFile(pristine_wheel) as zf:
        zf.extractall(tmp_path, [n for n in zf.namelist() if n.startswith("lmcache/")])
    factory.add_sources(tmp_path)
    for name in SERIES:
        proc = subprocess.run(
            ["git", "apply", "-v", str(PATCHES / name)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=False,
            env={"GIT_CEILING_DIRECTORIES": str(tmp_path.parent), "PATH": "/usr/bin:/bin"},
        )
        assert proc.returncode == 0, proc.stderr
        assert not re.search(r"offset|fuzz", proc.stderr), proc.stderr
