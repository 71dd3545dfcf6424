"""Gate cases: one store -> restart -> restore setting each, and the named case sets.

Where to add a gate case:

1. A new setting of an existing dimension (another model, chunk, layout, backend, dtype):
   add a ``Case(...)`` to the case-set function below that it belongs to, or a new
   ``<name>_matrix(tp)`` function appended to ``CASE_SETS`` (its name is the selector,
   ``HYBRIDFA_GATE_CASES=<name>``).
2. A new dimension: a ``Case`` field with a default that keeps every existing case as it is,
   a ``case_id`` suffix for it (ids of committed reports must not change), the engine spec it
   changes in ``specs.py``, and, if it changes what a pass means, its ``mode`` and the judging
   in ``judge.py``.
3. A CPU test in tests/harness (``test_cases.py``, ``test_specs.py``, ``test_judge.py``) that
   the case is built and judged as meant; the GPU run is then ``--cases <id or set>``.

A case's prompt length, geometry and hit bar all follow from the fields (``prompts.py``,
``models.py``); nothing is measured to build a case.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import product

from hybridfa_gate.models import (
    MODELS,
    Geometry,
    ModelSpec,
    expected_geometry,
    fa_object_bytes,
    gdn_object_bytes,
    kv_bytes,
)
from hybridfa_gate.prompts import (
    NEW_TOKENS,
    TURN2_QUESTION,
    max_promisable_hit,
    prompt_length,
)

LORA_MODES = ("", "other", "each")
# The lmcache release a build is based on (``run.lmcache_base``): each base has its own series.
DEFAULT_BASE = "0.5.3"
# Bases whose patched build refuses a hybrid layout on an fs_native tier, or on a CUDA server
# whose compiled copy kernels did not load (both series do).
REFUSING_BASES = ("0.5.3", "0.5.6")


def release(version: object) -> tuple[int, ...] | None:
    """(0, 5, 6) of "0.5.6+hybridfa.1", (0, 29, 0) of "0.29.0"; None when unreadable."""
    parts = str(version or "").split("+")[0].split(".")[:3]
    return tuple(int(p) for p in parts) if parts and all(p.isdigit() for p in parts) else None


@dataclass(frozen=True)
class Case:
    model: str  # key of MODELS
    layout: str  # NHD | HND (VLLM_KV_CACHE_LAYOUT)
    chunk_blocks: int  # LMCache chunk = chunk_blocks * N
    exact: bool  # prompt length an exact multiple of the chunk
    tp: int = 1
    backend: str = "FLASHINFER"  # or FLASH_ATTN: no subpaging, the page is the block
    batched: str = "2N-1"  # max_num_batched_tokens: 2N-1 or N
    spec_tokens: int = 0  # MTP speculative decoding (num_speculative_tokens) in every engine
    turn: int = 1  # 2: restore a chat's second turn (prompt + the model's answer + a question)
    l2: str = "fs"  # the L2 adapter: fs | fs_native | resp (a redis-server of the case's own)
    kv_dtype: str = "auto"  # vLLM kv_cache_dtype of every engine (of the store engine below)
    # A kv_cache_dtype change across the restart: the cold and restore engines run this one,
    # so what was stored means other values; the restore must miss.
    restore_kv_dtype: str | None = None
    # Two LoRA adapters A and B of one prompt (``lora.py``): the measured request runs A; B
    # follows it in the cold and restore engines. "other": only A is stored, B must miss;
    # "each": both are stored, each restores its own KV.
    lora: str = ""
    forged: bool = False  # one FA object of the hit rewritten after the store (``forge.py``)
    separate_groups: bool = False  # `lmcache server --separate-object-groups`
    # lmcache.mp.save_decode_cache in every engine: pristine lmcache 0.5.6 stores chunks
    # completed during decode only then (0.5.3 always stores them and ignores the key).
    save_decode: bool = False
    # CUDA graphs and torch.compile in every engine, as vLLM defaults them (enforce_eager
    # off); otherwise every engine runs eager.
    graphs: bool = False

    def __post_init__(self) -> None:
        if self.lora not in LORA_MODES:
            raise ValueError(f"lora must be one of {LORA_MODES}, not {self.lora!r}")
        if self.lora and self.spec.family != "qwen3_5":
            raise ValueError("the gate's LoRA adapters are written for the Qwen3.5 family")
        if self.forged and self.l2 != "fs":
            raise ValueError("a forged object is written into an fs tier's folder")
        new = self.restore_kv_dtype
        if new is not None and kv_bytes(self.spec, new) != kv_bytes(self.spec, self.kv_dtype):
            raise ValueError("a kv_cache_dtype change must keep the element size (and so N)")

    @property
    def spec(self) -> ModelSpec:
        return MODELS[self.model]

    @property
    def geometry(self) -> Geometry:
        g = expected_geometry(self.spec, self.tp, self.spec_tokens, self.kv_dtype)
        if self.backend == "FLASH_ATTN":
            return Geometry(g.block_size, g.block_size, 1)
        return g

    @property
    def max_num_batched_tokens(self) -> int:
        n = self.geometry.block_size
        return n if self.batched == "N" else 2 * n - 1

    @property
    def chunk(self) -> int:
        return self.chunk_blocks * self.geometry.block_size

    @property
    def prompt_tokens(self) -> int:
        return prompt_length(self.geometry.block_size, self.chunk, self.exact)

    @property
    def case_id(self) -> str:
        kind = "exact" if self.exact else "offset"
        tp = f"-tp{self.tp}" if self.tp != 1 else ""
        fa = "-fa" if self.backend == "FLASH_ATTN" else ""
        mbt = "-mbtN" if self.batched == "N" else ""
        mtp = f"-mtp{self.spec_tokens}" if self.spec_tokens else ""
        turn = f"-turn{self.turn}" if self.turn != 1 else ""
        l2 = f"-{self.l2.replace('_', '')}" if self.l2 != "fs" else ""
        kv = f"-{self.kv_dtype.replace('_', '')}" if self.kv_dtype != "auto" else ""
        if self.restore_kv_dtype is not None:
            kv += f"-to-{self.restore_kv_dtype.replace('_', '')}"
        lora = f"-lora-{self.lora}" if self.lora else ""
        forged = "-forged" if self.forged else ""
        sog = "-sog" if self.separate_groups else ""
        decode = "-savedecode" if self.save_decode else ""
        graphs = "-graphs" if self.graphs else ""
        head = f"{self.model}-{self.layout}-c{self.chunk_blocks}N-{kind}"
        return f"{head}{fa}{mbt}{mtp}{turn}{l2}{kv}{lora}{forged}{sog}{decode}{graphs}{tp}"

    def mode(self, arm: str, base: str = DEFAULT_BASE, kernels: bool = True) -> str:
        """What a pass means for this case on ``arm`` of ``base`` (judge.py): "restore", the
        stored KV restored exactly; "refused", the patched server refuses the layout (an
        fs_native tier, or ``kernels`` false: LMCache's compiled copy kernels did not load),
        so the restore misses; "miss", what was stored means other values after the restart,
        so the restore misses; "forged", the restore misses from the forged object on."""
        refusing = arm == "patched" and base in REFUSING_BASES
        if refusing and (self.l2 == "fs_native" or not kernels):
            return "refused"
        if self.restore_kv_dtype is not None:
            return "miss"
        return "forged" if self.forged else "restore"

    def refused_by(self, arm: str, base: str = DEFAULT_BASE, kernels: bool = True) -> bool:
        """Whether the arm's server refuses this case's hybrid layout (the patched build
        stores nothing on an fs_native tier or without its compiled copy kernels, and its
        lookups miss)."""
        return self.mode(arm, base, kernels) == "refused"

    def kv_cache_dtype(self, role: str) -> str:
        """The engine's kv_cache_dtype: the store engine's, or after the restart's."""
        if role in ("cold", "restore") and self.restore_kv_dtype is not None:
            return self.restore_kv_dtype
        return self.kv_dtype

    @property
    def server_args(self) -> tuple[str, ...]:
        return ("--separate-object-groups",) if self.separate_groups else ()

    @property
    def fa_object_bytes(self) -> int:
        return fa_object_bytes(self.spec, self.chunk, self.tp, self.kv_dtype)

    @property
    def gdn_object_bytes(self) -> int:
        return gdn_object_bytes(self.spec, self.tp, self.kv_dtype, self.spec_tokens)

    @property
    def answer_tokens(self) -> int:
        """Tokens turn 1 generates: NEW_TOKENS, or for a turn-2 case at least two chunks,
        ending so that turn 1's KV (prompt + answer - 1 tokens) reaches N/2 tokens past a
        chunk boundary: vLLM's own prefix cache (full blocks) and a chunk-aligned restore
        then resume turn 2 from the same token (MTP: 3N/2, vLLM's hit is a block shorter)."""
        if self.turn == 1:
            return NEW_TOKENS
        n, c, p = self.geometry.block_size, self.chunk, self.prompt_tokens
        return 2 * c + (n // 2 + n * bool(self.spec_tokens) - (p - 1 + 2 * c)) % c

    @property
    def turn2_prompt_tokens(self) -> int:
        return self.prompt_tokens + self.answer_tokens + len(TURN2_QUESTION)

    @property
    def promisable_hit(self) -> int:
        """The most a hybrid connector can restore: chunks before the last prompt token,
        and for turn 2 only chunks turn 1 computed KV for (prompt + answer - 1 tokens)."""
        if self.turn == 1:
            hit = max_promisable_hit(self.prompt_tokens, self.chunk)
            if self.spec_tokens:
                # vLLM 0.26.0's _mamba_block_aligned_split backs the last cached state off a
                # block under MTP (use_eagle): the prompt's last full block has none.
                n = self.geometry.block_size
                last_state = self.prompt_tokens // n * n - n
                hit = min(hit, last_state // self.chunk * self.chunk)
            return hit
        kv = self.prompt_tokens + self.answer_tokens - 1
        turn2 = max_promisable_hit(self.turn2_prompt_tokens, self.chunk)
        return min(kv // self.chunk * self.chunk, turn2)


# --- the case sets ------------------------------------------------------------------------


def full_matrix(tp: int = 1) -> list[Case]:
    """Cartesian: 6 models x NHD/HND x chunk N/2N x exact/offset (48 cases)."""
    dims = product(MODELS, ("NHD", "HND"), (1, 2), (False, True))
    return [Case(m, lay, cb, ex, tp) for m, lay, cb, ex in dims]


def all_matrix(tp: int = 1) -> list[Case]:
    """Covering subset: per model, NHD/C=N/offset, HND/C=2N/offset, NHD/C=2N/exact."""
    kinds = (("NHD", 1, False), ("HND", 2, False), ("NHD", 2, True))
    return [Case(m, lay, cb, ex, tp) for m in MODELS for lay, cb, ex in kinds]


def core_matrix(tp: int = 1) -> list[Case]:
    """Six cases: each ratio with both layouts, both chunk sizes, exact and offset
    prompts; each model family under both layouts."""
    return [
        Case("olmo-r5", "NHD", 1, False, tp),
        Case("qwen35-r5", "HND", 2, True, tp),
        Case("qwen35-r17", "NHD", 2, False, tp),
        Case("olmo-r17", "HND", 1, True, tp),
        Case("olmo-r25", "NHD", 2, True, tp),
        Case("qwen35-r25", "HND", 1, False, tp),
    ]


def quick_matrix(tp: int = 1) -> list[Case]:
    """Three cases: the smallest subpaged geometry (r = 5), the 0.8B-like ratio 17 (HND, 2N),
    ratio 25 with a full hit."""
    return [
        Case("olmo-r5", "NHD", 1, False, tp),
        Case("qwen35-r17", "HND", 2, False, tp),
        Case("olmo-r25", "NHD", 1, True, tp),
    ]


def deploy_matrix(tp: int = 1) -> list[Case]:
    """Where Qwen3.5/3.6 deployments go beyond the core matrix: chunk 3N and 4N, batches of N,
    and the FlashAttention backend (H100/H200's default), both families and layouts."""
    fa = "FLASH_ATTN"
    return [
        Case("olmo-r5", "NHD", 3, False, tp),
        Case("qwen35-r5", "HND", 4, True, tp),
        Case("olmo-r17", "HND", 4, False, tp),
        Case("qwen35-r17", "NHD", 3, False, tp),
        Case("olmo-r5", "NHD", 1, False, tp, batched="N"),
        Case("qwen35-r17", "HND", 2, False, tp, batched="N"),
        Case("olmo-r5", "NHD", 1, False, tp, backend=fa),
        Case("olmo-r17", "HND", 2, True, tp, backend=fa),
        Case("qwen35-r5", "HND", 2, False, tp, backend=fa),
        Case("qwen35-r17", "NHD", 1, True, tp, backend=fa),
    ]


def mtp_matrix(tp: int = 1) -> list[Case]:
    """MTP speculative decoding (Qwen3.5's own MTP layer) in every engine, 1 and 2 tokens."""
    return [
        Case("qwen35-r5", "NHD", 2, False, tp, spec_tokens=1),
        Case("qwen35-r5", "HND", 1, True, tp, spec_tokens=2),
        Case("qwen35-r17", "NHD", 1, False, tp, spec_tokens=2),
        Case("qwen35-r5", "NHD", 2, False, tp, backend="FLASH_ATTN", spec_tokens=1),
    ]


def turn2_matrix(tp: int = 1) -> list[Case]:
    """A chat's second turn after a restart, against vLLM's own prefix cache."""
    return [
        Case("olmo-r5", "NHD", 2, False, tp, turn=2),
        Case("olmo-r5", "HND", 4, False, tp, turn=2),
        Case("qwen35-r5", "NHD", 1, False, tp, turn=2),
        Case("qwen35-r5", "HND", 2, False, tp, spec_tokens=1, turn=2),
        Case("olmo-r5", "NHD", 2, False, tp, backend="FLASH_ATTN", turn=2),
    ]


def l2_matrix(tp: int = 1) -> list[Case]:
    """The L2 tiers beside the Python fs adapter: resp (Redis) and fs_native."""
    return [
        Case("olmo-r5", "NHD", 1, False, tp, l2="resp"),
        Case("qwen35-r5", "HND", 2, False, tp, l2="resp"),
        Case("olmo-r5", "NHD", 2, False, tp, l2="fs_native"),
        Case("qwen35-r5", "NHD", 1, True, tp, l2="fs_native"),
    ]


def fp8_matrix(tp: int = 1) -> list[Case]:
    """An fp8 KV cache (1 byte per element: N about twice the bf16 one) on FlashInfer and
    FlashAttention (fp8_e4m3 only there, FA3 on SM90), NHD and HND."""
    e4m3, e5m2, fa = "fp8_e4m3", "fp8_e5m2", "FLASH_ATTN"
    return [
        Case("qwen35-r5", "NHD", 1, False, tp, kv_dtype=e4m3),
        Case("olmo-r17", "HND", 2, True, tp, kv_dtype=e4m3),
        Case("qwen35-r17", "HND", 1, False, tp, kv_dtype=e5m2),
        Case("olmo-r5", "NHD", 2, False, tp, backend=fa, kv_dtype=e4m3),
        Case("qwen35-r5", "HND", 1, True, tp, backend=fa, kv_dtype=e4m3),
    ]


def identity_matrix(tp: int = 1) -> list[Case]:
    """What a stored chunk is keyed by beyond its tokens: the KV dtype (stored under
    fp8_e4m3, restored under fp8_e5m2: a miss), the LoRA adapter (A's KV never serves B),
    the object's own bytes (one FA object forged after the store: a miss from it on). NHD
    only, where pristine stores and restores: its run shows what the case catches."""
    e4m3, e5m2 = "fp8_e4m3", "fp8_e5m2"
    return [
        Case("qwen35-r5", "NHD", 1, False, tp, kv_dtype=e4m3, restore_kv_dtype=e5m2),
        Case("qwen35-r5", "NHD", 1, False, tp, lora="other"),
        Case("qwen35-r5", "NHD", 2, False, tp, lora="each"),
        Case("qwen35-r5", "NHD", 2, False, tp, forged=True),
        Case("olmo-r17", "NHD", 1, False, tp, forged=True),
    ]


def seed_matrix(tp: int = 1) -> list[Case]:
    """Ratio 25: N = 1600 tokens per block over 64-slot FlashInfer pages, chunk = N = 1600,
    with and without --separate-object-groups."""
    return [
        Case("qwen35-r25", "NHD", 1, False, tp),
        Case("qwen35-r25", "NHD", 1, False, tp, separate_groups=True),
        Case("qwen35-r25", "HND", 1, True, tp),
        Case("qwen35-r25", "HND", 1, True, tp, separate_groups=True),
    ]


def decode_matrix(tp: int = 1) -> list[Case]:
    """Turn 2 under MTP with ``lmcache.mp.save_decode_cache`` on: vLLM 0.29+ keeps every
    block's recurrent state under MTP (its dense default); pristine lmcache 0.5.6 stores the
    chunks completed during decode only with that setting, by its own positional rule."""
    return [Case("qwen35-r5", "HND", 2, False, tp, spec_tokens=1, turn=2, save_decode=True)]


def graphs_matrix(tp: int = 1) -> list[Case]:
    """Every engine with CUDA graphs and torch.compile as vLLM defaults them, as deployments
    run: core-like cases of both families, NHD and HND, and MTP."""
    return [
        Case("olmo-r5", "NHD", 1, False, tp, graphs=True),
        Case("qwen35-r5", "HND", 2, True, tp, graphs=True),
        Case("olmo-r17", "HND", 1, True, tp, graphs=True),
        Case("qwen35-r5", "NHD", 2, False, tp, spec_tokens=1, graphs=True),
    ]


# The selectors' case sets; every case a selector can name is in full or a later one.
CASE_SETS = (quick_matrix, core_matrix, all_matrix, full_matrix, deploy_matrix, mtp_matrix)
CASE_SETS += (turn2_matrix, l2_matrix, fp8_matrix, identity_matrix, seed_matrix, decode_matrix)
CASE_SETS += (graphs_matrix,)
SET_NAMES = tuple(f.__name__.removesuffix("_matrix") for f in CASE_SETS)


def named_cases(tp: int = 1) -> list[Case]:
    out: list[Case] = []
    for f in CASE_SETS[3:]:
        out += [c for c in f(tp) if c not in out]
    return out


def select_cases(selector: str, tp: int = 1) -> list[Case]:
    """Cases of a comma-separated list of set names, case ids and case-id regexes."""
    named = dict(zip(SET_NAMES, CASE_SETS, strict=True))
    pool = named_cases(tp)
    out: list[Case] = []
    for part in (p.strip() for p in selector.split(",") if p.strip()):
        hits = named[part](tp) if part in named else [c for c in pool if c.case_id == part]
        hits = hits or [c for c in pool if re.fullmatch(part, c.case_id)]
        if not hits:
            raise ValueError(f"no case matches {part!r}")
        out += [c for c in hits if c not in out]
    return out
