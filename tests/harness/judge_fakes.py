"""Engine results as engine_proc reports them, for the judge's CPU tests."""

from __future__ import annotations

from typing import Any

from hybridfa_gate.cases import Case
from hybridfa_gate.prompts import max_promisable_hit


def hashes(fa: dict[str, str], gdn: dict[str, str], rank: int = 0, n: int = 80) -> dict:
    """One rank's KV hash report: FA layer l3, GDN layer l0, block index -> hash."""
    return {"rank": rank, "block_size": n, "fa": {"l3": fa}, "gdn": {"l0": gdn}}


def engine(tokens, lps, gen_s, cached=None, kv=None, health=True) -> dict[str, Any]:
    """A completed engine's result; ``cached``: its external (connector) hit."""
    return {
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


def restored_case(
    exact: bool, restore_ttft: float, cold_reference_ttft: float
) -> tuple[Case, dict, dict, dict]:
    """olmo-r5, NHD, chunk N: cold, store and restore engine results, the restore engine
    having restored every promisable block and cold-prefilled its own reference."""
    case = Case("olmo-r5", "NHD", 1, exact)
    kv = [hashes({"0": "a"}, {})]
    hit = max_promisable_hit(case.prompt_tokens, 80)
    cold, store = engine([5], [], 3.0), engine([5], [], 3.0, kv=kv)
    restore = {**engine([5], [], 2.0, cached=hit, kv=kv), "ttft_s": restore_ttft}
    restore["cold_reference"] = {"ttft_s": cold_reference_ttft, "num_cached_tokens": 0}
    return case, cold, store, restore
