#!/usr/bin/env python3
"""Run LMCache's own test suite (0.5.3 or 0.5.6) against an installed build; compare with pristine.

The sdist's tests/, pytest.ini and benchmarks/ (not its lmcache/) are extracted into WORKDIR and
pytest runs there with PYTHONPATH=<--lmcache DIR>. Failures are rerun on the same build; what
never passes is run against --pristine. A REGRESSION is judged by failure rate: a test that
failed every time on the build under test and passed at least once on pristine, that failed and
then passed (flaky), or that skipped on the build under test while passing on pristine (CPU
mode), is run --rate-rounds more times on both builds, round by round; it is a regression when
its not-passed rate on the build under test is at least RATE_GAP_PCT points above pristine's (10
rounds: 4/10 against 0/10, 5/10 against 1/10, ...) over those rounds and as many again, which
a test that the first rounds call a regression gets. A test leaves the rounds once the rest
cannot change its verdict (0/7 against 0/7 cannot reach 4/10 against 0/10). Skipped or missing
counts as not passed, on either build. (A free-port race in 0.5.3's bench CLI tests once failed
five runs in a row on one build and passed the one pristine run; alone it fails on either build
now and then.) A flake not listed in known_failures.txt that never failed on pristine and
failed twice or more on the build under test is a regression too. A test that fails every time
on both builds is a regression when none of its failures on the build under test has the
signature (type and first line, run details masked) of one on pristine.

A test listed in changed_by_series.txt pins behaviour a patch deliberately changes: it must be a
regression by the rules above (fail, or skip, on the build where pristine passes; failing every
run here before any rate round is enough), fail as its
entry expects (a failure message, or an amended copy asserting the series' value that passes),
and is reported as changed instead.

Exit status: 0 no regression; 1 regression; 2 stale entry in known_failures.txt or
changed_by_series.txt;
3 the run itself could not be trusted (wrong lmcache imported, no JUnit report, ...).
Unlisted failures that also fail on pristine alike, and other flakes, are only warned about.
Stdlib only: it runs on the CPU CI box and on GPU nodes with a different Python.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

HERE = Path(__file__).resolve().parent
KNOWN_FAILURES = HERE / "known_failures.txt"
CHANGED_BY_SERIES = HERE / "changed_by_series.txt"
FOLDERS = (
    "tests/",
    "tests/benchmarks",
    "tests/cli",
    "tests/disagg",
    "tests/lmcache_frontend",
    "tests/sdk",
    "tests/tools",
    "tests/v1",
)
GPU_PATHS = (
    "tests/v1/test_kv_layer_groups_manager.py",
    "tests/v1/platform/test_gpu_cache_context.py",
    "tests/v1/test_gpu_connector.py",
    "tests/v1/gpu_connector",
)
BAD = ("failed", "error")
# Equal failure rates of p = 0.1..0.5 on both builds give 10 rounds a gap of 40 points or more
# in 0.5-6% of cases; 5 rounds and a gap of 2 (the first rule tried) did in 5-17%.
RATE_ROUNDS = 10
RATE_GAP_PCT = 40
MIN_RATE_ROUNDS = 5
TAG_VAR = "HYBRIDFA_UPSTREAM_RUN"
GUARD_MODULE = "_hybridfa_upstream_guard"
# pytest plugin written into WORKDIR: refuses to run unless `lmcache` resolves inside the
# expected build, and records which lmcache the test session really imported.
GUARD_SOURCE = """\
import importlib.util, json, os, sys
from pathlib import Path
import pytest

STATUS = {}

def _expected():
    return Path(os.environ["HYBRIDFA_EXPECT_LMCACHE"]).resolve()

def pytest_configure(config):
    spec = importlib.util.find_spec("lmcache")
    where = Path(spec.origin).resolve() if spec and spec.origin else None
    if where is None or _expected() not in where.parents:
        raise pytest.UsageError(f"lmcache resolves to {where}, not inside {_expected()}")

def pytest_sessionfinish(session, exitstatus):
    STATUS["exitstatus"] = int(exitstatus)

def pytest_unconfigure(config):
    mod = sys.modules.get("lmcache")
    out = os.environ.get("HYBRIDFA_RECORD_LMCACHE")
    if out:
        STATUS["lmcache"] = str(Path(mod.__file__).resolve()) if mod else ""
        Path(out).write_text(json.dumps(STATUS))
