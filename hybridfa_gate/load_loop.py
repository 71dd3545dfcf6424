"""The load run's request loop, which the engine process (``engine_proc``, role ``load``) runs
inside its engine: standard library only. The run around it is ``load.py``."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

REF_COPIES = 2  # times an engine hashes a computed prefix block (batches may differ)
Rec = dict[str, Any]
Fn = Callable[..., Any]


def blocks_to_hash(
    p: int, n: int, chunk: int, local: int, external: int, keys: list[str], hashed: Counter[str]
) -> tuple[list[int], list[int]]:
    """Prompt block indices to hash at a request's first token: (verify, reference).

    verify: the blocks LMCache restored, [local, local + external) / N. reference: blocks
    this request computed in complete chunks (only those are stored), while this engine has
    hashed that prefix block fewer than REF_COPIES times."""
    verify = list(range(local // n, min((local + external) // n, p // n))) if external else []
    computed = range((local + external) // n, min(p // chunk * chunk // n, len(keys)))
    return verify, [j for j in computed if hashed[keys[j]] < REF_COPIES]


def load_loop(
    submit: Fn, step: Fn, hash_rpc: Fn, prefill: dict, spec: Rec, emit: Fn, clock: Fn = time.time
) -> Rec:
    """Keep ``concurrency`` requests from ``pool`` (in ``sequence`` order) in flight until
    ``stop_admitting_epoch``, then drain until ``end_epoch``; ``submit(id, tokens)`` adds one
    (returning the engine's id), ``step()`` runs the engine. At a request's first token its
    restored and newly computed prefix blocks are hashed (``blocks_to_hash``); its record is
    emitted when it finishes."""
    pool, keys, seq, phase = spec["pool"], spec["block_keys"], spec["sequence"], spec["phase"]
    hashed: Counter[str] = Counter()
    inflight: dict[str, dict[str, Any]] = {}
    s: Counter[str] = Counter(admitted=0, completed=0, hash_errors=0, no_prefill_stats=0)
    start = clock()

    def at_first_token(r: dict[str, Any]) -> None:
        r["local"], r["external"] = local, ext = prefill.pop(r["rid"], (None, None))
        s["first_tokens"] += 1
        if ext is None:
            s["no_prefill_stats"] += 1
            return
        k = keys[r["pool"]]
        verify, ref = blocks_to_hash(
            r["P"], spec["block_size"], spec["chunk"], local, ext, k, hashed
        )
        r.update(verify=verify, ref=ref)
        t0 = time.perf_counter()
        try:
            if verify or ref:
                r["hashes"] = list(hash_rpc(r["rid"], r["P"], sorted({*verify, *ref})))
                hashed.update(k[j] for j in ref)
        except Exception as e:  # noqa: BLE001 - recorded, the request still counts
            r["hash_error"] = f"{type(e).__name__}: {e}"[:500]
            s["hash_errors"] += 1
        s["hash_s"] += time.perf_counter() - t0

    while clock() < spec["end_epoch"]:
        while len(inflight) < spec["concurrency"] and clock() < spec["stop_admitting_epoch"]:
            i, idx = s["admitted"], seq[s["admitted"] % len(seq)]
            ext = f"{phase}-{i}"
            inflight[ext] = {"phase": phase, "seq": i, "pool": idx, "P": len(pool[idx])}
            inflight[ext].update(rid=submit(ext, pool[idx]), t_add=clock())
            s["admitted"] += 1
        if not inflight:
            break
        for ro in step():
            r = inflight.get(ro.request_id)
            toks = ro.outputs[0].token_ids if r and ro.outputs else []
            if r and "t_first" not in r and len(toks) > 0:
                r["t_first"] = clock()
                at_first_token(r)
            if r and ro.finished:
                ttft = getattr(getattr(ro, "metrics", None), "first_token_latency", None)
                if not (isinstance(ttft, (int, float)) and ttft > 0):  # no stats: our own clock
                    ttft = r["t_first"] - r["t_add"] if "t_first" in r else None
                del inflight[ro.request_id], r["rid"]
                emit({**r, "ttft_s": ttft, "n_out": len(toks)})
                s["completed"] += 1
    end = clock()
    return dict(s, load_start_epoch=start, load_end_epoch=end, inflight_at_end=len(inflight))
