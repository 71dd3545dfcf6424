"""Load with restarts: many concurrent requests on one fs L2 folder, the engine and the
LMCache server restarted between phases, every restored block checked by KV hash.

A phase: an LMCache server and a fresh engine (``engine_proc.py`` role ``load``) that keeps
``--concurrency`` requests from a prompt pool in flight for ``--phase-s`` seconds, drains and
exits; then the server is SIGKILLed. A restored block whose per-layer KV hash differs from
every hash computed for the same prefix is a mismatch; an L2 file present after one phase and
missing or resized after the next is lost.

    python -m hybridfa_gate.load --arm patched --lmcache-dir /tmp/lmc-patched --out results/ \\
        --phases 5 --phase-s 60 --kv-cache-gib 8
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import random
import shutil
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from hybridfa_gate.cases import Case
from hybridfa_gate.l2 import folder_inventory
from hybridfa_gate.models import write_model_dir
from hybridfa_gate.options import add_case_args, case_args, use_compile_cache
from hybridfa_gate.procs import (
    ENGINE_TIMEOUT_S,
    ServerError,
    child_env,
    free_port,
    install_cleanup_handler,
    kill_group,
    run_engine,
    server_log_facts,
    start_server,
)
from hybridfa_gate.prompts import TOKEN_HI, TOKEN_LO
from hybridfa_gate.report import fmt, write_json_md
from hybridfa_gate.run import start_report
from hybridfa_gate.specs import RunConfig, engine_spec

SCHEMA = "hybridfa-gpu-load/2"
DRAIN_S = 25.0  # after its load an engine admits nothing and finishes what runs, this long
SEQUENCE_LEN = 50000  # requests a phase could admit: many more than it does
NEW_TOKENS = 8  # >= 2: a request's KV is hashed at its first token, while it still runs
Rec = dict[str, Any]
Recs = Sequence[Rec]
Fn = Callable[..., Any]


@dataclass(frozen=True)
class Workload:
    """Prompt pool: ``families`` x ``members`` prompts sharing ``prefix_chunks`` chunks, and
    ``distinct`` ones; a request is a family member with probability ``shared_fraction``."""

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


def _tokens(seed: str, span: tuple[float, float], chunk: int, heads: set[int]) -> list[int]:
    """span[0] to span[1] chunks of token ids; the first one not in ``heads`` (then added)."""
    rng = random.Random(f"hybridfa-load-{seed}")
    lo = max(1, round(span[0] * chunk))
    n = rng.randint(lo, max(lo, round(span[1] * chunk)))
    toks = [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]
    while toks[0] in heads:
        toks[0] = rng.randrange(TOKEN_LO, TOKEN_HI)
    heads.add(toks[0])
    return toks


def make_pool(w: Workload, chunk: int) -> list[PoolEntry]:
    """Deterministic. Members of a family share exactly their first ``prefix_chunks`` chunks;
    no two families or distinct prompts share a first token."""
    heads: set[int] = set()
    pool: list[PoolEntry] = []
    for f in range(w.families):
        prefix = _tokens(f"{w.seed}-family-{f}", (w.prefix_chunks,) * 2, chunk, heads)
        starts: set[int] = set()
        for m in range(w.members):
            suffix = _tokens(f"{w.seed}-family-{f}-member-{m}", w.suffix_chunks, chunk, starts)
            pool.append(PoolEntry("shared", f, (*prefix, *suffix)))
    for d in range(w.distinct):
        tokens = _tokens(f"{w.seed}-distinct-{d}", w.distinct_chunks, chunk, heads)
        pool.append(PoolEntry("distinct", -1, tuple(tokens)))
    return pool


def block_keys(tokens: Sequence[int], block_size: int) -> list[str]:
    """Chained hash of each full block and everything before it: equal keys, equal KV."""
    keys, prev = [], b""
    for j in range(len(tokens) // block_size):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(",".join(map(str, tokens[j * block_size : (j + 1) * block_size])).encode())
        prev = h.digest()
        keys.append(prev.hex())
    return keys


def request_sequence(pool: Sequence[PoolEntry], count: int, seed: str, shared: float) -> list[int]:
    """Pool indices in request order, deterministic for a seed: a family member with
    probability ``shared``, else a distinct prompt; uniform within each kind."""
    rng = random.Random(f"hybridfa-load-seq-{seed}")
    kinds = {k: [i for i, e in enumerate(pool) if e.kind == k] for k in ("shared", "distinct")}
    out = []
    for _ in range(count):
        use_shared = kinds["shared"] and (not kinds["distinct"] or rng.random() < shared)
        out.append(rng.choice(kinds["shared" if use_shared else "distinct"]))
    return out


def latency_summary(values: Iterable[float | None]) -> dict[str, Any]:
    """n, p50, p90 and p99 (linear between closest ranks, numpy's default)."""
    xs = [float(v) for v in values if v is not None]
    q = statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 1 else xs * 99
    return {"n": len(xs), **{f"p{p}": q[p - 1] if xs else None for p in (50, 90, 99)}}


def flatten_hashes(reports: Iterable[dict[str, Any]] | None) -> dict[int, dict[str, str]]:
    """engine_proc ``_rpc_block_hashes`` reports (one per TP rank) ->
    {block index: {"<rank>:<fa|gdn>:<layer>": hash}}."""
    out: dict[int, dict[str, str]] = {}
    for r in reports or []:
        for kind in () if r.get("missing") else ("fa", "gdn"):
            for layer, blocks in (r.get(kind) or {}).items():
                for j, h in blocks.items():
                    out.setdefault(int(j), {})[f"{r.get('rank', 0)}:{kind}:{layer}"] = h
    return out


def verify_restores(recs: Sequence[dict[str, Any]], keys: Sequence[Sequence[str]]) -> dict:
    """Reference: each computed block's hashes (prefix block key -> layer -> hashes: batches
    may differ). Per phase, a restored block is verified when its layers are known and equal,
    a mismatch when one differs, unverified when none was hashed as computed, unhashed when
    its own hashing failed."""
    ref: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for rec in recs:
        blocks = flatten_hashes(rec.get("hashes"))
        for j in rec.get("ref") or []:
            for layer, h in blocks.get(j, {}).items():
                ref[keys[rec["pool"]][j]][layer].add(h)
    per: dict[int, Counter[str]] = defaultdict(Counter)
    examples: list[dict[str, Any]] = []
    for rec in recs:
        ph, blocks = per[rec["phase"]], flatten_hashes(rec.get("hashes"))
        ph["hash_errors"] += "hash_error" in rec
        for j in rec.get("verify") or []:
            layers, known = blocks.get(j, {}), ref.get(keys[rec["pool"]][j], {})
            bad = [x for x in layers if x in known and layers[x] not in known[x]]
            compared = any(x in known for x in layers)
            verdict = "mismatch" if bad else "verified" if compared else "unverified"
            ph[f"{verdict if layers else 'unhashed'}_blocks"] += 1
            ph["restored_blocks"] += 1
            ph["gdn_layers_compared"] += sum(":gdn:" in x and x in known for x in layers)
            if bad and len(examples) < 20:
                examples.append({"phase": rec["phase"], "seq": rec["seq"], "block": j, "bad": bad})
    return {
        "per_phase": {str(k): dict(v) for k, v in sorted(per.items())},
        "total": dict(sum(per.values(), Counter())),
        "reference_blocks": len(ref),
        "reference_variants": sum(len(hs) > 1 for ls in ref.values() for hs in ls.values()),
        "mismatch_examples": examples,
    }


def lost_objects(snapshots: Sequence[dict[str, int]]) -> list[str]:
    """Objects of a snapshot (name -> size) missing from the next one, or resized."""
    return sorted({n for a, b in pairwise(snapshots) for n, size in a.items() if b.get(n) != size})


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of one phase; a line cut by a kill is skipped."""
    recs: list[Rec] = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else ():
        with contextlib.suppress(ValueError):
            recs.append(json.loads(line))
    return recs


def load_seconds(phase: dict[str, Any]) -> float | None:
    load = phase.get("load") or {}
    return load["load_end_epoch"] - load["load_start_epoch"] if load else None


def analyze(phases: Recs, records: Recs, keys: Sequence[Sequence[str]], snapshots: Recs) -> Rec:
    """The verdict from the phases, their request records and L2 snapshots (after each kill)."""
    ver = verify_restores(records, keys)
    split = [r for r in records if r.get("external") is not None]
    prompt = sum(r["P"] for r in split) or None
    ext, local = (sum(r[k] for r in split) for k in ("external", "local"))
    restored_after = [r["ttft_s"] for r in split if r["external"] and r["phase"] > 0]
    load_s = sum(load_seconds(m) or 0.0 for m in phases)
    lost = lost_objects(snapshots)
    # objects a later phase's server found failing their check (a miss; a store rewrites them)
    discarded = sum((m.get("server") or {}).get("l2_discards") or 0 for m in phases[1:])
    t = ver["total"]
    totals = {
        "phases": len(phases),
        "restarts": max(0, len(phases) - 1),
        "completed": len(records),
        "requests_per_s": len(records) / load_s if load_s else None,
        "external_hit_pct": 100 * ext / prompt if prompt else None,
        "total_hit_pct": 100 * (ext + local) / prompt if prompt else None,
        "requests_with_external_hit": sum(bool(r["external"]) for r in split),
        "ttft": latency_summary(r["ttft_s"] for r in records),
        "restore_ttft_after_restart": latency_summary(restored_after),
        **{f"{k}_blocks": t.get(f"{k}_blocks", 0) for k in ("restored", "verified", "mismatch")},
        "unverified_blocks": t.get("unverified_blocks", 0) + t.get("unhashed_blocks", 0),
        "hash_errors": t.get("hash_errors", 0),
        "lost_objects": len(lost),
        "discarded_damaged_objects": discarded,
    }
    after = sum(v.get("verified_blocks", 0) for k, v in ver["per_phase"].items() if k != "0")
    checks = {
        "no restart happened (one phase only)": totals["restarts"] < 1,
        "no restored block after a restart was verified": not after,
        f"{totals['mismatch_blocks']} restored blocks differ": totals["mismatch_blocks"],
        f"{len(lost)} L2 objects lost across restarts": lost,
        f"the servers found {discarded} damaged or forged L2 objects (a miss each)": discarded,
        f"{totals['hash_errors']} KV hash RPCs failed": totals["hash_errors"],
    }
    problems = [text for text, failed in checks.items() if failed]
    out = {"totals": totals, "per_phase": ver.pop("per_phase"), "verification": ver}
    return out | {"lost_names": lost[:50], "problems": problems, "pass": not problems}


def _cell(v: Any) -> str:
    if isinstance(v, dict) and "n" in v:
        return " / ".join(fmt(v[f"p{q}"]) for q in (50, 90, 99)) + f" (n={v['n']})"
    return fmt(v)


def markdown_report(report: dict[str, Any]) -> str:
    phases = report.get("phases", [])
    if a := report.get("analysis"):
        verdict = "**PASS**" if a["pass"] else "**FAIL**: " + "; ".join(a["problems"])
    else:
        verdict = f"**ERROR**: {report['error']}" if "error" in report else "**not finished**"
    a = a or {}
    ver = a.get("verification") or {}
    lines = [f"# GPU load with restarts, arm {report['arm']} ({report['date']})", ""]
    lines += [f"- {k}: {report.get(k)}" for k in ("hardware", "versions", "config")]
    lines += [
        f"- elapsed {fmt(report.get('elapsed_s'))} s; {verdict}",
        f"- reference: {ver.get('reference_blocks')} prefix blocks, {ver.get('reference_variants')}"
        " (block, layer) pairs computed with more than one result (a restore may match any)",
        "",
        "| total | value |",
        "|---|---|",
        *(f"| {k} | {_cell(v)} |" for k, v in (a.get("totals") or {}).items()),
        "",
        "| phase | engine up s | load s | requests done | restored blocks verified / mismatched "
        "/ unverified / unhashed | L2 objects after kill |",
        "|---|---|---|---|---|---|",
    ]
    for m in phases:
        v = (a.get("per_phase") or {}).get(str(m["phase"]), {})
        kinds = ("verified", "mismatch", "unverified", "unhashed")
        cells = [m["phase"], m.get("engine_up_s"), load_seconds(m)]
        cells += [(m.get("load") or {}).get("completed")]
        cells += [" / ".join(str(v.get(f"{k}_blocks", 0)) for k in kinds), m.get("l2_objects")]
        lines.append("| " + " | ".join(map(fmt, cells)) + " |")
    if ver.get("mismatch_examples"):
        lines += ["", "## Mismatches (first ones)", ""]
        lines += [f"- {json.dumps(m)}" for m in ver["mismatch_examples"]]
    errs = [f"- phase {m['phase']}: {m['error'][-600:]}" for m in phases if m.get("error")]
    return "\n".join(lines + (["", "## Engine errors", "", *errs] if errs else [])) + "\n"


@dataclass
class LoadConfig:
    arm: str
    lmcache_dir: Path
    out: Path
    model: str = "olmo-r17"
    layout: str = "NHD"
    chunk_blocks: int = 1
    phases: int = 5
    phase_s: float = 60.0  # seconds of load per phase, from the engine's readiness on
    concurrency: int = 64
    kv_cache_gib: float = 8.0
    gpu_memory_utilization: float = 0.25
    l1_size_gb: float = 8.0
    engine_timeout: float = ENGINE_TIMEOUT_S
    keep_l2: bool = False
    workload: Workload = field(default_factory=Workload)
    work: Path = field(default_factory=lambda: Path("/tmp/hybridfa-load"))
    python: str = sys.executable

    @property
    def case(self) -> Case:
        return Case(self.model, self.layout, self.chunk_blocks, exact=False)

    @property
    def pool(self) -> list[PoolEntry]:
        return make_pool(self.workload, self.case.chunk)


def phase_spec(cfg: LoadConfig, model_dir: Path, port: int, phase: int, wd: Path) -> dict:
    case, w = cfg.case, cfg.workload
    n, pool = case.geometry.block_size, cfg.pool
    kv = int(cfg.kv_cache_gib * 2**30) if cfg.kv_cache_gib else None
    rc = RunConfig(cfg.arm, cfg.lmcache_dir, cfg.out, cfg.python, kv_cache_memory_bytes=kv)
    rc.gpu_memory_utilization = cfg.gpu_memory_utilization
    spec = engine_spec(case, "load", model_dir, rc, port, None)
    return spec | {
        "phase": phase,
        "pool": [list(e.tokens) for e in pool],
        "block_keys": [block_keys(e.tokens, n) for e in pool],
        "sequence": request_sequence(pool, SEQUENCE_LEN, f"{w.seed}-{phase}", w.shared_fraction),
        "concurrency": cfg.concurrency,
        "block_size": n,
        "chunk": case.chunk,
        "new_tokens": NEW_TOKENS,
        "log_stats": True,
        "max_model_len": max(len(e.tokens) for e in pool) + NEW_TOKENS + n,
        "load_s": cfg.phase_s,
        "drain_s": DRAIN_S,
        "records_path": str(wd / f"records-{phase}.jsonl"),
        "l2": str(wd / "l2"),
        "server_log": str(wd / f"server{phase}.log"),
    }


def run_phase(cfg: LoadConfig, env: dict[str, str], model_dir: Path, phase: int) -> dict:
    """One server and engine on the run's folder; the folder's files after the kill too."""
    wd = cfg.work / cfg.arm
    meta: dict[str, Any] = {"phase": phase}
    log, srv = wd / f"server{phase}.log", None
    try:
        port = free_port()
        srv = start_server(
            cfg.python, env, port, cfg.case.chunk, wd / "l2", log, l1_size_gb=cfg.l1_size_gb
        )
        spec = phase_spec(cfg, model_dir, port, phase, wd)
        # the engine's start (a fresh machine's first engine pays the JIT), load, drain and stores
        timeout = cfg.engine_timeout + cfg.phase_s + DRAIN_S + 60.0
        eng = run_engine(cfg.python, env, spec, wd, f"load{phase}", timeout)
        meta.update({k: eng.get(k) for k in ("ok", "engine_up_s", "load", "l2_wait", "rc")})
        if not eng.get("ok"):
            meta["error"] = str(eng.get("error"))[-3000:]
    except ServerError as e:
        meta["error"] = str(e)[-3000:]
    finally:
        if srv is not None:
            kill_group(srv)
    text = log.read_text(errors="replace") if log.exists() else ""
    meta["server"] = server_log_facts(text)
    inv = folder_inventory(wd / "l2", with_files=True)
    return meta | {"l2_objects": inv["objects"], "l2_bytes": inv["bytes"], "files": inv["files"]}


def run_load(cfg: LoadConfig, report: dict[str, Any], flush: Fn | None = None) -> dict[str, Any]:
    """Every phase on one L2 folder; fills ``report`` (phases, analysis) and returns it."""
    t0, case, wd = time.time(), cfg.case, cfg.work / cfg.arm
    shutil.rmtree(wd, ignore_errors=True)
    (wd / "l2").mkdir(parents=True)
    model_dir = write_model_dir(case.spec, cfg.work / "models")
    env = child_env(cfg.lmcache_dir, cfg.layout)
    phases, snapshots = report.setdefault("phases", []), []
    for phase in range(cfg.phases):
        meta = run_phase(cfg, env, model_dir, phase)
        snapshots.append(meta.pop("files"))
        phases.append(meta | {"end_s": round(time.time() - t0, 1)})
        print(f"[load] phase {phase}: ok={meta.get('ok')} objects={meta['l2_objects']}", flush=True)
        if flush:
            flush()
        if meta.get("error") and not meta.get("load"):
            break  # a phase that did not even start will not go better next time
    records = [r for k in range(len(phases)) for r in read_jsonl(wd / f"records-{k}.jsonl")]
    keys = [block_keys(e.tokens, case.geometry.block_size) for e in cfg.pool]
    report["analysis"] = analyze(phases, records, keys, snapshots)
    report["elapsed_s"] = round(time.time() - t0, 1)
    if not cfg.keep_l2:
        shutil.rmtree(wd / "l2", ignore_errors=True)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_case_args(ap, model="olmo-r17", work=Path("/tmp/hybridfa-load"), kv_cache_gib=8.0)
    ap.add_argument("--phases", type=int, default=5, help="engine + server runs on one folder")
    ap.add_argument("--phase-s", type=float, default=60.0, help="seconds of load per phase")
    ap.add_argument("--concurrency", type=int, default=64)
    a = ap.parse_args(argv)
    use_compile_cache(a)
    if a.lmcache_dir is None:
        ap.error("--lmcache-dir is required")
    args = {"phases": a.phases, "phase_s": a.phase_s, "concurrency": a.concurrency}
    cfg = LoadConfig(**case_args(a), **args)
    g, lens = cfg.case.geometry, [len(e.tokens) for e in cfg.pool]
    config = {"model": cfg.model, "layout": cfg.layout, "N": g.block_size, "chunk": cfg.case.chunk}
    config |= {**args, "pool": f"{len(lens)} prompts, {sum(lens)} tokens"}
    stem, head, problem = start_report("gpu-load", a.arm, cfg.python, cfg.lmcache_dir, a.out)
    report: Rec = {"schema": SCHEMA, **head, "config": config | {"workload": asdict(cfg.workload)}}

    def flush() -> None:
        write_json_md(stem, report, markdown_report(report))

    if problem:
        report["error"] = problem
    else:
        install_cleanup_handler()
        run_load(cfg, report, flush)
    flush()
    print(markdown_report(report))
    return 2 if problem else 0 if report["analysis"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
