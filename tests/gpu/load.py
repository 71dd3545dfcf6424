"""Load with restarts (issue 8 item 5): many concurrent requests, engine and LMCache
server restarted on the same L2 folder, every restore checked by KV hash.

One run is a series of phases on one fs L2 folder. A phase is: LMCache server + a fresh
engine (``engine_proc.py`` role ``load``) that keeps ``--concurrency`` requests in flight,
drawn deterministically from a prompt pool (families of prompts sharing a long prefix of
whole chunks, with distinct suffixes, plus distinct prompts). Every ``--restart-every``
seconds the phase ends: the engine stops admitting, drains and waits for its stores to
land (``--kill drain``), or is SIGKILLed mid-load (``--kill hard``); the server is SIGKILLed
either way; the next phase starts a new server and engine on the same folder.

Per request the engine records its TTFT (RequestOutput.metrics), the prompt tokens served
by vLLM's own prefix cache and by LMCache (external), and, at its first token while its
blocks are still held, KV hashes (FA and GDN, per layer) of:

- the blocks LMCache restored (external hit), to verify;
- the complete-chunk blocks it computed itself, as the reference.

Verification: the reference maps a prefix block (chained hash of its tokens) to the KV
hashes computed for it, per layer; it is built in the first phase and grows with prefixes
first computed later. A restored block whose hash for a layer is not among the computed
ones is a mismatch. Lost objects: a ``.data`` file present after a phase's kill that is
missing or has another size after the next phase, or whose integrity trailer (magic +
blake3, patch 0006) does not verify at the end.

Usage on any CUDA box::

    python3 tests/gpu/load.py --arm patched --lmcache-dir /tmp/lmc-patched --out results/ \\
        --duration 600 --kv-cache-gib 8

Without a GPU, ``--plan`` prints the workload and the phase plan. Only the standard library
is imported at module level (blake3 lazily, for the trailer check); vLLM runs in
``engine_proc.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import gate  # noqa: E402  (stdlib only: the gate's model configs and process helpers)

SCHEMA = "hybridfa-gpu-load/1"
TRAILER_MAGIC = b"LMCHFA1\x00"  # fs_l2_adapter.py (patch 0006): magic + blake3 digest
TRAILER_LEN = len(TRAILER_MAGIC) + 32


# ---------------------------------------------------------------------------------------
# Workload (pure)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """Prompt pool: ``families`` x ``members`` prompts that share a prefix of
    ``prefix_chunks`` whole chunks (distinct suffixes of ``suffix_chunks`` chunks), and
    ``distinct`` prompts of ``distinct_chunks`` chunks sharing nothing. A request is a
    family member with probability ``shared_fraction``."""

    families: int = 8
    members: int = 8
    prefix_chunks: int = 4
    suffix_chunks: tuple[float, float] = (0.25, 2.5)
    distinct: int = 32
    distinct_chunks: tuple[float, float] = (1.5, 6.5)
    shared_fraction: float = 0.75
    seed: int = 0


@dataclass(frozen=True)
class PoolEntry:
    kind: str  # "shared" | "distinct"
    family: int  # -1 for distinct prompts
    tokens: tuple[int, ...]


def _length(rng: random.Random, span: tuple[float, float], chunk: int) -> int:
    lo = max(1, round(span[0] * chunk))
    return rng.randint(lo, max(lo, round(span[1] * chunk)))


def _token(rng: random.Random, taken: set[int] | None = None) -> int:
    while True:
        t = rng.randrange(gate.TOKEN_LO, gate.TOKEN_HI)
        if taken is None or t not in taken:
            return t


def make_pool(w: Workload, chunk: int) -> list[PoolEntry]:
    """Deterministic pool. Members of a family share exactly the first
    ``prefix_chunks * chunk`` tokens (their suffixes start with different tokens); no
    two families or distinct prompts share a first token."""
    first: set[int] = set()
    pool: list[PoolEntry] = []
    plen = w.prefix_chunks * chunk
    for f in range(w.families):
        rng = random.Random(f"hybridfa-load-{w.seed}-family-{f}")
        head = _token(rng, first)
        first.add(head)
        prefix = [head] + [_token(rng) for _ in range(plen - 1)]
        starts: set[int] = set()
        for m in range(w.members):
            r = random.Random(f"hybridfa-load-{w.seed}-family-{f}-member-{m}")
            n = _length(r, w.suffix_chunks, chunk)
            s0 = _token(r, starts)
            starts.add(s0)
            suffix = [s0] + [_token(r) for _ in range(n - 1)]
            pool.append(PoolEntry("shared", f, tuple(prefix + suffix)))
    for d in range(w.distinct):
        rng = random.Random(f"hybridfa-load-{w.seed}-distinct-{d}")
        n = _length(rng, w.distinct_chunks, chunk)
        head = _token(rng, first)
        first.add(head)
        pool.append(PoolEntry("distinct", -1, tuple([head] + [_token(rng) for _ in range(n - 1)])))
    return pool


def block_keys(tokens: Sequence[int], block_size: int) -> list[str]:
    """Chained hash of each full block's tokens and everything before it: equal keys
    mean equal prefixes, so equal KV for that block (what a restore must bring back)."""
    keys: list[str] = []
    prev = b""
    for j in range(len(tokens) // block_size):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(",".join(map(str, tokens[j * block_size : (j + 1) * block_size])).encode())
        prev = h.digest()
        keys.append(prev.hex())
    return keys


def unique_chunks(pool: Sequence[PoolEntry], block_size: int, chunk: int) -> set[str]:
    """Distinct complete chunks of the pool (a chunk is named by its last block's key):
    the L2 objects a run can store, shared prefixes counted once."""
    per = chunk // block_size
    out: set[str] = set()
    for e in pool:
        keys = block_keys(e.tokens, block_size)
        out.update(keys[c * per + per - 1] for c in range(len(e.tokens) // chunk))
    return out


def request_sequence(
    pool: Sequence[PoolEntry], count: int, seed: str, shared_fraction: float
) -> list[int]:
    """Pool indices in request order: a family member with probability shared_fraction,
    else a distinct prompt; uniform within each kind. Deterministic for a seed."""
    rng = random.Random(f"hybridfa-load-seq-{seed}")
    shared = [i for i, e in enumerate(pool) if e.kind == "shared"]
    distinct = [i for i, e in enumerate(pool) if e.kind == "distinct"]
    out: list[int] = []
    for _ in range(count):
        use_shared = shared and (not distinct or rng.random() < shared_fraction)
        out.append(rng.choice(shared if use_shared else distinct))
    return out


# ---------------------------------------------------------------------------------------
# Statistics (pure)
# ---------------------------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default method)."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_summary(values: Iterable[float | None]) -> dict[str, Any]:
    xs = [float(v) for v in values if v is not None]
    return {
        "n": len(xs),
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "mean": sum(xs) / len(xs) if xs else None,
        "max": max(xs) if xs else None,
    }


def rate(count: int, seconds: float | None) -> float | None:
    return count / seconds if seconds and seconds > 0 else None


# ---------------------------------------------------------------------------------------
# Reference hashes and verification (pure)
# ---------------------------------------------------------------------------------------


def flatten_hashes(reports: Iterable[dict[str, Any]] | None) -> dict[int, dict[str, str]]:
    """engine_proc ``_rpc_block_hashes`` reports (one per TP rank) ->
    {block index: {"<rank>:<fa|gdn>:<layer>": hash}}."""
    out: dict[int, dict[str, str]] = {}
    for r in reports or []:
        if r.get("missing"):
            continue
        rank = r.get("rank", 0)
        for kind in ("fa", "gdn"):
            for layer, blocks in (r.get(kind) or {}).items():
                for j, h in blocks.items():
                    out.setdefault(int(j), {})[f"{rank}:{kind}:{layer}"] = h
    return out


class ReferenceMap:
    """prefix block key -> layer -> KV hashes computed for it (first one first)."""

    def __init__(self) -> None:
        self.ref: dict[str, dict[str, list[str]]] = {}
        self.first_phase: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.ref)

    def add(self, key: str, layers: dict[str, str], phase: int) -> None:
        slot = self.ref.setdefault(key, {})
        self.first_phase.setdefault(key, phase)
        for layer, h in layers.items():
            seen = slot.setdefault(layer, [])
            if h not in seen:
                seen.append(h)

    def variants(self) -> int:
        """(block, layer) pairs computed with more than one distinct result: batches
        that are not bitwise invariant; a restore may then match any of them."""
        return sum(len(hs) > 1 for layers in self.ref.values() for hs in layers.values())

    def check(self, key: str, layers: dict[str, str]) -> dict[str, Any]:
        ref = self.ref.get(key)
        if ref is None:
            return {"known": False, "compared": 0, "bad": [], "unknown_layers": len(layers)}
        bad = [layer for layer, h in layers.items() if layer in ref and h not in ref[layer]]
        compared = sum(layer in ref for layer in layers)
        return {
            "known": True,
            "compared": compared,
            "bad": bad,
            "unknown_layers": len(layers) - compared,
        }


def _by_phase() -> dict[str, int]:
    return defaultdict(int)


def verify_restores(
    firsts: Sequence[dict[str, Any]], pool_keys: Sequence[Sequence[str]], max_examples: int = 20
) -> dict[str, Any]:
    """Build the reference from every computed block hashed (in phase order), then check
    every restored block. Counts per phase; a block is verified when every layer hashed
    for it is known and equal, a mismatch when some layer differs, unverified when its
    prefix (or every layer of it) was never hashed as computed."""
    ref = ReferenceMap()
    for rec in sorted(firsts, key=lambda r: (r.get("phase", 0), r.get("t_first") or 0)):
        blocks = flatten_hashes(rec.get("hashes"))
        keys = pool_keys[rec["pool"]]
        for j in rec.get("ref") or []:
            if j in blocks and j < len(keys):
                ref.add(keys[j], blocks[j], int(rec.get("phase", 0)))
    per: dict[int, dict[str, int]] = defaultdict(_by_phase)
    examples: list[dict[str, Any]] = []
    for rec in firsts:
        ph = per[int(rec.get("phase", 0))]
        ph["hash_errors"] += bool(rec.get("hash_error"))
        if not rec.get("verify"):
            continue
        ph["restored_requests"] += 1
        blocks = flatten_hashes(rec.get("hashes"))
        keys = pool_keys[rec["pool"]]
        req_ok = True
        for j in rec["verify"]:
            ph["restored_blocks"] += 1
            layers = blocks.get(j)
            if not layers or j >= len(keys):
                ph["unhashed_blocks"] += 1
                req_ok = False
                continue
            c = ref.check(keys[j], layers)
            ph["layers_compared"] += c["compared"]
            ph["gdn_layers_compared"] += sum(
                1 for layer in layers if ":gdn:" in layer and layer in ref.ref.get(keys[j], {})
            )
            if c["bad"]:
                ph["mismatch_blocks"] += 1
                ph["mismatch_layers"] += len(c["bad"])
                req_ok = False
                if len(examples) < max_examples:
                    examples.append(
                        {
                            "phase": rec.get("phase"),
                            "seq": rec.get("seq"),
                            "pool": rec["pool"],
                            "block": j,
                            "layers": c["bad"][:4],
                        }
                    )
            elif c["compared"] == 0:
                ph["unverified_blocks"] += 1
                req_ok = False
            else:
                ph["verified_blocks"] += 1
        ph["fully_verified_requests"] += req_ok
    total: dict[str, int] = defaultdict(int)
    for ph in per.values():
        for k, v in ph.items():
            total[k] += v
    return {
        "per_phase": {str(k): dict(v) for k, v in sorted(per.items())},
        "total": dict(total),
        "reference_blocks": len(ref),
        "reference_variants": ref.variants(),
        "mismatch_examples": examples,
    }


def lost_objects(before: dict[str, int], after: dict[str, int]) -> dict[str, list[str]]:
    """Objects of snapshot ``before`` (name -> size) missing from ``after``, or resized."""
    missing = sorted(n for n in before if n not in after)
    changed = sorted(n for n in before if n in after and after[n] != before[n])
    return {"missing": missing, "changed": changed}


def trailer_ok(path: Path) -> bool | None:
    """Integrity trailer of an fs L2 object: True/False, or None for a file without one
    (written by pristine LMCache)."""
    import blake3

    data = Path(path).read_bytes()
    if len(data) < TRAILER_LEN or data[-TRAILER_LEN:][: len(TRAILER_MAGIC)] != TRAILER_MAGIC:
        return None
    h = blake3.blake3(data[:-TRAILER_LEN])
    h.update(Path(path).name.encode())
    return data[-32:] == h.digest()


def verify_trailers(root: Path, names: Iterable[str]) -> dict[str, Any]:
    try:
        import blake3  # noqa: F401
    except ImportError as e:
        return {"skipped": f"blake3 not importable: {e}"}
    out: dict[str, Any] = {"checked": 0, "bad": [], "no_trailer": 0, "gone": 0}
    for name in sorted(names):
        try:
            ok = trailer_ok(Path(root) / name)
        except FileNotFoundError:
            out["gone"] += 1
            continue
        out["checked"] += 1
        if ok is None:
            out["no_trailer"] += 1
        elif not ok:
            out["bad"].append(name)
    return out


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Records of one phase; a line cut by a SIGKILL is skipped and counted."""
    recs: list[dict[str, Any]] = []
    bad = 0
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return recs, 0
    for line in lines:
        if not line.strip():
            continue
        try:
            recs.append(json.loads(line))
        except ValueError:
            bad += 1
    return recs, bad


# ---------------------------------------------------------------------------------------
# Phases and the report (pure)
# ---------------------------------------------------------------------------------------


def next_phase_end(
    elapsed: float, duration: float, restart_every: float, min_phase_s: float, first: bool
) -> float | None:
    """End (seconds from the start) of the phase starting at ``elapsed``, or None when
    no phase fits. A phase never leaves a stub shorter than ``min_phase_s`` behind it;
    the first phase always runs."""
    remaining = duration - elapsed
    if remaining <= 0 or (remaining < min_phase_s and not first):
        return None
    end = min(elapsed + restart_every, duration)
    if duration - end < min_phase_s:
        end = duration
    return end


def phase_stats(
    firsts: Sequence[dict[str, Any]], dones: Sequence[dict[str, Any]], load_s: float | None
) -> dict[str, Any]:
    """Throughput, hit rates and latencies of one phase's records."""
    ext_by_seq = {r["seq"]: r.get("external") for r in firsts}
    known = [r for r in firsts if r.get("external") is not None]
    prompt = sum(int(r["P"]) for r in known)
    ext = sum(int(r["external"]) for r in known)
    local = sum(int(r["local"] or 0) for r in known)
    restored = [d for d in dones if (ext_by_seq.get(d["seq"]) or 0) > 0]
    return {
        "first_tokens": len(firsts),
        "completed": len(dones),
        "load_s": load_s,
        "requests_per_s": rate(len(dones), load_s),
        "prompt_tokens": prompt,
        "external_hit_tokens": ext,
        "local_hit_tokens": local,
        "external_hit_pct": 100.0 * ext / prompt if prompt else None,
        "total_hit_pct": 100.0 * (ext + local) / prompt if prompt else None,
        "requests_with_external_hit": sum(int(r["external"]) > 0 for r in known),
        "requests_without_split": len(firsts) - len(known),
        "ttft": latency_summary(d.get("ttft_s") for d in dones),
        "restore_ttft": latency_summary(d.get("ttft_s") for d in restored),
    }


def analyze(
    phases: Sequence[dict[str, Any]],
    records: Sequence[Sequence[dict[str, Any]]],
    pool_keys: Sequence[Sequence[str]],
    snapshots: Sequence[dict[str, int]],
    trailers: dict[str, Any] | None,
) -> dict[str, Any]:
    """Everything the report says, from each phase's engine summary (``phases``), its
    records, the L2 file snapshots taken after each phase's kill, and the final trailer
    check."""
    firsts_all: list[dict[str, Any]] = []
    per_phase: list[dict[str, Any]] = []
    for k, recs in enumerate(records):
        firsts = [r for r in recs if r.get("t") == "first"]
        dones = [r for r in recs if r.get("t") == "done"]
        firsts_all += firsts
        load = (phases[k].get("load") or {}) if k < len(phases) else {}
        load_s = None
        if load.get("load_start_epoch") is not None and load.get("load_end_epoch") is not None:
            load_s = load["load_end_epoch"] - load["load_start_epoch"]
        elif dones and firsts:  # hard kill: no engine summary
            load_s = max(d["t_done"] for d in dones) - min(r["t_add"] for r in firsts)
        per_phase.append({"phase": k, **phase_stats(firsts, dones, load_s)})
    ver = verify_restores(firsts_all, pool_keys)
    for ph in per_phase:
        ph["verify"] = ver["per_phase"].get(str(ph["phase"]), {})
    lost: list[dict[str, Any]] = []
    for k in range(len(snapshots) - 1):
        d = lost_objects(snapshots[k], snapshots[k + 1])
        lost.append({"after_phase": k, "objects_before": len(snapshots[k]), **d})
    unreadable = list((trailers or {}).get("bad", []))
    # objects the next phase's server found damaged and removed (and may have rewritten)
    discarded = sum(int(((m.get("server") or {}).get("l2_discards")) or 0) for m in phases[1:] if m)
    before_any = set().union(*snapshots[:-1]) if len(snapshots) > 1 else set()
    lost_names = {n for row in lost for n in row["missing"] + row["changed"]}
    lost_names |= {n for n in unreadable if n in before_any}

    done_all = [d for recs in records for d in recs if d.get("t") == "done"]
    firsts_after = [r for r in firsts_all if r.get("phase", 0) >= 1]
    restore_after = {(r["phase"], r["seq"]) for r in firsts_after if (r.get("external") or 0) > 0}
    load_total = sum(ph["load_s"] or 0.0 for ph in per_phase)
    known = [r for r in firsts_all if r.get("external") is not None]
    prompt = sum(int(r["P"]) for r in known)
    t = ver["total"]
    totals = {
        "phases": len(per_phase),
        "restarts": max(0, len(per_phase) - 1),
        "completed": len(done_all),
        "load_s": load_total,
        "requests_per_s": rate(len(done_all), load_total),
        "external_hit_pct": 100.0 * sum(int(r["external"]) for r in known) / prompt
        if prompt
        else None,
        "total_hit_pct": 100.0
        * sum(int(r["external"]) + int(r["local"] or 0) for r in known)
        / prompt
        if prompt
        else None,
        "requests_with_external_hit_pct": 100.0
        * sum(int(r["external"]) > 0 for r in known)
        / len(known)
        if known
        else None,
        "ttft": latency_summary(d.get("ttft_s") for d in done_all),
        "restore_ttft_after_restart": latency_summary(
            d.get("ttft_s") for d in done_all if (d["phase"], d["seq"]) in restore_after
        ),
        "restored_requests_after_restart": len(restore_after),
        "restored_blocks": t.get("restored_blocks", 0),
        "verified_blocks": t.get("verified_blocks", 0),
        "mismatch_blocks": t.get("mismatch_blocks", 0),
        "unverified_blocks": t.get("unverified_blocks", 0) + t.get("unhashed_blocks", 0),
        "hash_errors": t.get("hash_errors", 0),
        "lost_objects": len(lost_names),
        "unreadable_objects": len(unreadable),
        "discarded_damaged_objects": discarded,
    }
    verified_after = sum(
        ver["per_phase"].get(str(k), {}).get("verified_blocks", 0) for k in range(1, len(per_phase))
    )
    problems: list[str] = []
    if totals["restarts"] < 1:
        problems.append("no restart happened (duration too short for two phases)")
    if verified_after == 0:
        problems.append("no restored block after a restart was verified")
    if totals["mismatch_blocks"]:
        problems.append(f"{totals['mismatch_blocks']} restored blocks differ from the reference")
    if totals["lost_objects"]:
        problems.append(f"{totals['lost_objects']} L2 objects lost across restarts")
    if discarded:
        problems.append(f"the servers found {discarded} damaged L2 objects and removed them")
    if totals["hash_errors"]:
        problems.append(f"{totals['hash_errors']} KV hash RPCs failed")
    return {
        "totals": totals,
        "per_phase": per_phase,
        "verification": {k: v for k, v in ver.items() if k != "per_phase"},
        "lost": [
            {**row, "missing": row["missing"][:20], "changed": row["changed"][:20]} for row in lost
        ],
        "lost_names": sorted(lost_names)[:50],
        "trailers": {
            k: (v[:20] if isinstance(v, list) else v) for k, v in (trailers or {}).items()
        },
        "problems": problems,
        "pass": not problems,
    }


_f = gate.fmt


def _lat(s: dict[str, Any]) -> str:
    return f"{_f(s.get('p50'))} / {_f(s.get('p90'))} / {_f(s.get('p99'))} (n={s.get('n', 0)})"


def _verdict(report: dict[str, Any]) -> str:
    if report.get("error"):
        return f"**ERROR**: {report['error']}"
    a = report.get("analysis")
    if a is None:
        return f"**not finished** ({len(report.get('phases', []))} phases so far)"
    return f"**{'PASS' if a.get('pass') else 'FAIL'}**" + (
        f": {'; '.join(a['problems'])}" if a.get("problems") else ""
    )


def markdown_report(report: dict[str, Any]) -> str:
    a = report.get("analysis") or {}
    t = a.get("totals") or {}
    cfg = report.get("config", {})
    lines = [
        f"# GPU load with restarts, arm {report['arm']} ({report['date']})",
        "",
        f"- hardware: {report.get('hardware')}",
        f"- versions: {report.get('versions')}",
        f"- model {cfg.get('model')} (N={cfg.get('block_size')}, chunk {cfg.get('chunk')}), "
        f"layout {cfg.get('layout')}, concurrency {cfg.get('concurrency')}, duration "
        f"{cfg.get('duration')} s, restart every {cfg.get('restart_every')} s, kill "
        f"{cfg.get('kill')}, pool {cfg.get('pool_size')} prompts "
        f"({cfg.get('pool_tokens')} tokens), {cfg.get('new_tokens')} new tokens each",
        f"- elapsed {_f(report.get('elapsed_s'))} s; " + _verdict(report),
        "",
        "| metric | value |",
        "|---|---|",
        f"| phases / restarts | {t.get('phases')} / {t.get('restarts')} |",
        f"| completed requests | {t.get('completed')} |",
        f"| requests/s (during load) | {_f(t.get('requests_per_s'))} |",
        f"| LMCache (external) hit, % of prompt tokens | {_f(t.get('external_hit_pct'))} |",
        f"| external + local prefix hit, % | {_f(t.get('total_hit_pct'))} |",
        f"| requests with an external hit, % | {_f(t.get('requests_with_external_hit_pct'))} |",
        f"| TTFT s p50 / p90 / p99, all | {_lat(t.get('ttft') or {})} |",
        "| restore TTFT s p50 / p90 / p99, external hit after a restart | "
        f"{_lat(t.get('restore_ttft_after_restart') or {})} |",
        f"| restored blocks: verified / mismatched / unverified | {t.get('verified_blocks')} / "
        f"{t.get('mismatch_blocks')} / {t.get('unverified_blocks')} |",
        f"| lost L2 objects (missing, resized or unreadable) | {t.get('lost_objects')} |",
        f"| damaged objects the servers removed | {t.get('discarded_damaged_objects')} |",
        f"| KV hash RPC errors | {t.get('hash_errors')} |",
        "",
        "| phase | engine up s | load s | done | req/s | ext hit % | reqs w/ ext hit "
        "| TTFT p50/p90/p99 | restore TTFT p50/p90/p99 | restored blocks verified/bad/unverif. "
        "| hashing s | L2 objects after kill |",
        "|" + "---|" * 12,
    ]
    for ph, meta in zip(a.get("per_phase", []), report.get("phases", []), strict=False):
        v = ph.get("verify") or {}
        lines.append(
            f"| {ph['phase']} | {_f(meta.get('engine_up_s'))} | {_f(ph.get('load_s'))} "
            f"| {ph.get('completed')} | {_f(ph.get('requests_per_s'))} "
            f"| {_f(ph.get('external_hit_pct'))} | {ph.get('requests_with_external_hit')} "
            f"| {_lat(ph.get('ttft') or {})} | {_lat(ph.get('restore_ttft') or {})} "
            f"| {v.get('verified_blocks', 0)}/{v.get('mismatch_blocks', 0)}/"
            f"{v.get('unverified_blocks', 0) + v.get('unhashed_blocks', 0)} "
            f"| {_f((meta.get('load') or {}).get('hash_s'))} | {meta.get('l2_objects')} |"
        )
    ver = a.get("verification") or {}
    lines += [
        "",
        f"Reference: {ver.get('reference_blocks')} prefix blocks; "
        f"{ver.get('reference_variants')} (block, layer) pairs computed with more than one "
        "result (batch variance; a restore may match any).",
    ]
    for row in a.get("lost", []):
        lines.append(
            f"- after phase {row['after_phase']}: {row['objects_before']} objects; missing "
            f"{len(row['missing'])}, resized {len(row['changed'])}"
        )
    if a.get("trailers"):
        lines.append(f"- trailer check at the end: {a['trailers']}")
    if ver.get("mismatch_examples"):
        lines += ["", "## Mismatches (first ones)", ""]
        lines += [f"- {json.dumps(m)}" for m in ver["mismatch_examples"]]
    errs = [(m["phase"], m.get("error")) for m in report.get("phases", []) if m.get("error")]
    if errs:
        lines += ["", "## Engine errors", ""]
        lines += [f"- phase {k}: {str(e)[-600:]}" for k, e in errs]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------
# The engine's request loop (engine_proc.py's role "load" runs it; pure)
# ---------------------------------------------------------------------------------------


def blocks_to_hash(
    prompt_tokens: int,
    block_size: int,
    chunk: int,
    local: int,
    external: int,
    keys: list[str],
    hashed: dict[str, int],
    ref_copies: int,
) -> tuple[list[int], list[int]]:
    """Prompt block indices to hash at a request's first token: (verify, reference).

    verify: the blocks LMCache restored, [local, local + external) / N. reference: blocks
    this request computed itself that lie in complete chunks (only those are ever stored
    and restored), while this engine has hashed that prefix block fewer than ``ref_copies``
    times (concurrent requests may compute the same prefix block in different batches).
    """
    n = block_size
    full = prompt_tokens // n
    stored = (prompt_tokens // chunk) * chunk // n
    lo, hi = local // n, min((local + external) // n, full)
    verify = list(range(lo, hi)) if external > 0 else []
    start = (local + external) // n
    ref = [j for j in range(start, min(stored, len(keys))) if hashed.get(keys[j], 0) < ref_copies]
    return verify, ref


def load_loop(
    engine: Any,
    render: Any,
    params: Any,
    hash_rpc: Any,
    prefill: dict[str, tuple[int, int]],
    spec: dict[str, Any],
    emit: Any,
    clock: Any = time.time,
) -> dict[str, Any]:
    """Keep ``concurrency`` requests in flight until ``stop_admitting_epoch``, then drain
    until ``end_epoch``. Requests come from ``pool`` in ``sequence`` order. At each
    request's first token (it is still running, so its blocks are held) the restored and
    the newly computed prefix blocks are hashed (``blocks_to_hash``) and a "first" record
    is emitted; a "done" record follows when it finishes."""
    pool, keys, seq = spec["pool"], spec["block_keys"], spec["sequence"]
    n, chunk, phase = int(spec["block_size"]), int(spec["chunk"]), int(spec["phase"])
    conc, ref_copies = int(spec["concurrency"]), int(spec.get("ref_copies", 2))
    stop_at, end_at = float(spec["stop_admitting_epoch"]), float(spec["end_epoch"])
    hashed: dict[str, int] = {}
    inflight: dict[str, dict[str, Any]] = {}
    s: dict[str, Any] = {
        "admitted": 0,
        "first_tokens": 0,
        "completed": 0,
        "hash_s": 0.0,
        "hash_errors": 0,
        "no_prefill_stats": 0,
        "stopped_at_end": False,
        "load_start_epoch": clock(),
    }
    i = 0
    while True:
        now = clock()
        if now >= end_at:
            s["stopped_at_end"] = True
            break
        while len(inflight) < conc and now < stop_at:
            idx = int(seq[i % len(seq)])
            ext = f"{phase}-{i}"
            rid = engine.add_request(ext, render(pool[idx]), params)
            inflight[ext] = {"seq": i, "pool": idx, "rid": rid, "t_add": clock(), "first": None}
            i += 1
            s["admitted"] += 1
        if not inflight:
            break
        outs = engine.step()
        t = clock()
        for ro in outs:
            st = inflight.get(ro.request_id)
            if st is None:
                continue
            toks = ro.outputs[0].token_ids if ro.outputs else []
            if st["first"] is None and len(toks) > 0:
                st["first"] = t
                s["first_tokens"] += 1
                rec = _first_record(
                    st, ro, pool, keys, prefill, hashed, hash_rpc, n, chunk, ref_copies
                )
                rec["phase"] = phase
                s["hash_s"] += rec["hash_s"]
                s["hash_errors"] += bool(rec.get("hash_error"))
                s["no_prefill_stats"] += rec["external"] is None
                emit(rec)
            if ro.finished:
                met = getattr(ro, "metrics", None)
                ttft = getattr(met, "first_token_latency", None) if met is not None else None
                own = (st["first"] - st["t_add"]) if st["first"] is not None else None
                emit(
                    {
                        "t": "done",
                        "phase": phase,
                        "seq": st["seq"],
                        "pool": st["pool"],
                        "t_done": t,
                        "e2e_s": t - st["t_add"],
                        "ttft_s": ttft if isinstance(ttft, (int, float)) and ttft > 0 else own,
                        "ttft_own_s": own,
                        "n_out": len(toks),
                    }
                )
                s["completed"] += 1
                del inflight[ro.request_id]
    s["load_end_epoch"] = clock()
    s["inflight_at_end"] = len(inflight)
    return s


def _first_record(
    st: dict[str, Any],
    ro: Any,
    pool: list[list[int]],
    keys: list[list[str]],
    prefill: dict[str, tuple[int, int]],
    hashed: dict[str, int],
    hash_rpc: Any,
    n: int,
    chunk: int,
    ref_copies: int,
) -> dict[str, Any]:
    idx, rid = st["pool"], st["rid"]
    p = len(pool[idx])
    split = prefill.pop(rid, None)
    rec: dict[str, Any] = {
        "t": "first",
        "seq": st["seq"],
        "pool": idx,
        "P": p,
        "local": split[0] if split else None,
        "external": split[1] if split else None,
        "cached": getattr(ro, "num_cached_tokens", None),
        "t_add": st["t_add"],
        "t_first": st["first"],
        "verify": [],
        "ref": [],
        "hash_s": 0.0,
    }
    if split is None:
        return rec
    verify, ref = blocks_to_hash(p, n, chunk, split[0], split[1], keys[idx], hashed, ref_copies)
    rec["verify"], rec["ref"] = verify, ref
    if verify or ref:
        t0 = time.perf_counter()
        try:
            reports = hash_rpc(rid, p, sorted(set(verify) | set(ref)))
            rec["hashes"] = [
                {k: r.get(k) for k in ("rank", "fa", "gdn", "missing") if k in r} for r in reports
            ]
            for j in ref:
                hashed[keys[idx][j]] = hashed.get(keys[idx][j], 0) + 1
        except Exception as e:  # noqa: BLE001 - recorded, the request still counts
            rec["hash_error"] = f"{type(e).__name__}: {e}"[:500]
        rec["hash_s"] = time.perf_counter() - t0
    return rec


def shift_deadlines(spec: dict[str, Any], ready_epoch: float) -> float:
    """Move a phase's deadlines later when the engine got ready too late to admit load
    for ``min_load_s`` before ``load_window_end_epoch`` (its first start on a fresh box
    pays the JIT); returns the shift in seconds (0 when it was ready in time)."""
    window_end = float(spec["load_window_end_epoch"])
    shift = max(0.0, ready_epoch + float(spec.get("min_load_s", 0.0)) - window_end)
    if shift:
        for k in ("load_window_end_epoch", "stop_admitting_epoch", "end_epoch", "exit_epoch"):
            spec[k] = float(spec[k]) + shift
        if "kill_epoch" in spec:
            spec["kill_epoch"] = float(spec["kill_epoch"]) + shift
    return shift


# ---------------------------------------------------------------------------------------
# Node side
# ---------------------------------------------------------------------------------------


@dataclass
class LoadConfig:
    arm: str
    lmcache_dir: Path
    out: Path
    model: str = "olmo-r17"
    layout: str = "NHD"
    chunk_blocks: int = 1
    concurrency: int = 64
    duration: float = 600.0
    restart_every: float = 140.0
    min_phase_s: float = 75.0
    # A phase's engine that is ready late (FlashInfer JIT on a fresh box took 150 s) still
    # admits load for min_load_s: its deadlines move later, and the parent waits up to
    # start_allowance_s longer for it.
    min_load_s: float = 45.0
    start_allowance_s: float = 300.0
    drain_s: float = 25.0
    kill: str = "drain"  # drain | hard
    new_tokens: int = 8
    ref_copies: int = 2
    sequence_len: int = 50000
    kv_cache_gib: float = 8.0
    gpu_memory_utilization: float = 0.25
    l1_size_gb: float = 8.0
    verify_trailers: bool = True
    keep_l2: bool = False
    workload: Workload = field(default_factory=Workload)
    work: Path = field(default_factory=lambda: Path("/tmp/hybridfa-load"))
    python: str = sys.executable

    @property
    def case(self) -> gate.Case:
        return gate.Case(self.model, self.layout, self.chunk_blocks, exact=False)


def phase_spec(
    cfg: LoadConfig,
    model_dir: Path,
    port: int,
    phase: int,
    pool: Sequence[PoolEntry],
    keys: Sequence[Sequence[str]],
    phase_end: float,
    wd: Path,
    l2: Path,
) -> dict[str, Any]:
    """engine_proc spec of one phase: the gate's engine spec plus the load fields."""
    case = cfg.case
    n = case.geometry.block_size
    rc = gate.RunConfig(
        arm=cfg.arm,
        lmcache_dir=cfg.lmcache_dir,
        out=cfg.out,
        python=cfg.python,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        kv_cache_memory_bytes=int(cfg.kv_cache_gib * 2**30) if cfg.kv_cache_gib else None,
    )
    spec = gate.engine_spec(case, "load", model_dir, rc, port, None)
    kill: dict[str, float] = {}
    if cfg.kill == "drain":
        stop = phase_end - cfg.drain_s
        end = max(stop, phase_end - 10.0)  # drained or not, the loop ends here
        exit_ = max(end, phase_end - 2.0)  # then waits (at most until here) for L2 to settle
        window_end = stop
    else:  # hard: the engine SIGKILLs itself at kill_epoch, in the middle of the load
        stop = end = exit_ = phase_end + 3600.0
        window_end = phase_end
        kill = {"kill_epoch": phase_end}
    spec.update(
        role="load",
        phase=phase,
        pool=[list(e.tokens) for e in pool],
        block_keys=[list(k) for k in keys],
        sequence=request_sequence(
            pool, cfg.sequence_len, f"{cfg.workload.seed}-{phase}", cfg.workload.shared_fraction
        ),
        concurrency=cfg.concurrency,
        block_size=n,
        chunk=case.chunk,
        ref_copies=cfg.ref_copies,
        new_tokens=cfg.new_tokens,
        log_stats=True,
        max_model_len=max(len(e.tokens) for e in pool) + cfg.new_tokens + n,
        stop_admitting_epoch=stop,
        end_epoch=end,
        exit_epoch=exit_,
        load_window_end_epoch=window_end,
        min_load_s=cfg.min_load_s,
        **kill,
        records_path=str(wd / f"records-{phase}.jsonl"),
        l2=str(l2),
        server_log=str(wd / f"server{phase}.log"),
    )
    for k in ("prompt", "health", "prompt_key"):  # the gate's single request: unused here
        spec.pop(k, None)
    return spec


def run_load(cfg: LoadConfig, report: dict[str, Any], flush: Any = None) -> dict[str, Any]:
    """Phases until ``duration``; fills ``report`` (phases, analysis) and returns it."""
    t0 = time.time()
    case = cfg.case
    n, chunk = case.geometry.block_size, case.chunk
    wd = cfg.work / cfg.arm
    l2 = wd / "l2"
    phases: list[dict[str, Any]] = report.setdefault("phases", [])
    snapshots: list[dict[str, int]] = []
    shutil.rmtree(wd, ignore_errors=True)
    l2.mkdir(parents=True)
    model_dir = gate.write_model_dir(case.spec, cfg.work / "models")
    env = gate.child_env(cfg.lmcache_dir, cfg.layout)
    pool = make_pool(cfg.workload, chunk)
    keys = [block_keys(e.tokens, n) for e in pool]
    phase = 0
    while True:
        elapsed = time.time() - t0
        end_rel = next_phase_end(
            elapsed, cfg.duration, cfg.restart_every, cfg.min_phase_s, first=phase == 0
        )
        if end_rel is None:
            break
        phase_end = t0 + end_rel
        meta: dict[str, Any] = {"phase": phase, "start_s": round(time.time() - t0, 1)}
        phases.append(meta)
        srv = None
        try:
            port = gate.free_port()
            srv = gate.start_server(
                cfg.python,
                env,
                port,
                chunk,
                l2,
                wd / f"server{phase}.log",
                l1_size_gb=cfg.l1_size_gb,
            )
            spec = phase_spec(cfg, model_dir, port, phase, pool, keys, phase_end, wd, l2)
            grace = 30.0 if cfg.kill == "drain" else 5.0
            timeout = max(10.0, phase_end - time.time() + grace + cfg.start_allowance_s)
            eng = gate.run_engine(cfg.python, env, spec, wd, f"load{phase}", timeout)
            meta.update(
                ok=bool(eng.get("ok")),
                engine_up_s=eng.get("engine_up_s"),
                load=eng.get("load"),
                l2_wait=eng.get("l2_wait"),
                rc=eng.get("rc"),
                process_s=eng.get("process_s"),
                log_facts=eng.get("log_facts"),
            )
            # --kill hard ends every engine with SIGKILL (rc -9): only another end is an error.
            if not eng.get("ok") and (cfg.kill == "drain" or eng.get("rc") != -9):
                meta["error"] = str(eng.get("error"))[-3000:]
        except gate.ServerError as e:
            meta["error"] = str(e)[-3000:]
        finally:
            if srv is not None:
                gate.kill_group(srv)
        text = _read(wd / f"server{phase}.log")
        meta["server"] = {**gate.server_log_facts(text), "l2_discards": gate.l2_discards(text)}
        inv = gate.l2_inventory(l2, with_files=True)
        snapshots.append(inv["files"])
        meta.update(
            l2_objects=inv["objects"],
            l2_bytes=inv["bytes"],
            end_s=round(time.time() - t0, 1),
        )
        print(
            f"[load] phase {phase}: ok={meta.get('ok')} load={meta.get('load')} "
            f"objects={inv['objects']}",
            flush=True,
        )
        if flush:
            flush()
        phase += 1
        if meta.get("error") and not meta.get("load"):
            break  # a phase that did not even start will not go better next time
    records = []
    bad_lines = 0
    for k in range(len(phases)):
        recs, bad = read_jsonl(wd / f"records-{k}.jsonl")
        records.append(recs)
        bad_lines += bad
    trailers = None
    if cfg.verify_trailers and snapshots:
        trailers = verify_trailers(l2, set().union(*snapshots))
    a = report["analysis"] = analyze(phases, records, keys, snapshots, trailers)
    a["cut_record_lines"] = bad_lines
    report["elapsed_s"] = round(time.time() - t0, 1)
    if not cfg.keep_l2:
        shutil.rmtree(l2, ignore_errors=True)
    return report


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def config_summary(cfg: LoadConfig) -> dict[str, Any]:
    case = cfg.case
    pool = make_pool(cfg.workload, case.chunk)
    lens = [len(e.tokens) for e in pool]
    objects = unique_chunks(pool, case.geometry.block_size, case.chunk)
    return {
        "model": cfg.model,
        "layout": cfg.layout,
        "block_size": case.geometry.block_size,
        "kernel_page": case.geometry.kernel_page,
        "chunk": case.chunk,
        "concurrency": cfg.concurrency,
        "duration": cfg.duration,
        "restart_every": cfg.restart_every,
        "kill": cfg.kill,
        "new_tokens": cfg.new_tokens,
        "kv_cache_gib": cfg.kv_cache_gib,
        "pool_size": len(pool),
        "pool_tokens": sum(lens),
        "prompt_tokens_min_max": [min(lens), max(lens)],
        "unique_chunk_objects": len(objects),
        "l2_bytes_estimate": len(objects) * gate.expected_chunk_bytes(case.spec, case.chunk),
        "workload": asdict(cfg.workload),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gate.add_case_args(ap, model="olmo-r17", work=Path("/tmp/hybridfa-load"), kv_cache_gib=8.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds, restarts included")
    ap.add_argument("--restart-every", type=float, default=140.0, help="seconds per phase")
    ap.add_argument("--min-phase-s", type=float, default=75.0)
    ap.add_argument(
        "--min-load-s", type=float, default=45.0, help="load seconds even after a late start"
    )
    ap.add_argument("--start-allowance-s", type=float, default=300.0)
    ap.add_argument("--drain-s", type=float, default=25.0, help="--kill drain: stop admitting")
    ap.add_argument("--kill", choices=("drain", "hard"), default="drain")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--families", type=int, default=8)
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--prefix-chunks", type=int, default=4)
    ap.add_argument("--distinct", type=int, default=32)
    ap.add_argument("--shared-fraction", type=float, default=0.75)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ref-copies", type=int, default=2)
    ap.add_argument("--l1-size-gb", type=float, default=8.0)
    ap.add_argument("--no-verify-trailers", action="store_true")
    ap.add_argument("--plan", action="store_true", help="print workload and phases; no GPU")
    a = ap.parse_args(argv)
    if a.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (KV is hashed while the request still runs)")
    cfg = LoadConfig(
        **gate.case_args(a),
        concurrency=a.concurrency,
        duration=a.duration,
        restart_every=a.restart_every,
        min_phase_s=a.min_phase_s,
        min_load_s=a.min_load_s,
        start_allowance_s=a.start_allowance_s,
        drain_s=a.drain_s,
        kill=a.kill,
        new_tokens=a.new_tokens,
        ref_copies=a.ref_copies,
        l1_size_gb=a.l1_size_gb,
        verify_trailers=not a.no_verify_trailers,
        workload=Workload(
            families=a.families,
            members=a.members,
            prefix_chunks=a.prefix_chunks,
            distinct=a.distinct,
            shared_fraction=a.shared_fraction,
            seed=a.seed,
        ),
    )
    summary = config_summary(cfg)
    if a.plan:
        ends, t, k = [], 0.0, 0
        while e := next_phase_end(t, cfg.duration, cfg.restart_every, cfg.min_phase_s, k == 0):
            ends.append(e)
            t, k = e, k + 1
        print(json.dumps({**summary, "phase_ends_s": ends}, indent=1))
        return 0
    if a.lmcache_dir is None:
        ap.error("--lmcache-dir is required (except with --plan)")
    stem, header, problem = gate.start_report(
        "gpu-load", cfg.arm, cfg.python, cfg.lmcache_dir, cfg.out
    )
    report: dict[str, Any] = {"schema": SCHEMA, **header, "config": summary}

    def flush() -> None:
        Path(f"{stem}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        Path(f"{stem}.md").write_text(markdown_report(report))

    if problem:
        report["error"] = problem
        flush()
        print(f"load: {problem}", file=sys.stderr)
        return 2
    gate.install_cleanup_handler()
    run_load(cfg, report, flush)
    flush()
    print(Path(f"{stem}.md").read_text())
    return 0 if report["analysis"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
