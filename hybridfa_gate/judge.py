"""The gate's criteria, defined here once, and the verdicts from the engines' results.

A case stores a prompt (the store engine with LMCache server 1), kills both, starts server 2
on the same L2 tier and restores the prompt in a fresh engine (the restore engine); a cold
engine without LMCache computes the same prompt. A case passes when

(a) bytes: the KV bytes of every prompt block after the restore equal the storing engine's
    (FA: every block, by token slot; GDN: the align-mode checkpoints both engines hold, each
    as it stood on the step after it was complete, which must include the restored one,
    block hit/N - 1, kept on the request's second step: ``worker.rpc_watch_checkpoints``);
(b) output: greedy tokens are equal and top-k logprobs within ``LOGPROB_TOL``;
(c) hit: the connector's (external) hit is >= min(97 % of the prompt, the most a hybrid
    connector can promise: the chunks before the last prompt token, floor((P-1)/C)*C, under
    MTP a block less; ``cases.Case.promisable_hit``);
(d) speed: restore TTFT < cold prefill TTFT, medians of ``specs.D_REPEATS`` each, timed in
    turn in the restore engine after the measured request (other stored, resp. unstored,
    prompts of the same length; none watched by the gate, whose copies of the measured
    request's checkpoints and timing of its lookups would count against it) while no other
    case on the machine times its own (``engine_proc.timing_turn``);
(e) health: a further request completes in the restore engine, with the tokens the cold engine
    gives it.

A turn-2 case (a chat's second turn) compares (a) and (b) with vLLM's own prefix cache (the
cold engine ran turn 1, then turn 2), not with the store engine, and (c)'s promise is at most
what that prefix cache served, cut to a chunk: a connector stores only the recurrent states
vLLM keeps (vLLM 0.26-0.28 keep turn 1's decode-time block boundaries; 0.29 keeps them only
under EAGLE/MTP, its dense default there, and otherwise the prompt's last boundary).

Where the right answer is a miss, a case is judged by the criteria that apply to its mode
(``cases.Case.mode``):

- refused: the patched server refuses the layout (a hybrid layout on an fs_native tier, or
  any layout where LMCache's compiled copy kernels did not load): (b) against the store
  engine, (c) no external hit, (e); (a) and (d) do not apply;
- miss: a kv_cache_dtype change across the restart (the stored bytes mean other values):
  (b) against the cold engine, which runs the restore's dtype, (c) no external hit, (e);
- forged: one FA object of the hit rewritten after the store (``forge.py``): (a), (b),
  (c) fewer hit tokens than the promise (a miss from the forged chunk on), (e); then server
  and engine restart once more and restore again, judged by (a), (b) against the cold engine,
  (c) and (e) as ``judge_restart`` says: the forged bytes must not come back.

A LoRA case judges adapter A's request by (a)-(e) and adds adapter B's request on the same
prompt to (a)-(c): "other" (only A was stored) B restores nothing and (b) compares it with the
cold engine's B; "each" (both were stored) B restores its own KV, (a)-(c) against the store
engine's B.

Any error (an engine that failed, a geometry other than expected, a KV layout other than the
case's, weights that differ across restarts, a store engine whose tokens differ from the cold
engine's where both run the same settings, failed stores, an L2 tier that did not settle)
fails the case.

The pristine and control arms pass when every case completes and shows the bug
(``pristine_shows_the_bug``): it fails (a) by comparison (a case that restored nothing never
exercised (a)); a case of another mode or a LoRA case fails any of its criteria.
"""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from hybridfa_gate.cases import DEFAULT_BASE, Case, release, select_cases
from hybridfa_gate.l2 import STORE_FAILED
from hybridfa_gate.procs import REFUSAL
from hybridfa_gate.prompts import median, required_hit

LOGPROB_TOL = 1e-3
Result = dict[str, Any] | None  # an engine_proc result, None for an engine that did not run


