"""Engine results as engine_proc reports them, for the judge's CPU tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridfa_gate.cases import Case
from hybridfa_gate.prompts import max_promisable_hit
from hybridfa_gate.specs import D_REPEATS


def hashes(fa: dict[str, str], gdn: dict[str, str], rank: int = 0, n: int = 80) -> dict:
    """One rank's KV hash report: FA layer l3, GDN layer l0, block index -> hash."""
    return {"rank": rank, "block_size": n, "fa": {"l3": fa}, "gdn": {"l0": gdn}}


def timed_pairs(restores: Sequence[float], colds: Sequence[float], hit: int) -> list[dict]:
    """A restore engine's (d) pairs: TTFTs of restores of ``hit`` tokens and of cold prefills."""
    return [
        {"restore": {"ttft_s": r, "num_cached_tokens": hit}, "cold": {"ttft_s": c}}
        for r, c in zip(restores, colds, strict=True)
    ]


def engine(tokens, lps, gen_s, cached=None, kv=None, health=True) -> dict[str, Any]:
    """A completed engine's result; ``cached``: its external (connector) hit. A restore (a
    hit) times D_REPEATS pairs too: restores of ``gen_s``, cold prefills twice as long."""
    out = {
        "ok": True,
        "tokens": tokens,
        "logprobs": lps,
        "gen_s": gen_s,
        "ttft_s": gen_s,
        "num_cached_tokens": cached,
        "external_cached_tokens": cached,
        "local_cached_tokens": 0,
        "kv_hashes": kv,
        "weights_fingerprint": "w",
        "geometry": {"block_size": 80, "kernel_page": 16, "ratio": 5},
        "observed_layout": "NHD",
        "health": {"ok": health, "tokens": [1, 2]},
    }
    if cached:
        out["timed_pairs"] = timed_pairs([gen_s] * D_REPEATS, [2 * gen_s] * D_REPEATS, cached)
    return out


def restored_case(
    exact: bool, restores: Sequence[float], colds: Sequence[float]
) -> tuple[Case, dict, dict, dict]:
    """olmo-r5, NHD, chunk N: cold, store and restore engine results, the restore engine
    having restored every promisable block and timed (d)'s pairs: ``restores`` and
    ``colds``."""
    case = Case("olmo-r5", "NHD", 1, exact)
    kv = [hashes({"0": "a"}, {})]
    hit = max_promisable_hit(case.prompt_tokens, 80)
    cold, store = engine([5], [], 3.0), engine([5], [], 3.0, kv=kv)
    restore = engine([5], [], 2.0, cached=hit, kv=kv)
    restore["timed_pairs"] = timed_pairs(restores, colds, hit)
    return case, cold, store, restore
