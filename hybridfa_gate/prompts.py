"""Deterministic prompts, and how much of a prompt a hybrid connector can restore."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Sequence

from hybridfa_gate.models import VOCAB

HIT_FRACTION = 0.97  # (c): the hit must reach this fraction of the prompt ...
TOKEN_LO, TOKEN_HI = 16, VOCAB - 64  # stay clear of pad/eos and Qwen's mm token ids
KEY_LEN = 32
NEW_TOKENS = 16
MIN_PROMPT_TOKENS = 4096
# An exact-multiple prompt recomputes its whole last chunk (a hybrid connector never promises
# the last prompt token), so with 2 chunks only half is restored and (d) is decided by noise;
# 4 chunks restore 3/4.
EXACT_MIN_CHUNKS = 4
# Turn 2's question after the prompt and the model's answer (fixed ids, in the token range).
TURN2_QUESTION: tuple[int, ...] = tuple(range(TOKEN_LO + 101, TOKEN_LO + 101 + 37))


def make_prompt(length: int, seed: int, key_len: int = KEY_LEN) -> list[int]:
    """Deterministic random token ids with a key-like run (``key_len`` tokens from a narrow
    id band, like a hex key in a document) around the middle: later tokens depend on KV far
    back in the context."""
    rng = random.Random(f"hybridfa-gate-{seed}")
    toks = [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(length)]
    if length >= 4 * key_len:
        band = rng.randrange(TOKEN_LO, TOKEN_HI - 64)
        start = length // 2 - key_len // 2
        toks[start : start + key_len] = [band + rng.randrange(64) for _ in range(key_len)]
    return toks


def prompt_key(tokens: Sequence[int]) -> str:
    """Key the worker-side hook uses to find a request's block table (ids are opaque)."""
    return f"{len(tokens)}:" + ",".join(str(t) for t in tokens[:16])


def prompt_length(block: int, chunk: int, exact: bool, min_tokens: int = MIN_PROMPT_TOKENS) -> int:
    """A case's prompt length. exact: a multiple of the chunk (full-hit case). Otherwise m*C + r,
    r in the middle of a block and m large enough that the chunk-aligned hit floor((P-1)/C)*C
    = m*C is at least HIT_FRACTION of P."""
    m = max(2, math.ceil(min_tokens / chunk))
    if exact:
        return max(m, EXACT_MIN_CHUNKS) * chunk
    r = block // 2 + 7  # inside the block for every N (N >= 16)
    m = max(m, math.ceil(r * HIT_FRACTION / ((1 - HIT_FRACTION) * chunk)))
    while (m * chunk) < HIT_FRACTION * (m * chunk + r):
        m += 1
    return m * chunk + r


def max_promisable_hit(prompt_tokens: int, chunk: int) -> int:
    """Largest chunk boundary strictly before the last prompt token."""
    return (prompt_tokens - 1) // chunk * chunk


def required_hit(prompt_tokens: int, chunk: int, promisable: int | None = None) -> int:
    """(c)'s bar: HIT_FRACTION of the prompt, or the most a hybrid connector can promise
    (``promisable``; by default the chunks before the last prompt token)."""
    if promisable is None:
        promisable = max_promisable_hit(prompt_tokens, chunk)
    return min(math.ceil(HIT_FRACTION * prompt_tokens), promisable)


def median(values: Iterable[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None