def engine_error(role: str, result: dict[str, Any] | None) -> str:
    """Why an engine has no result, in one line: the exception a traceback ends in, not its
    frames (the engine's record keeps the traceback)."""
    error = str((result or {}).get("error", "no result"))
    head, found, frames = error.partition("Traceback (most recent call last):")
    if found:
        lines = [ln.strip() for ln in frames.splitlines() if ln.strip()]
        error = head + next((ln for ln in reversed(lines) if not ln.startswith("^")), "")
    return f"{role}: {error}"[:2000]


def compare_logprobs(
    a: Sequence[dict[str, float]], b: Sequence[dict[str, float]], tol: float = LOGPROB_TOL
) -> tuple[bool, float]:
    """Per step: same top-k token ids and |logprob diff| <= tol. Returns (ok, max diff)."""
    if len(a) != len(b) or any(set(sa) != set(sb) for sa, sb in zip(a, b, strict=True)):
        return False, math.inf
    steps = zip(a, b, strict=True)
    worst = max((abs(lp - sb[t]) for sa, sb in steps for t, lp in sa.items()), default=0.0)
    return worst <= tol, worst


def _ranks(hashes: Sequence[dict[str, Any]] | None) -> dict[int, dict[str, Any]]:
    return {int(h["rank"]): h for h in (hashes or [])}