"""
EXIT_GRACE_S = 30  # some upstream tests leave non-daemon threads: pytest then never exits


class Abort(Exception):
    """The run cannot be trusted (exit 3)."""


@dataclass
class Run:
    """One pytest invocation: per-node-id outcome."""

    label: str
    rc: int
    outcomes: dict[str, str]
    seconds: float
    lmcache_file: str
    messages: dict[str, str] = field(default_factory=dict)  # id: its failure's first line
    build: str = ""  # the build folder run against


@dataclass
class Known:
    pattern: str
    reason: str
    regex: re.Pattern[str] = field(repr=False)
    expect: str = ""  # changed_by_series.txt: "fails: REGEX" or "amend: OLD => NEW"


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------- sdist extraction


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def extract_sdist(sdist: Path, work: Path, python: str) -> str:
    """Extract tests/, benchmarks/, pytest.ini (never lmcache/) into work; cached by sha256."""
    digest = sha256(sdist)
    stamp = work / ".sdist-sha256"
    work.mkdir(parents=True, exist_ok=True)
    for leftover in work.glob(f"tests/**/*{AMENDED_SUFFIX}.py"):
        leftover.unlink()  # a run stopped before it removed its amended copies
    (work / GUARD_MODULE).with_suffix(".py").write_text(GUARD_SOURCE)
    # Tests spawn `python3 -m lmcache...`: make python/python3 on PATH the --python interpreter.
    shims = work / ".bin"
    shims.mkdir(exist_ok=True)
    for name in ("python", "python3"):  # a script, not a symlink: venvs must stay venvs
        (shims / name).unlink(missing_ok=True)
        (shims / name).write_text(f'#!/bin/sh\nexec "{Path(python).absolute()}" "$@"\n')
        (shims / name).chmod(0o755)
    if stamp.is_file() and stamp.read_text().strip() == digest and (work / "tests").is_dir():
        log(f"[extract] reusing {work} (sdist sha256 {digest[:12]})")
        return digest
    for name in ("tests", "benchmarks", "pytest.ini", ".sdist-sha256"):
        target = work / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            parts = m.name.split("/", 1)
            if len(parts) != 2:
                continue
            rel = parts[1]
            if rel == "pytest.ini" or rel.startswith(("tests/", "benchmarks/")):
                m.name = rel
                members.append(m)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(work, members=members, filter="data")
        else:  # pragma: no cover - Python without PEP 706 backport
            tar.extractall(work, members=members)  # noqa: S202
    stamp.write_text(digest + "\n")
    log(f"[extract] {sdist} -> {work} ({len(members)} entries)")
    return digest


def fingerprint(build: Path) -> str:
    """Content hash of build/lmcache (a build replaced mid-run makes the run worthless)."""
    h = hashlib.sha256()
    for f in sorted((build / "lmcache").rglob("*")):
        if f.is_file() and "__pycache__" not in f.parts:
            h.update(str(f.relative_to(build)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def module_name(rel: Path) -> str:
    parts = rel.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def changed_modules(build: Path, pristine: Path) -> set[str]:
    """Dotted names of the lmcache modules that ``build`` adds or changes against ``pristine``."""
    out = set()
    for f in (build / "lmcache").rglob("*.py"):
        rel = f.relative_to(build)
        old = pristine / rel
        if not old.is_file() or old.read_bytes() != f.read_bytes():
            out.add(module_name(rel))
    return out


IMPORT = re.compile(
    r"^\s*(?:from\s+(lmcache[\w.]*)\s+import\s+\(?([\w\s,]*)|import\s+(lmcache[\w.]*))", re.M
)


def imported_modules(source: str) -> set[str]:
    """Every lmcache module a test file names in an import, and ``module.name`` for each name
    it imports from one (that name may be a submodule)."""
    out = set()
    for frm, names, plain in IMPORT.findall(source):
        if plain:
            out.add(plain)
            continue
        out.add(frm)
        out.update(f"{frm}.{n}" for n in re.split(r"[\s,]+", names) if n)
    return out


def touched_tests(work: Path, modules: set[str]) -> list[str]:
    """The suite's test files that import one of ``modules`` or something inside one."""
    hits = []
    for f in sorted((work / "tests").rglob("test_*.py")):
        names = imported_modules(f.read_text(errors="replace"))
        if any(n == m or n.startswith(m + ".") for n in names for m in modules):
            hits.append(str(f.relative_to(work)))
    return hits


# ---------------------------------------------------------------- process hygiene


def live_pids() -> set[int]:
    return {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()}


def tagged_pids(tag: str, sid: int, before: set[int]) -> list[int]:
    """New processes (not alive before the run) carrying our env tag or in our session."""
    found = []
    needle = f"{TAG_VAR}={tag}".encode()
    for pid in live_pids() - before:
        if pid == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_bytes()
            psid = os.getsid(pid)
        except (OSError, ProcessLookupError):
            continue
        if stat.rsplit(b")", 1)[-1].split()[0] == b"Z":
            continue
        if needle in environ.split(b"\0") or psid == sid:
            found.append(pid)
    return found