def compare_kv_hashes(
    store: Sequence[dict[str, Any]] | None,
    restore: Sequence[dict[str, Any]] | None,
    hit_tokens: int,
) -> dict[str, Any]:
    """Criterion (a), over one report per TP rank from engine_proc's ``_rpc_kv_hashes``
    ({"rank", "block_size", "fa": {layer: {block index: hash}}, "gdn": {...}}). FA: every
    prompt block the storing engine hashed must be equal after the restore. GDN: only the
    checkpoints both engines hold compare (a restored request holds null blocks below its
    hit); they must be equal and include the restored one, block hit/N - 1."""
    res: dict[str, Any] = dict.fromkeys(("fa_blocks", "fa_bad", "gdn_blocks", "gdn_bad"), 0)
    res.update(gdn_hit_block_checked=hit_tokens <= 0, mismatches=[], problems=[])
    s_ranks, r_ranks = _ranks(store), _ranks(restore)
    if not s_ranks or set(s_ranks) != set(r_ranks):
        res["problems"].append(f"ranks differ: {sorted(s_ranks)} vs {sorted(r_ranks)}")
    for rank, s in sorted(s_ranks.items()):
        r = r_ranks.get(rank, {})
        n = int(s.get("block_size") or 0)
        hit_block = str(hit_tokens // n - 1) if n and hit_tokens >= n else None
        for layer, blocks in sorted(s.get("fa", {}).items()):
            got = r.get("fa", {}).get(layer, {})
            for j, h in blocks.items():
                res["fa_blocks"] += 1
                if got.get(j) != h:
                    res["fa_bad"] += 1
                    res["mismatches"].append(f"rank{rank} fa {layer} block {j}")
        for layer, blocks in sorted(s.get("gdn", {}).items()):
            got = r.get("gdn", {}).get(layer, {})
            for j in sorted(set(blocks) & set(got), key=int):
                res["gdn_blocks"] += 1
                if hit_block is not None and j == hit_block:
                    res["gdn_hit_block_checked"] = True
                if got[j] != blocks[j]:
                    res["gdn_bad"] += 1
                    res["mismatches"].append(f"rank{rank} gdn {layer} block {j}")
    if res["fa_blocks"] == 0:
        res["problems"].append("no FA blocks hashed")
    if not res["gdn_hit_block_checked"]:
        res["problems"].append("restored GDN checkpoint (block hit/N-1) not comparable")
    res["match"] = not res["problems"] and res["fa_bad"] == 0 and res["gdn_bad"] == 0
    return {**res, "mismatches": res["mismatches"][:8]}


def connector_hit(result: dict[str, Any]) -> tuple[int, int]:
    """(external, local) prompt tokens of an engine's measured request: the KV connector's
    hit and vLLM's own prefix cache's."""
    ext, local = (result.get(f"{k}_cached_tokens") for k in ("external", "local"))
    return int(ext or 0), int(local or 0)


def _timed_ttft(timed: dict[str, Any] | None, restored: bool) -> float | None:
    """TTFT of a timed request meant to restore (``restored``) or to be cold; None if it
    restored nothing, resp. hit any cache."""
    timed = timed or {}
    if timed.get("ttft_s") is None or bool(timed.get("num_cached_tokens")) != restored:
        return None
    return float(timed["ttft_s"])


def d_timings(restore: dict[str, Any]) -> tuple[list[float], list[float], list[str]]:
    """The restore engine's TTFTs that (d) compares, of its ``timed_pairs``: each restore of a
    stored prompt and each cold prefill of an unstored one, none of them the measured
    request (the gate watches that one: its time includes the gate's own work); plus
    problems (a repeat that missed or hit a cache)."""
    restores: list[float] = []
    colds: list[float] = []
    problems = []
    for i, pair in enumerate(restore.get("timed_pairs") or [], 1):
        if (t := _timed_ttft(pair.get("restore"), True)) is None:
            problems.append(f"repeat {i}: its restore restored nothing")
        else:
            restores.append(t)
        if (t := _timed_ttft(pair.get("cold"), False)) is None:
            problems.append(f"repeat {i}: its cold prefill hit a cache")
        else:
            colds.append(t)
    return restores, colds, problems


def judge_c(out: dict[str, Any], case: Case, mode: str = "restore") -> None:
    """(c): a miss for "refused" and "miss"; for "forged" fewer tokens than the promise;
    otherwise the hit against ``Case.promisable_hit``, for turn 2 at most vLLM's own
    prefix-cache hit cut to a chunk (under MTP, decode steps of 1 + K tokens skip block
    boundaries; vLLM 0.29+ keeps decode-time boundary states only under EAGLE/MTP)."""
    promise, own = case.promisable_hit, out.get("reference_prefix_cache_hit")
    if case.turn == 2:
        promise = min(promise, own // case.chunk * case.chunk) if own else 0
        if not own:
            out["errors"].append("vLLM's own prefix cache hit nothing on turn 2: no bound for (c)")
    out["required_hit"] = required_hit(out["prompt_tokens"], case.chunk, promise)
    hit = out["hit_tokens"]
    if mode in ("refused", "miss"):
        out["c"] = hit == 0
    elif mode == "forged":
        out["c"] = hit < promise
    else:
        out["c"] = hit > 0 and hit >= out["required_hit"]
    out["c"] = out["c"] and _also(out, "c")


# A case's further requests, each judged by some of the criteria: adapter B's request of a
# LoRA case, a forged case's restore after a second restart.
FURTHER = ("lora_b", "restart")


def _also(out: dict[str, Any], criterion: str) -> bool:
    """Whether every further request of the case meets ``criterion`` where it is judged by it."""
    return all(out[k].get(criterion, True) for k in FURTHER if out.get(k) is not None)


JUDGED = {"restore": "abcde", "refused": "bce", "miss": "bce", "forged": "abce"}


def passes(ev: dict[str, Any]) -> bool:
    """No error and every criterion of the case's mode."""
    judged = ev.get("judged") or ("bce" if ev.get("refused") else "abcde")
    return not ev["errors"] and all(ev[k] for k in judged)


def _check_output(out: dict[str, Any], ref: dict[str, Any], got: dict[str, Any]) -> bool:
    lp_ok, lp_diff = compare_logprobs(ref.get("logprobs") or [], got.get("logprobs") or [])
    out.update(tokens_match=ref.get("tokens") == got.get("tokens"), logprobs_match=lp_ok)
    out["logprob_max_diff"] = lp_diff
    return bool(out["tokens_match"] and lp_ok)


def judge_lora_b(
    case: Case,
    cold: dict[str, Any],
    store: dict[str, Any],
    restore: dict[str, Any],
    refused: bool = False,
) -> dict[str, Any]:
    """Adapter B's request after A's on the same prompt in the restore engine: "other", B was
    never stored and must restore nothing, with the cold engine's output; "each", B restores
    its own KV: the store engine's bytes and output, the hit bar of (c). ``refused``: the
    server refused the layout, so B restores nothing either way."""
    got = restore.get("second") or {}
    ref = (store if case.lora == "each" else cold).get("second") or {}
    out: dict[str, Any] = {"errors": []}
    if not got or not ref:
        out["errors"].append("adapter B's request did not run in every engine")
        return {**out, "a": False, "b": False, "c": False}
    hit, local = connector_hit(got)
    out.update(hit_tokens=hit, local_hit_tokens=local)
    out["b"] = _check_output(out, ref, got)
    if case.lora == "other" or refused:
        out.update(a=True, c=hit == 0)
        return out
    kv = compare_kv_hashes(ref.get("kv_hashes"), got.get("kv_hashes"), hit)
    bar = required_hit(case.prompt_tokens, case.chunk, case.promisable_hit)
    out.update(a=bool(kv["match"]) and hit > 0, c=hit >= bar and hit > 0, kv=kv)
    return out


def judge_restart(
    case: Case, cold: dict[str, Any], store: dict[str, Any], restart: Result, forged_kept: bool
) -> dict[str, Any]:
    """A forged case's restore after a second restart of server and engine, on the tier as the
    first restore left it. Where the forged payload is still in its file (``forged_kept``),
    (c) a miss from its chunk on, as the first time; where the server replaced that file, (c)
    the hit bar of a restore. Either way (a) every KV byte is the storing engine's, restored
    or recomputed, (b) the tokens and logprobs are the cold engine's and (e) a further request
    completes with the cold engine's tokens: the forged bytes never come back, whatever tag a
    server wrote beside them."""
    out: dict[str, Any] = {"errors": [], "forged_kept": forged_kept}
    if not restart or not restart.get("ok"):
        out["errors"].append(engine_error("restart", restart))
        return {**out, "a": False, "b": False, "c": False, "e": False}
    out["errors"] += layout_errors(case, {"restart": restart})
    out["errors"] += graph_errors(case, {"restart": restart})
    if restart.get("weights_fingerprint") != store.get("weights_fingerprint"):
        out["errors"].append("restart: its weights differ from the storing engine's")
    hit, local = connector_hit(restart)
    if local:
        out["errors"].append(f"restart: the engine's own prefix cache served {local} tokens")
    kv = compare_kv_hashes(store.get("kv_hashes"), restart.get("kv_hashes"), hit)
    out.update(hit_tokens=hit, kv=kv, a=bool(kv["match"]))
    out["b"] = _check_output(out, cold, restart)
    if forged_kept:
        out["c"] = hit < case.promisable_hit
    else:
        bar = required_hit(case.prompt_tokens, case.chunk, case.promisable_hit)
        out["c"] = hit > 0 and hit >= bar
    health = restart.get("health") or {}
    cold_health = (cold.get("health") or {}).get("tokens")
    out["e"] = bool(health.get("ok")) and health.get("tokens") == cold_health
    return out


# The KV cache layout vLLM 0.29+ resolves for VLLM_KV_CACHE_LAYOUT=NHD or HND.
RESOLVED_LAYOUTS = {"NHD": "LBNHC", "HND": "LBHNC"}
RESOLVED_LAYOUT_SINCE = (0, 29)  # CacheConfig.kv_cache_layout


def layout_errors(case: Case, engines: dict[str, dict[str, Any]]) -> list[str]:
    """Each engine's KV layout must be the case's, as the engine shows it: the memory order of
    its FA cache (``worker.hash_blocks``; required where a rank holds more than one kv head,
    which the order needs to tell) and, from vLLM 0.29, the layout vLLM resolved
    (``CacheConfig.kv_cache_layout``; required where the engine's vLLM has it)."""
    errors = []
    tells = case.spec.num_kv_heads // case.tp > 1
    want = RESOLVED_LAYOUTS[case.layout]
    for role, r in engines.items():
        seen = r.get("observed_layout")
        if seen != case.layout and (seen is not None or tells):
            errors.append(f"{role}: its FA cache is laid out {seen}, not {case.layout}")
        resolved = r.get("kv_cache_layout")
        has_field = (release(r.get("vllm")) or ()) >= RESOLVED_LAYOUT_SINCE
        if resolved != want and (resolved is not None or has_field):
            errors.append(
                f"{role}: vLLM resolved the KV layout {resolved}, not {want} ({case.layout})"
            )
    return errors


def cudagraph_mode(result: dict[str, Any] | None) -> str | None:
    """The CUDA-graph mode an engine ran with (``engine_proc.resolved_compilation``): its
    first worker's model runner's, else its config's; None where it reported none."""
    comp = (result or {}).get("compilation") or {}
    workers = comp.get("workers") or [{}]
    return workers[0].get("cudagraph_mode") or comp.get("cudagraph_mode")


def graph_errors(case: Case, engines: dict[str, dict[str, Any]]) -> list[str]:
    """A graphs case's engines must have run CUDA graphs (a mode other than NONE) and an
    eager case's none; a graphs case's engine that reported no mode is an error too."""
    asked = "CUDA graphs" if case.graphs else "eager"
    errors = []
    for role, r in engines.items():
        mode = cudagraph_mode(r)
        if mode is None and case.graphs:
            errors.append(f"{role}: reported no CUDA-graph mode; the case asked for CUDA graphs")
        elif mode is not None and (mode != "NONE") != case.graphs:
            errors.append(f"{role}: vLLM resolved CUDA-graph mode {mode}; the case asked {asked}")
    return errors


def evaluate_case(
    case: Case,
    cold: Result,
    store: Result,
    restore: Result,
    arm: str = "patched",
    base: str = DEFAULT_BASE,
    kernels: bool = True,
    restart: Result = None,
    forged_kept: bool = True,
) -> dict[str, Any]:
    """The criteria of the case's mode on ``arm`` of ``base`` (``kernels``: whether its
    compiled copy kernels load) plus validity checks, from the three engines' results; for a
    forged case also from the restore after a second restart (``restart``; ``forged_kept``:
    whether the forged payload was still in its file then, ``judge_restart``)."""
    mode = case.mode(arm, base, kernels)
    out: dict[str, Any] = {"errors": [], "refused": mode == "refused", "mode": mode}
    out["judged"] = JUDGED[mode]
    for role, r in (("cold", cold), ("store", store), ("restore", restore)):
        if not r or not r.get("ok"):
            out["errors"].append(engine_error(role, r))
    if out["errors"]:
        return {**out, "completed": False, "pass": False}
    assert cold is not None and store is not None and restore is not None
    out["completed"] = True
    geo = case.geometry
    observed = restore.get("geometry") or {}
    out["observed_geometry"] = observed
    engines = {"cold": cold, "store": store, "restore": restore}
    seen = (observed.get("block_size"), observed.get("kernel_page"))
    if seen != (geo.block_size, geo.kernel_page):
        out["errors"].append(f"geometry {observed} != expected {asdict(geo)}")
    fps = {r.get("weights_fingerprint") for r in engines.values()}
    if len(fps) != 1 or None in fps:
        out["errors"].append(f"weights differ across restarts: {sorted(map(str, fps))}")
    out["errors"] += layout_errors(case, engines) + graph_errors(case, engines)

    # The reference for (a) and (b): the storing engine's own prompt; for turn 2, vLLM's
    # own prefix cache (the cold engine ran turn 1, then turn 2); after a dtype change, the
    # cold engine (it runs the restore's dtype).
    reference = store if case.turn == 1 else (cold.get("turn2") or {})
    if mode == "miss":
        reference = cold
    if case.turn == 2 and not reference.get("kv_hashes"):
        out["errors"].append("the reference engine did not run turn 2")
    p = case.prompt_tokens if case.turn == 1 else case.turn2_prompt_tokens
    hit, local = connector_hit(restore)
    if local:
        why = "the restore was not a fresh engine's"
        out["errors"].append(f"the restore engine's own prefix cache served {local} tokens: {why}")
    if case.turn == 2:
        _, ref_local = connector_hit(reference)
        out["reference_prefix_cache_hit"] = ref_local
    restore_runs, cold_runs, timing_problems = d_timings(restore)
    if mode == "restore":  # elsewhere the repeats miss too, or (d) does not apply
        out["errors"] += timing_problems
    kv = compare_kv_hashes(reference.get("kv_hashes"), restore.get("kv_hashes"), hit)
    ranks = len(_ranks(reference.get("kv_hashes")))
    if ranks != case.tp:
        kv["problems"].append(f"KV hashes from {ranks} rank(s), expected {case.tp}")
        kv["match"] = False
    lp_ok, lp_diff = compare_logprobs(reference.get("logprobs") or [], restore["logprobs"])
    health = restore.get("health", {})
    out.update(
        prompt_tokens=p,
        hit_tokens=hit,
        hit_pct=round(100.0 * hit / p, 2),
        restore_s=median(restore_runs),
        restore_runs_s=restore_runs,
        measured_restore_s=restore.get("ttft_s"),
        cold_s=cold.get("ttft_s"),
        cold_same_engine_s=median(cold_runs),
        cold_same_engine_runs_s=cold_runs,
        first_restore_s=_timed_ttft((restore.get("warm_first") or {}).get("restore"), True),
        kv=kv,
        bytes_match=kv["match"],
        tokens_match=reference.get("tokens") == restore["tokens"],
        logprobs_match=lp_ok,
        logprob_max_diff=lp_diff,
        health_ok=bool(health.get("ok")),
        health_matches_cold=health.get("tokens") == cold.get("health", {}).get("tokens"),
    )
    # The cold and store engines compute the same prompt, save a dtype change's.
    if mode == "miss":
        out["info"] = {"cold_tokens_match_store": cold["tokens"] == store["tokens"]}
    elif cold["tokens"] != store["tokens"]:
        out["errors"].append("the store engine's tokens differ from the cold engine's")
    if case.lora:
        out["lora_b"] = second = judge_lora_b(case, cold, store, restore, mode == "refused")
        out["errors"] += second.pop("errors")
    if mode == "forged":
        out["restart"] = again = judge_restart(case, cold, store, restart, forged_kept)
        out["errors"] += again.pop("errors")
    judge_c(out, case, mode)
    out["e"] = out["health_ok"] and out["health_matches_cold"] and _also(out, "e")
    out["b"] = out["tokens_match"] and lp_ok and _also(out, "b")
    if mode in ("refused", "miss"):
        out.update(a=None, d=None)
        out["pass"] = passes(out)
        return out
    if hit == 0 and mode == "restore":
        # Nothing was restored: equal bytes and tokens would only show that a recompute
        # is deterministic, so (a) says nothing -- for either arm.
        out["errors"].append(
            "no external hit: nothing was restored from L2, (a) and (b) prove nothing"
        )
        out["bytes_match"] = kv["match"] = None
    out["a"] = bool(kv["match"]) and _also(out, "a")
    # (d) against the cold prefills timed in the restore engine itself, interleaved with its
    # restores and under the same load (medians of each side); the separate cold engine ran
    # at another time, its TTFT is only reported.
    baseline = out["cold_same_engine_s"]
    d = out["restore_s"] is not None and baseline is not None and out["restore_s"] < baseline
    out["d"] = d if mode == "restore" else None
    out["pass"] = passes(out)
    return out


def run_errors(rec: dict[str, Any]) -> list[str]:
    """Errors of a case's run outside its engines (stores, the L2 tier, the servers)."""
    errors = []
    failed = (rec.get("server1") or {}).get("store_failures")
    if failed:
        errors.append(f"server: {failed} stores failed ({STORE_FAILED!r} in server1.log)")
    l2 = rec.get("l2_after_store")
    if l2 is not None and not l2.get("stable"):
        errors.append(f"the L2 folder did not settle after the store ({l2.get('objects')} objects)")
    if rec.get("server_error"):
        errors.append(rec["server_error"][-1500:])
    if rec.get("forge_error"):
        errors.append(rec["forge_error"])
    if rec.get("expect_refusal"):
        if not (rec.get("server1") or {}).get("refusals"):
            errors.append(f"the server did not log its refusal ({REFUSAL.pattern!r})")
        if (rec.get("l2_after_kill") or {}).get("objects"):
            errors.append("the server stored objects of a layout it refused")
    return errors


def add_errors(ev: dict[str, Any], errors: Sequence[str]) -> dict[str, Any]:
    ev["errors"] = [*ev.get("errors", []), *errors]
    ev["pass"] = bool(ev.get("pass")) and not ev["errors"]
    return ev


def pristine_shows_the_bug(ev: dict[str, Any]) -> tuple[bool, str]:
    """Whether a pristine (or control) case shows the bug, and why not otherwise: a restore
    case must fail (a) by comparison (one that restored nothing never exercised (a)); a case
    of another mode, or a LoRA case, any criterion it is judged by."""
    if ev.get("mode", "restore") != "restore" or ev.get("lora_b") is not None:
        failed = [k for k in ev.get("judged") or "abcde" if ev.get(k) is False]
        if failed:
            return True, "fails " + " ".join(f"({k})" for k in failed)
        return False, "pristine passes this case: it cannot tell pristine from the fix"
    if ev.get("bytes_match") is False:
        return True, "restored KV bytes differ"
    if ev.get("bytes_match") is None:
        return False, (
            "pristine restored nothing (no external hit), so (a) was never exercised; "
            "under HND pristine's stores crash, on resp its recurrent objects never reach "
            "Redis: run the control arm (docs/gpu-node.md)"
        )
    return False, "pristine restored identical KV bytes: the gate cannot see the bug"


def verdict(ev: dict[str, Any]) -> str:
    """pass | refused | fails (x) (y) | error: which of the criteria a-e a case missed."""
    if not ev.get("completed"):
        return "error"
    if ev.get("pass"):
        if ev.get("refused"):
            return "refused (a miss)"
        return "pass (a miss)" if ev.get("mode") == "miss" else "pass"
    return "fails " + " ".join(f"({k})" for k in "abcde" if ev.get(k) is False)


def gate_problems(report: dict[str, Any], arm: str) -> list[str]:
    """Why a gate report does not pass for ``arm``: patched, every selected case ran and passed
    its criteria; pristine and control, every case ran and showed the bug."""
    if report.get("error"):
        return [str(report["error"])]
    cases = report.get("cases") or []
    if not cases:
        return ["no case ran"]
    problems = [
        f"{c}: did not run" for c in sorted(set(report["selected"]) - {r["case"] for r in cases})
    ]
    for rec in cases:
        ev = rec["eval"]
        if not ev.get("completed"):
            problems.append(f"{rec['case']}: {ev.get('errors')}")
        elif arm == "patched":
            if not ev.get("pass"):
                problems.append(f"{rec['case']}: {verdict(ev)} errors={ev.get('errors')}")
        else:
            shown, why = pristine_shows_the_bug(ev)
            if not shown:
                problems.append(f"{rec['case']}: {why}")
    return problems


def rejudge(report: dict[str, Any]) -> dict[str, Any]:
    """A stored report judged again: (c) by today's ``judge_c``, (a) (b) (d) (e) as recorded
    (a report keeps no KV hashes), less the engines' results. tests/harness proves that every
    committed report in results/ keeps its verdicts."""
    for rec in report["cases"]:
        ev, _ = rec["eval"], rec.pop("engines", None)
        if not ev.get("completed"):
            continue
        case = select_cases(rec["case"], rec.get("tp", 1))[0]
        mode = ev.get("mode") or ("refused" if ev.get("refused") else "restore")
        ev["recorded"] = {k: ev[k] for k in ("required_hit", "c", "pass")}
        judge_c(ev, case, mode)
        ev["pass"] = passes(ev)
    report["rejudged"] = _dt.datetime.now().strftime("%Y-%m-%dT%H%M%S")
    return report