def describe(pid: int) -> str:
    try:
        cmd = (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return f"{pid} (gone)"
    return f"{pid} {cmd[:120]}"


def kill_leftovers(tag: str, sid: int, before: set[int]) -> list[str]:
    """Kill what a pytest run left behind: its session and anything carrying its env tag."""
    killed: list[str] = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = tagged_pids(tag, sid, before)
        if not pids:
            break
        if sig == signal.SIGTERM:
            killed = [describe(p) for p in pids]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and tagged_pids(tag, sid, before):
            time.sleep(0.2)
    return killed


# ---------------------------------------------------------------- pytest runs and JUnit


def node_id(work: Path, classname: str, name: str) -> str:
    """JUnit classname/name -> pytest node id (tests/a/b.py::Class::test[param])."""
    dotted = classname if classname else name
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        rel = "/".join(parts[:i]) + ".py"
        if (work / rel).is_file():
            rest = parts[i:]
            if not classname:  # collection error / module-level skip: the file itself
                return rel
            return "::".join([rel, *rest, name])
    return f"{dotted}::{name}" if classname else dotted


def first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else ""


def signature(message: str) -> str:
    """The failure type and first line of a JUnit failure message (pytest writes
    ``KeyError: 'x'``, ``Failed: ...``, ``AssertionError: assert a == b``), with what
    differs from run to run masked: addresses, numbers of four digits or more (ports,
    pids), temporary paths."""
    first = first_line(message)
    first = re.sub(r"0x[0-9a-fA-F]+", "0x?", first)
    first = re.sub(r"(/tmp|/var/tmp|/private/var)/\S*", "/tmp/?", first)
    return re.sub(r"\d{4,}", "N", first)


def parse_junit_cases(xml_path: Path, work: Path) -> tuple[dict[str, str], dict[str, str]]:
    """-> per node id: outcome, and the first line of its failure, error or skip."""
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    tag_of = {"error": "error", "failed": "failure", "skipped": "skipped"}
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        if "error" in tags:
            outcome = "error"
        elif "failure" in tags:
            outcome = "failed"
        elif "skipped" in tags:
            outcome = "skipped"
        else:
            outcome = "passed"
        nid = node_id(work, case.get("classname", ""), case.get("name", ""))
        if rank[outcome] >= rank.get(outcomes.get(nid, "passed"), 0):
            outcomes[nid] = outcome
            child = case.find(tag_of[outcome]) if outcome in tag_of else None
            if child is not None:
                messages[nid] = first_line(child.get("message") or child.text or "")
    return outcomes, messages


def parse_junit(xml_path: Path, work: Path) -> dict[str, str]:
    return parse_junit_cases(xml_path, work)[0]


def outcome_for(nid: str, outcomes: dict[str, str]) -> str:
    """Outcome of nid in a run. A bare file id stands for a collection error: if this run
    collected tests from that file instead, collection passed."""
    if nid in outcomes:
        return outcomes[nid]
    if "::" not in nid and any(n.startswith(nid + "::") for n in outcomes):
        return "passed"
    return "missing"


def build_env(build: Path, work: Path, tag: str, record: Path) -> dict[str, str]:
    env = dict(os.environ)
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(build) + (os.pathsep + old if old else "")
    env["PATH"] = os.pathsep.join([str(work / ".bin"), str(build / "bin"), env.get("PATH", "")])
    env[TAG_VAR] = tag
    env["HYBRIDFA_EXPECT_LMCACHE"] = str(build)
    env["HYBRIDFA_RECORD_LMCACHE"] = str(record)
    env.pop("PYTEST_ADDOPTS", None)
    return env


def preflight(python: str, build: Path, work: Path) -> str:
    """`import lmcache` from WORKDIR (cwd on sys.path, as `python -m pytest` does) -> build."""
    if (work / "lmcache").exists():
        raise Abort(f"[preflight] {work}/lmcache exists and would shadow the build")
    env = build_env(build, work, "preflight", work / ".preflight")
    code = "import lmcache, pathlib; print(pathlib.Path(lmcache.__file__).resolve())"
    proc = subprocess.run(
        [python, "-c", code], cwd=work, env=env, capture_output=True, text=True, check=False
    )
    where = proc.stdout.strip()
    if proc.returncode != 0 or build.resolve() not in Path(where or "/").parents:
        raise Abort(
            f"[preflight] import lmcache -> {where or proc.stderr.strip()[-400:]!r}, "
            f"expected inside {build}"
        )
    log(f"[preflight] {python}: lmcache -> {where}")
    return where


def read_record(record: Path) -> dict[str, object]:
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def killpg(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def wait_pytest(proc: subprocess.Popen[bytes], record: Path, label: str, wall: int) -> int:
    """Wait for pytest. Once it has finished its session (the guard wrote the record) it gets
    EXIT_GRACE_S to exit; a process hanging on threads the tests left is then killed and its
    recorded exit status used."""
    deadline = time.monotonic() + wall
    finished_at: float | None = None
    while (rc := proc.poll()) is None:
        now = time.monotonic()
        if finished_at is None and record.is_file():
            finished_at = now
        if finished_at is not None and now - finished_at > EXIT_GRACE_S:
            log(f"[{label}] pytest finished but does not exit (threads left by tests): killing")
            killpg(proc)
            status = read_record(record).get("exitstatus")
            return status if isinstance(status, int) else 1
        if now > deadline:
            log(f"[{label}] wall timeout {wall}s: killing the run")
            killpg(proc)
            return -9
        time.sleep(1)
    return rc


def run_pytest(
    python: str, build: Path, work: Path, label: str, targets: list[str], wall_timeout: int
) -> Run:
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    xml = logs / f"{label}.xml"
    record = logs / f"{label}.record.json"
    for stale in (xml, record):
        stale.unlink(missing_ok=True)
    tag = uuid.uuid4().hex
    cmd = [
        # pytest-html's report hook once raised an INTERNALERROR (CPython's "AST constructor
        # recursion depth mismatch") formatting a Bigtable emulator's setup error, ending the
        # whole run; no report of it is used.
        python, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:html", "-p", GUARD_MODULE,
        "-o", "log_cli=false", "--timeout=120", "--continue-on-collection-errors",
        "-q", f"--junitxml={xml}", *targets,
    ]  # fmt: skip
    before = live_pids()
    start = time.monotonic()
    log(f"[{label}] {len(targets)} target(s) against {build}; log {logs / (label + '.log')}")
    with (logs / f"{label}.log").open("w") as out:
        proc = subprocess.Popen(
            cmd, cwd=work, env=build_env(build, work, tag, record),
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        rc = wait_pytest(proc, record, label, wall_timeout)
    seconds = time.monotonic() - start
    for line in kill_leftovers(tag, proc.pid, before):
        log(f"[{label}] killed leftover {line}")
    try:
        outcomes, messages = parse_junit_cases(xml, work) if xml.is_file() else ({}, {})
    except ET.ParseError as exc:
        log(f"[{label}] unreadable JUnit report: {exc}")
        outcomes, messages = {}, {}
    lmcache_file = str(read_record(record).get("lmcache", ""))
    counts = {
        k: sum(1 for v in outcomes.values() if v == k)
        for k in ("passed", "failed", "error", "skipped")
    }
    log(f"[{label}] rc={rc} {seconds:.0f}s {counts} lmcache={lmcache_file or '?'}")
    return Run(label, rc, outcomes, seconds, lmcache_file, messages, str(build))


def check_run(run: Run, build: Path) -> None:
    """A run we cannot trust is an infrastructure error (exit 3), never a pass."""
    if run.rc in (2, 3, 4) or not run.outcomes:
        raise Abort(f"[{run.label}] pytest rc={run.rc}, {len(run.outcomes)} results: see log")
    if run.lmcache_file and build.resolve() not in Path(run.lmcache_file).parents:
        raise Abort(f"[{run.label}] imported lmcache from {run.lmcache_file}, not {build}")


def rerun(
    python: str, build: Path, work: Path, label: str, ids: list[str], times: int, wall: int
) -> tuple[dict[str, list[str]], list[Run]]:
    """Rerun ids up to `times` times, dropping each id once it passes (a skip is no pass).
    -> id: outcomes."""
    history: dict[str, list[str]] = {i: [] for i in ids}
    runs: list[Run] = []
    pending = list(ids)
    for attempt in range(1, times + 1):
        if not pending:
            break
        run = run_pytest(python, build, work, f"{label}-{attempt}", pending, wall)
        if run.rc == 4 and len(pending) > 1:  # a node id pytest cannot resolve: go one by one
            merged: dict[str, str] = {}
            merged_messages: dict[str, str] = {}
            for n, nid in enumerate(pending):
                one = run_pytest(python, build, work, f"{label}-{attempt}.{n}", [nid], wall)
                merged.update(one.outcomes)
                merged_messages.update(one.messages)
                runs.append(one)
            if not merged:
                raise Abort(f"[{label}] no rerun produced any result: see logs")
            run = Run(
                run.label, 1, merged, run.seconds, run.lmcache_file, merged_messages, run.build
            )
        elif run.rc != 4:
            check_run(run, build)
        runs.append(run)
        still = []
        for nid in pending:
            got = outcome_for(nid, run.outcomes)
            history[nid].append(got)
            if got != "passed":
                still.append(nid)
        pending = still
    return history, runs


# ---------------------------------------------------------------- known failures, report


def load_known(path: Path) -> list[Known]:
    known = []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pattern, sep, reason = (s.strip() for s in line.partition("|"))
        if not sep or not pattern or not reason or "|" in reason:
            raise Abort(f"{path}:{n}: want '<test id pattern> | <one reason>'")
        if pattern.strip("*:/. ") in ("", "tests"):
            raise Abort(f"{path}:{n}: blanket pattern {pattern!r} not allowed")
        regex = re.compile(".*".join(re.escape(p) for p in pattern.split("*")) + r"\Z")
        known.append(Known(pattern, reason, regex))
    return known


AMENDED_SUFFIX = "_amended_by_series"


def load_changed(path: Path) -> list[Known]:
    """changed_by_series.txt: ``<pattern> | <expectation> | <why>``, the expectation
    ``fails: REGEX`` (the test's failure, or skip, on the build under test: its signature
    matches REGEX) or ``amend: OLD => NEW`` (a copy of the test's file with every OLD made
    NEW passes on the build under test and fails on pristine)."""
    changed = []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = [f.strip() for f in line.split(" | ")]
        if len(fields) != 3 or not all(fields):
            raise Abort(f"{path}:{n}: want '<test id pattern> | <expectation> | <why>'")
        pattern, expect, reason = fields
        kind, sep, spec = expect.partition(":")
        if kind == "amend":
            old, arrow, new = spec.partition("=>")
            valid = bool(arrow and old.strip() and new.strip() and "*" not in pattern)
        else:
            valid = kind == "fails" and bool(sep and spec.strip())
            if valid:
                try:
                    re.compile(spec.strip())
                except re.error:
                    valid = False
        if not valid:
            raise Abort(f"{path}:{n}: want 'fails: REGEX' or 'amend: OLD => NEW', not {expect!r}")
        if pattern.strip("*:/. ") in ("", "tests"):
            raise Abort(f"{path}:{n}: blanket pattern {pattern!r} not allowed")
        regex = re.compile(".*".join(re.escape(p) for p in pattern.split("*")) + r"\Z")
        changed.append(Known(pattern, reason, regex, expect))
    return changed


def match_known(nid: str, known: list[Known]) -> Known | None:
    return next((k for k in known if k.regex.match(nid)), None)


def in_scope(pattern: str, selected: list[str]) -> bool:
    """Whether the pattern's file was run whole (selected node ids are not checked)."""
    path = pattern.split("::", 1)[0]
    dirs = [s.rstrip("/") for s in selected if "::" not in s]
    return any(path == d or path.startswith(d + "/") for d in dirs)


def folder_of(nid: str) -> str:
    parts = nid.split("::", 1)[0].split("/")
    return "tests/" if len(parts) <= 2 else "/".join(parts[:2])


def tally(outcomes: dict[str, str]) -> dict[str, dict[str, int]]:
    table = {f: {"passed": 0, "failed": 0, "error": 0, "skipped": 0} for f in FOLDERS}
    for nid, outcome in outcomes.items():
        row = table.setdefault(folder_of(nid), {"passed": 0, "failed": 0, "error": 0, "skipped": 0})
        row[outcome if outcome in row else "error"] += 1
    table["total"] = {
        k: sum(r[k] for r in table.values()) for k in ("passed", "failed", "error", "skipped")
    }
    return table


def markdown(columns: dict[str, dict[str, dict[str, int]]]) -> str:
    names = list(columns)
    head = "| folder | " + " | ".join(f"{n} pass/fail/err/skip" for n in names) + " |"
    lines = [head, "|---" * (len(names) + 1) + "|"]
    folders = [f for f in next(iter(columns.values())) if f != "total"] + ["total"]
    for f in folders:
        cells = []
        for n in names:
            r = columns[n].get(f, {"passed": 0, "failed": 0, "error": 0, "skipped": 0})
            cells.append(f"{r['passed']}/{r['failed']}/{r['error']}/{r['skipped']}")
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def final_outcome(first: str, history: list[str]) -> str:
    """passed if it ever passed, else the first failing outcome."""
    if first not in BAD:
        return first
    return "passed" if "passed" in history else first


def not_passed(outcomes: list[str]) -> int:
    return sum(1 for o in outcomes if o != "passed")


def not_passed_rate(outcomes: list[str]) -> Fraction:
    return Fraction(not_passed(outcomes), len(outcomes)) if outcomes else Fraction(0)


def gap_reached(ours: list[str], base: list[str]) -> bool:
    """The rule of a regression: our not-passed rate at least RATE_GAP_PCT points above base's."""
    return not_passed_rate(ours) - not_passed_rate(base) >= Fraction(RATE_GAP_PCT, 100)


def compare_rates(
    ids: list[str], patched: dict[str, list[str]], pristine: dict[str, list[str]]
) -> tuple[list[str], list[dict[str, object]]]:
    """Rate rounds of both builds -> (regressions, one record per test). A regression's
    not-passed rate on patched is at least RATE_GAP_PCT points above pristine's."""
    regressions: list[str] = []
    records: list[dict[str, object]] = []
    for nid in ids:
        ours, base = patched.get(nid, []), pristine.get(nid, [])
        regression = gap_reached(ours, base)
        if regression:
            regressions.append(nid)
        records.append({
            "id": nid, "regression": regression,
            "patched": ours, "patched_not_passed": f"{not_passed(ours)}/{len(ours)}",
            "pristine": base, "pristine_not_passed": f"{not_passed(base)}/{len(base)}",
        })  # fmt: skip
    return regressions, records


# ---------------------------------------------------------------- modes


def compare_with_pristine(
    args: argparse.Namespace, persistent: list[str]
) -> tuple[dict[str, list[str]], dict[str, list[str]], list[Run]]:
    """Run persistent failures on pristine (up to 3 rounds). Each test that passes there is
    run again on the build under test straight away (up to 2 times), so both builds are
    compared under the same machine load: a shared CPU turns timing races into false alarms.
    """
    pristine: dict[str, list[str]] = {n: [] for n in persistent}
    confirm: dict[str, list[str]] = {}
    runs: list[Run] = []
    pending = list(persistent)
    for round_no in range(1, 4):
        if not pending:
            break
        hist, r = rerun(
            args.python, args.pristine, args.work, f"pristine-{round_no}", pending, 1,
            args.wall_timeout,
        )  # fmt: skip
        runs += r
        for nid, outcomes in hist.items():
            pristine[nid] += outcomes
        passed = [n for n in pending if "passed" in hist[n]]
        pending = [n for n in pending if n not in passed]
        if passed:
            chist, r = rerun(
                args.python, args.lmcache, args.work, f"confirm-{round_no}", passed, 2,
                args.wall_timeout,
            )  # fmt: skip
            runs += r
            confirm.update(chist)
    return pristine, confirm, runs


def undecided(ours: list[str], base: list[str], planned: int) -> bool:
    """Whether the rounds still to come (of ``planned``) can change gap_reached's verdict on a
    test: it differs between the best and the worst outcome of those rounds for our build."""
    left = planned - len(ours)
    worst = gap_reached(ours + ["failed"] * left, base + ["passed"] * left)
    best = gap_reached(ours + ["passed"] * left, base + ["failed"] * left)
    return worst != best


def measure_rates(
    args: argparse.Namespace,
    ids: list[str],
    planned: int = 0,
    prior: tuple[dict[str, list[str]], dict[str, list[str]]] | None = None,
) -> tuple[dict[str, list[str]], dict[str, list[str]], list[Run]]:
    """Run ids once per round on each build, alternating which goes first, until each has
    ``planned`` rounds (default args.rate_rounds; ``prior``: the rounds it has) or the rest
    cannot change its verdict: both builds see the same tests under the same machine load.
    -> patched, pristine (including ``prior``)."""
    planned = planned or args.rate_rounds
    patched, pristine = prior or ({}, {})
    for nid in ids:
        patched.setdefault(nid, [])
        pristine.setdefault(nid, [])
    arms = [("patched", args.lmcache, patched), ("pristine", args.pristine, pristine)]
    runs: list[Run] = []
    pending = [n for n in ids if undecided(patched[n], pristine[n], planned)]
    while pending:
        round_no = len(patched[pending[0]]) + 1
        for arm, build, history in arms if round_no % 2 else arms[::-1]:
            hist, r = rerun(
                args.python, build, args.work, f"rate-{arm}-{round_no}", pending, 1,
                args.wall_timeout,
            )  # fmt: skip
            runs += r
            for nid, outcomes in hist.items():
                history[nid] += outcomes
        pending = [n for n in pending if undecided(patched[n], pristine[n], planned)]
    return patched, pristine, runs


def judge_by_rate(
    args: argparse.Namespace, ids: list[str], changed: list[Known] | None = None
) -> tuple[list[str], list[dict[str, object]], list[Run]]:
    """measure_rates, then compare_rates. A test the rounds call a regression gets as many
    rounds again and is judged on all of them: with a dozen flaky tests in one run, a gap that
    equal rates reach by chance for one of them in 0.5-6% of runs would fail many runs. Tests
    of ``changed`` (changed by the series on purpose) are expected regressions: not again."""
    patched, pristine, runs = measure_rates(args, ids)
    regressions, records = compare_rates(ids, patched, pristine)
    again = [n for n in regressions if match_known(n, changed or []) is None]
    if again:
        _, _, more_runs = measure_rates(args, again, 2 * args.rate_rounds, (patched, pristine))
        runs += more_runs
        regressions, records = compare_rates(ids, patched, pristine)
    return regressions, records, runs


def classify(
    persistent: list[str],
    pristine_hist: dict[str, list[str]],
    confirm_hist: dict[str, list[str]],
) -> tuple[list[str], list[str], list[str]]:
    """Split tests that kept failing on patched into (regressions, fail on pristine too,
    flaky). A regression passed on pristine and failed again on patched right after."""
    regressions: list[str] = []
    pristine_fail: list[str] = []
    flaky: list[str] = []
    for nid in persistent:
        if "passed" not in pristine_hist[nid]:
            pristine_fail.append(nid)
        elif "passed" in confirm_hist.get(nid, []):
            flaky.append(nid)  # passed on patched too, when run right after pristine
        else:
            regressions.append(nid)
    return regressions, pristine_fail, flaky


def split_changed(
    regressions: list[str], changed: list[Known], scope: list[str]
) -> tuple[list[str], list[str], list[str]]:
    """Split regressions into (regressions, changed by the series); and the changed-list
    entries that are stale: their test passes on patched, or no collected test matches."""
    expected = [n for n in regressions if match_known(n, changed) is not None]
    stale = [
        k.pattern for k in changed
        if in_scope(k.pattern, scope)
        and not any(k.regex.match(n) for n in expected)
    ]  # fmt: skip
    return [n for n in regressions if n not in expected], expected, stale


def signatures_of(runs: list[Run], build: Path) -> dict[str, set[str]]:
    """Per test, the first lines of its failures (and skips) in the runs against build."""
    found: dict[str, set[str]] = {}
    where = build.resolve()
    for run in runs:
        ran = Path(run.build or run.lmcache_file or "/").resolve()
        if ran != where and where not in ran.parents:
            continue
        for nid, sig in run.messages.items():
            found.setdefault(nid, set()).add(sig)
    return found


def fail_for_another_reason(
    pristine_fail: list[str], patched: dict[str, set[str]], pristine: dict[str, set[str]]
) -> list[str]:
    """Tests failing on both builds whose failures share no signature (type and first
    line): the build under test fails them for another reason. A test whose failures left
    no message on either build cannot be told apart, and is not among them."""
    ours = {n: {signature(m) for m in patched.get(n, set())} for n in pristine_fail}
    base = {n: {signature(m) for m in pristine.get(n, set())} for n in pristine_fail}
    return [n for n in pristine_fail if ours[n] and base[n] and not ours[n] & base[n]]


def new_flakes(
    flaky: list[str],
    known: list[Known],
    patched: dict[str, list[str]],
    pristine: dict[str, list[str]],
) -> list[str]:
    """Flakes not listed in known_failures.txt that never failed on pristine and failed
    twice or more on the build under test, over every run of both: an intermittent failure
    the series brought, whatever its rate."""
    return [
        n for n in flaky
        if match_known(n, known) is None
        and pristine.get(n) and not_passed(pristine[n]) == 0
        and not_passed(patched.get(n, [])) >= 2
    ]  # fmt: skip


def round_outcomes(record: dict[str, object], build: str) -> list[str]:
    """A rate-round record's outcomes on ``build`` (patched or pristine)."""
    got = record.get(build, [])
    return [str(o) for o in got] if isinstance(got, list) else []


def amended_copy(work: Path, nid: str, old: str, new: str) -> str | None:
    """Write a copy of nid's file beside it with every ``old`` made ``new``: the copy's
    node id, or None when the file does not hold ``old``."""
    rel, sep, rest = nid.partition("::")
    source = work / rel
    if not sep or not source.is_file() or old not in source.read_text():
        return None
    target = source.with_name(source.stem + AMENDED_SUFFIX + source.suffix)
    target.write_text(source.read_text().replace(old, new))
    return f"{target.relative_to(work).as_posix()}::{rest}"


def check_changed(
    args: argparse.Namespace,
    tests: list[str],
    changed: list[Known],
    patched_sigs: dict[str, set[str]],
) -> tuple[list[str], list[str], dict[str, str], list[Run]]:
    """Each test changed by the series fails as its entry expects: (tests that fail
    otherwise, stale entries, one note per test, runs of the amended copies)."""
    wrong: list[str] = []
    stale: list[str] = []
    notes: dict[str, str] = {}
    runs: list[Run] = []
    for nid in tests:
        entry = match_known(nid, changed)
        assert entry is not None
        kind, _, spec = entry.expect.partition(":")
        if kind == "fails":
            sigs = sorted(patched_sigs.get(nid, set()))
            if any(re.search(spec.strip(), sig) for sig in sigs):
                notes[nid] = f"fails as expected: {sigs[0]}"
            else:
                wrong.append(nid)
                notes[nid] = f"fails with {sigs or 'no message'}, not matching {spec.strip()!r}"
            continue
        old, _, new = (x.strip() for x in spec.partition("=>"))
        copy = amended_copy(args.work, nid, old, new)
        if copy is None:
            stale.append(entry.pattern)
            notes[nid] = f"its file holds no {old!r} to amend"
            continue
        try:
            ours, r1 = rerun(
                args.python, args.lmcache, args.work, "amended-patched", [copy], 3,
                args.wall_timeout,
            )  # fmt: skip
            base, r2 = rerun(
                args.python, args.pristine, args.work, "amended-pristine", [copy], 1,
                args.wall_timeout,
            )  # fmt: skip
        finally:
            (args.work / copy.split("::", 1)[0]).unlink(missing_ok=True)
        runs += r1 + r2
        if "passed" not in ours[copy]:
            wrong.append(nid)
            notes[nid] = f"the amended copy ({old} => {new}) fails too: {ours[copy]}"
        elif "passed" in base[copy]:
            stale.append(entry.pattern)
            notes[nid] = f"the amended copy ({old} => {new}) passes on pristine too"
        else:
            notes[nid] = f"the amended copy ({old} => {new}) passes, and fails on pristine"
    return wrong, stale, notes, runs


def cpu_mode(args: argparse.Namespace, targets: list[str], summary: dict[str, object]) -> int:
    known = load_known(args.known_failures)
    changed = load_changed(args.changed_by_series)
    first = run_pytest(args.python, args.lmcache, args.work, "patched", targets, args.wall_timeout)
    check_run(first, args.lmcache)
    failing = sorted(n for n, o in first.outcomes.items() if o in BAD)
    patched_hist, patched_runs = rerun(
        args.python, args.lmcache, args.work, "patched-rerun", failing, 2, args.wall_timeout
    )
    flaky = sorted(n for n, h in patched_hist.items() if "passed" in h)
    persistent = [n for n in failing if n not in flaky]
    pristine_hist, confirm_hist, pristine_runs = compare_with_pristine(args, persistent)
    for nid, hist in confirm_hist.items():
        patched_hist[nid].extend(hist)
    suspects, pristine_fail, confirmed_flaky = classify(persistent, pristine_hist, confirm_hist)
    patched_sigs = signatures_of([first, *patched_runs, *pristine_runs], args.lmcache)
    pristine_sigs = signatures_of(pristine_runs, args.pristine)
    differs = fail_for_another_reason(pristine_fail, patched_sigs, pristine_sigs)
    pristine_fail = [n for n in pristine_fail if n not in differs]
    skipped = sorted(n for n, o in first.outcomes.items() if o == "skipped")
    skip_hist, skip_runs = rerun(
        args.python, args.pristine, args.work, "pristine-skipped", skipped, 1, args.wall_timeout
    )
    skip_only = sorted(n for n in skipped if "passed" in skip_hist[n])
    # A test the series changes on purpose that failed every run here and passed on pristine
    # needs no rate rounds to be told apart from a flake: check_changed then requires its
    # expected failure (or its amended copy to pass).
    by_design = [n for n in suspects if match_known(n, changed) is not None]
    rate_ids = sorted(
        n for n in suspects + flaky + confirmed_flaky + skip_only if n not in by_design
    )
    by_rate, rates, rate_runs = judge_by_rate(args, rate_ids, changed)
    regressions = sorted(by_rate + by_design)
    flaky = sorted(n for n in suspects + flaky + confirmed_flaky if n not in regressions)
    rounds = {str(r["id"]): r for r in rates}
    every_patched = {
        n: [first.outcomes[n], *patched_hist.get(n, []), *round_outcomes(rounds[n], "patched")]
        for n in flaky
    }
    every_pristine = {
        n: [
            *pristine_hist.get(n, []),
            *skip_hist.get(n, []),
            *round_outcomes(rounds[n], "pristine"),
        ]
        for n in flaky
    }
    brought = new_flakes(flaky, known, every_patched, every_pristine)
    flaky = [n for n in flaky if n not in brought]
    unlisted = [n for n in pristine_fail if match_known(n, known) is None]
    flaky_unlisted = [n for n in flaky if match_known(n, known) is None]
    scope = targets if args.select or args.touched else ["tests"]
    stale = [
        k.pattern for k in known
        if in_scope(k.pattern, scope) and not any(k.regex.match(n) for n in first.outcomes)
    ]  # fmt: skip

    regressions, changed_tests, stale_changed = split_changed(regressions, changed, scope)
    wrong_changed, stale_amended, changed_notes, amended_runs = check_changed(
        args, changed_tests, changed, patched_sigs
    )
    changed_tests = [n for n in changed_tests if n not in wrong_changed]
    why: dict[str, str] = {}
    for n in differs:
        why[n] = (
            f"fails on pristine too, but for another reason: here {sorted(patched_sigs[n])},"
            f" on pristine {sorted(pristine_sigs[n])}"
        )
    for n in brought:
        why[n] = (
            f"a new intermittent failure, not in {args.known_failures.name}: not passed"
            f" {not_passed(every_patched[n])}/{len(every_patched[n])} runs here, never on"
            f" pristine ({len(every_pristine[n])} runs)"
        )
    for n in wrong_changed:
        why[n] = f"changed by the series, but {changed_notes[n]}"
    regressions = sorted({*regressions, *why})
    stale += stale_changed + stale_amended
    final = {n: final_outcome(o, patched_hist.get(n, [])) for n, o in first.outcomes.items()}
    pristine_final = {
        n: ("passed" if "passed" in h else first.outcomes[n]) for n, h in pristine_hist.items()
    }
    columns = {
        "patched (1st run)": tally(first.outcomes),
        "patched (after reruns)": tally(final),
        "pristine (rerun of persistent failures)": tally(pristine_final),
    }

    rate_of = {str(r["id"]): r for r in rates}

    def explain(nid: str) -> dict[str, object]:
        k = match_known(nid, known)
        return {
            "id": nid,
            "patched": [first.outcomes[nid], *patched_hist.get(nid, [])],
            "pristine": pristine_hist.get(nid, skip_hist.get(nid, [])),
            "rate_rounds": rate_of.get(nid),
            "known_reason": k.reason if k else None,
            "signatures": {
                "patched": sorted(patched_sigs.get(nid, set())),
                "pristine": sorted(pristine_sigs.get(nid, set())),
            },
            "why": why.get(nid) or changed_notes.get(nid),
        }

    summary.update(
        mode="cpu",
        lmcache_imported=first.lmcache_file,
        seconds={
            r.label: round(r.seconds, 1)
            for r in [first, *patched_runs, *pristine_runs, *skip_runs, *rate_runs, *amended_runs]
        },
        counts=columns,
        regressions=[explain(n) for n in regressions],
        changed_by_series=[explain(n) for n in changed_tests],
        fails_on_pristine_too=[explain(n) for n in pristine_fail],
        unlisted_pristine_failures=unlisted,
        flaky_on_patched=[explain(n) for n in flaky],
        flaky_unlisted=flaky_unlisted,
        fails_for_another_reason=differs,
        new_intermittent_failures=brought,
        skipped_on_patched_passed_on_pristine=skip_only,
        rate_rounds=rates,
        stale_known_failures=stale,
    )
    log("\n" + markdown(columns) + "\n")
    for n in pristine_fail:
        k = match_known(n, known)
        log(f"fails on pristine too: {n}  [{k.reason if k else 'NOT LISTED'}]")
    for n in flaky:
        k = match_known(n, known)
        r = rate_of[n]
        log(
            f"flaky on patched (not passed {r['patched_not_passed']} rate rounds, pristine"
            f" {r['pristine_not_passed']}): {n}  [{k.reason if k else 'NOT LISTED'}]"
        )
    for n in unlisted:
        log(
            f"WARNING: {n} fails on patched AND pristine but is not in {args.known_failures.name}:"
            " add it with a reason"
        )
    for n in changed_tests:
        reason = match_known(n, changed).reason  # type: ignore[union-attr]
        log(
            f"changed by the series (fails on patched by design): {n}"
            f"  [{reason}; {changed_notes[n]}]"
        )
    for p in stale:
        log(
            "ERROR: stale entry (no collected test, the test no longer fails, or its amendment"
            f" finds nothing to amend or passes on pristine too): {p}"
        )
    for n in regressions:
        if n in why:
            log(f"REGRESSION: {n} {why[n]}")
        elif n in rate_of:
            r = rate_of[n]
            log(
                f"REGRESSION: {n} did not pass {r['patched_not_passed']} rate rounds on the build"
                f" under test, {r['pristine_not_passed']} on pristine"
            )
        else:
            log(f"REGRESSION: {n} fails on the build under test every time, passes on pristine")
    if regressions:
        return 1
    return 2 if stale else 0


def gpu_mode(args: argparse.Namespace, targets: list[str], summary: dict[str, object]) -> int:
    builds = {"patched": args.lmcache, "pristine": args.pristine}
    finals: dict[str, dict[str, str]] = {}
    firsts: dict[str, dict[str, str]] = {}
    columns: dict[str, dict[str, dict[str, int]]] = {}
    seconds: dict[str, float] = {}
    sigs: dict[str, dict[str, set[str]]] = {}
    for label, build in builds.items():
        preflight(args.python, build, args.work)
        first = run_pytest(
            args.python, build, args.work, f"gpu-{label}", targets, args.wall_timeout
        )
        check_run(first, build)
        failing = sorted(n for n, o in first.outcomes.items() if o in BAD)
        hist, runs = rerun(
            args.python, build, args.work, f"gpu-{label}-rerun", failing, 1, args.wall_timeout
        )
        finals[label] = {n: final_outcome(o, hist.get(n, [])) for n, o in first.outcomes.items()}
        firsts[label] = first.outcomes
        columns[f"{label} (1st run)"] = tally(first.outcomes)
        columns[f"{label} (after rerun)"] = tally(finals[label])
        seconds.update({r.label: round(r.seconds, 1) for r in [first, *runs]})
        sigs[label] = signatures_of([first, *runs], build)
    patched, pristine = finals["patched"], finals["pristine"]
    on_pristine = {n: outcome_for(n, pristine) for n in patched}
    regressions = sorted(n for n, o in patched.items() if o in BAD and on_pristine[n] == "passed")
    flaky = sorted(n for n, o in firsts["patched"].items() if o in BAD and patched[n] == "passed")
    by_rate, rates, rate_runs = judge_by_rate(args, flaky)
    seconds.update({r.label: round(r.seconds, 1) for r in rate_runs})
    regressions = sorted(regressions + by_rate)
    both = sorted(n for n, o in patched.items() if o in BAD and on_pristine[n] in BAD)
    differs = fail_for_another_reason(both, sigs["patched"], sigs["pristine"])
    both = [n for n in both if n not in differs]
    regressions = sorted(regressions + differs)
    only_skipped = sorted(
        n for n, o in patched.items() if o == "skipped" and on_pristine[n] == "passed"
    )
    summary.update(
        mode="gpu", seconds=seconds, counts=columns, regressions=regressions,
        fails_on_pristine_too=both, fails_for_another_reason=differs,
        skipped_on_patched_passed_on_pristine=only_skipped,
        rate_rounds=rates,
    )  # fmt: skip
    log("\n" + markdown(columns) + "\n")
    for n in both:
        log(f"fails on pristine too: {n}")
    for n in only_skipped:
        log(f"WARNING: skipped on patched but passes on pristine: {n}")
    for r in rates:
        log(
            f"{'REGRESSION' if r['regression'] else 'flaky on patched'}: {r['id']} not passed"
            f" {r['patched_not_passed']} rate rounds, pristine {r['pristine_not_passed']}"
        )
    for n in regressions:
        if n in differs:
            log(
                f"REGRESSION: {n} fails on pristine too, but for another reason: here"
                f" {sorted(sigs['patched'][n])}, on pristine {sorted(sigs['pristine'][n])}"
            )
        elif n not in by_rate:
            log(f"REGRESSION: {n} fails on the build under test, passes on pristine")
    return 1 if regressions else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", required=True, help="interpreter with lmcache's deps + pytest")
    ap.add_argument("--sdist", required=True, type=Path, help="lmcache-0.5.3.tar.gz or 0.5.6's")
    ap.add_argument("--lmcache", required=True, type=Path, help="dir holding the build under test")
    ap.add_argument("--pristine", required=True, type=Path, help="dir holding the pristine base")
    ap.add_argument("--work", required=True, type=Path, help="scratch dir for the sdist's tests")
    ap.add_argument("--out", type=Path, default=Path("results/upstream-cpu.json"))
    ap.add_argument("--gpu", action="store_true", help="run the CUDA-only files on both builds")
    ap.add_argument("--select", nargs="+", metavar="PATH", help="test paths/ids to run instead")
    ap.add_argument(
        "--touched", action="store_true",
        help="run only the test files that import a module the build adds or changes",
    )  # fmt: skip
    ap.add_argument("--known-failures", type=Path, default=KNOWN_FAILURES)
    ap.add_argument("--changed-by-series", type=Path, default=CHANGED_BY_SERIES)
    ap.add_argument("--wall-timeout", type=int, default=3600, help="seconds per pytest run")
    ap.add_argument(
        "--rate-rounds", type=int, default=RATE_ROUNDS,
        help=f"runs per build of each flaky test (>= {MIN_RATE_ROUNDS}; default {RATE_ROUNDS})",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.rate_rounds < MIN_RATE_ROUNDS:
        ap.error(f"--rate-rounds must be at least {MIN_RATE_ROUNDS}")
    args.python = shutil.which(args.python) or args.python
    args.lmcache, args.pristine, args.work = (
        p.resolve() for p in (args.lmcache, args.pristine, args.work)
    )
    try:
        return execute(args)
    except Abort as exc:
        log(f"ABORT: {exc}")
        return 3


def execute(args: argparse.Namespace) -> int:
    for p in (args.lmcache, args.pristine):
        if not (p / "lmcache" / "__init__.py").is_file():
            raise Abort(f"{p} holds no lmcache/ package")
    started = time.monotonic()
    digest = extract_sdist(args.sdist, args.work, args.python)
    targets = list(args.select or (GPU_PATHS if args.gpu else ("tests",)))
    selection = "every test file" if targets == ["tests"] else "the files and ids given"
    if args.touched:
        modules = changed_modules(args.lmcache, args.pristine)
        targets = touched_tests(args.work, modules)
        every = len(list((args.work / "tests").rglob("test_*.py")))
        selection = (
            f"the {len(targets)} of {every} test files that import one of the {len(modules)} "
            "modules the build adds or changes"
        )
        log(f"[select] {selection}")
        if not targets:
            raise Abort("no test file imports a module the build adds or changes")
    summary: dict[str, object] = {
        "sdist": str(args.sdist), "sdist_sha256": digest, "python": args.python,
        "lmcache": str(args.lmcache), "pristine": str(args.pristine), "targets": targets,
        "selection": selection,
    }  # fmt: skip
    prints = {str(b): fingerprint(b) for b in (args.lmcache, args.pristine)}
    summary["build_sha256"] = prints
    if args.gpu:
        rc = gpu_mode(args, targets, summary)
    else:
        preflight(args.python, args.lmcache, args.work)
        preflight(args.python, args.pristine, args.work)
        rc = cpu_mode(args, targets, summary)
    for build, digest_before in prints.items():
        if fingerprint(Path(build)) != digest_before:
            raise Abort(f"{build} changed during the run: results are meaningless, rerun")
    summary["elapsed_s"] = round(time.monotonic() - started, 1)
    summary["exit_status"] = rc
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    log(f"summary: {args.out} ({summary['elapsed_s']}s), exit {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
