"""Drive LMCache's real scheduler-side connector the way vLLM 0.26's Scheduler does.

vLLM side: the REAL ``KVCacheManager`` (pure Python, CPU) over a real ``KVCacheConfig``:
a ``MambaSpec`` group (``mamba_cache_mode="align"``) plus a ``FullAttentionSpec`` group,
Mamba first as vLLM orders hybrid groups, or a full-attention group alone.
LMCache side: the REAL ``LMCacheMPConnector`` (scheduler role, real ``__init__``) with a
fake ``LMCacheMPSchedulerAdapter`` (no server) and a duck-typed ``VllmConfig``.

``SchedDriver.step`` mirrors ``Scheduler.schedule`` (vllm/v1/core/sched/scheduler.py):
running requests: ``allocate_slots`` and ``cached_reqs.new_block_ids`` = the returned
blocks; waiting / preempted requests: local hit, ``get_num_new_matched_tokens``,
``allocate_slots``, ``update_state_after_alloc(request, get_blocks(id), ext)``, then a new
request (or a resumed one: ``resumed_req_ids``, ``new_block_ids`` = the whole table; from
vLLM 0.34 a resumed request is a new request again).
The driver picks each step's token counts itself (as ``_mamba_block_aligned_split``
would, with any ``max_num_batched_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.output import CachedRequestData  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.request import Request, RequestStatus  # noqa: E402

import lmcache.integration.vllm.lmcache_mp_connector as mpc  # noqa: E402

# vLLM 0.34 re-sends a resumed request in scheduled_new_reqs and drops resumed_req_ids.
RESUMED_AS_NEW = "resumed_req_ids" not in {f.name for f in fields(CachedRequestData)}

BLOCK = 16  # tokens per block (FA and Mamba share it in align mode)
NULL_BLOCK_ID = 0  # vLLM's BlockPool.null_block
MAMBA_GROUP, FA_GROUP = 0, 1  # a hybrid make_kv_cache_config's groups, Mamba first

init_none_hash(sha256)


def prefill_split(req: Any, budget: int, mtp: bool) -> int:
    """How many prompt tokens vLLM's scheduler runs next (its own function); the namespace
    holds what the rule reads of its Scheduler in vLLM 0.26-0.34."""
    sched = SimpleNamespace(
        block_size=BLOCK,
        cache_config=SimpleNamespace(block_size=BLOCK),
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
        max_num_scheduled_tokens=budget,
        use_eagle=mtp,  # 0.26-0.29
        use_eagle_block_drop=mtp,  # 0.31+: MTP is an eagle method
        num_hash_lookahead_tokens=0,
        hash_block_size=BLOCK,
        mamba_partial_cache_hit=False,
        mamba_has_prefill_checkpoint_blocks=False,
        mamba_prefill_checkpoint_alignment=None,
        mamba_shared_prefix_checkpoint=False,
    )
    n = min(budget, req.num_tokens - req.num_computed_tokens)
    return Scheduler._mamba_block_aligned_split(sched, req, n)


def make_kv_cache_config(
    num_spec_blocks: int | None, num_blocks: int = 64, retention_interval: int | None = None
) -> KVCacheConfig:
    """Mamba(align) + FA groups; ``num_spec_blocks=None`` gives a FA-only model.
    ``retention_interval``: vLLM 0.29+'s prefix_cache_retention_interval (None: every
    block's state, 0: the prompt's last boundary only)."""
    fa = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float16)
    groups = [KVCacheGroupSpec(["model.layers.1.self_attn.attn"], fa)]
    if num_spec_blocks is not None:
        mamba = MambaSpec(
            block_size=BLOCK,
            shapes=((4,),),
            dtypes=(torch.float16,),
            page_size_padded=fa.page_size_bytes,
            mamba_cache_mode="align",
            num_speculative_blocks=num_spec_blocks,
        )
        groups.insert(0, KVCacheGroupSpec(["model.layers.0.linear_attn"], mamba))
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    if retention_interval is not None:
        config.prefix_cache_retention_interval = retention_interval
    return config


def this_build_layout_format() -> int:
    """The layout format a server of the build under test advertises (0: pristine)."""
    try:
        from lmcache.v1.distributed.layout_namespace import LAYOUT_FORMAT
    except ImportError:
        return 0
    return LAYOUT_FORMAT


def this_build_experimental(fa_only_chunks: bool = True) -> list[str]:
    """What a server of the build under test answers to GET_EXPERIMENTAL (without
    its word that it stores FA-only chunks unless ``fa_only_chunks``)."""
    try:
        from lmcache.v1.distributed.layout_namespace import server_marker
    except ImportError:
        return []
    try:  # the 0.5.6 base's one-block recurrent window
        from lmcache.v1.distributed.layout_namespace import RECURRENT_LAST_BLOCK_MARKER
    except ImportError:
        return [server_marker()]
    try:  # the 0.5.6 base's chunks stored as their FA objects only
        from lmcache.v1.distributed.layout_namespace import FA_ONLY_CHUNKS_MARKER
    except ImportError:
        fa_only_chunks = False
    markers = [server_marker(), RECURRENT_LAST_BLOCK_MARKER]
    return [*markers, FA_ONLY_CHUNKS_MARKER] if fa_only_chunks else markers


class FakeSchedulerAdapter:
    """Stands in for LMCacheMPSchedulerAdapter: no server; lookups answer ``hits``.
    ``server_layout_format`` is what the server advertises (0: a pristine server);
    ``fa_only_chunks``: whether it stores a chunk without its recurrent state."""

    def __init__(
        self, chunk: int, server_layout_format: int | None = None, fa_only_chunks: bool = False
    ) -> None:
        self.lmcache_tokens_per_chunk = chunk
        self.servers_store_fa_only_chunks = fa_only_chunks
        self.hits: dict[str, int] = {}
        if server_layout_format is None:
            server_layout_format = this_build_layout_format()
        self.server_layout_formats = {"tcp://fake:5555": server_layout_format}
        # 0.5.6's adapter keeps what every server advertises in GET_EXPERIMENTAL
        # as a set: a server of the build under test, or one of another format.
        self.experimental = {f"hybridfa-layout-format={server_layout_format}"}
        if server_layout_format == this_build_layout_format():
            self.experimental.update(this_build_experimental(fa_only_chunks))

    def maybe_submit_lookup_request(self, request_id: str, **_: Any) -> None:
        return None

    def check_lookup_result(self, request_id: str) -> int:
        return self.hits.get(request_id, 0)

    def cleanup_lookup_result(self, request_id: str) -> None:
        return None

    def free_lookup_locks(self, **_: Any) -> None:
        return None

    def report_block_allocations(self, records: Any) -> None:
        return None

    def end_session(self, request_id: str) -> None:
        return None


def _fake_vllm_config(max_num_batched_tokens: int, mamba: bool) -> Any:
    extra: dict[str, Any] = {}
    # lmcache 0.5.6's connector also reads is_kv_producer, the prefix-caching switch and
    # the decode-context-parallel sizes.
    return SimpleNamespace(
        cache_config=SimpleNamespace(
            block_size=BLOCK,
            mamba_cache_mode="align" if mamba else "none",
            enable_prefix_caching=True,
        ),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_num_batched_tokens),
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config=extra,
            get_from_extra_config=lambda key, default: extra.get(key, default),
            is_kv_producer=True,
            is_kv_consumer=True,
        ),
        parallel_config=SimpleNamespace(
            world_size=1,
            rank=0,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            data_parallel_size=1,
            data_parallel_rank=0,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
        ),
        model_config=SimpleNamespace(model="tiny-hybrid", use_mla=False, is_hybrid=mamba),
        speculative_config=None,
        kv_events_config=None,
    )


def make_worker_connector(
    kv_cache_config: KVCacheConfig, worker_adapter: Any, monkeypatch: pytest.MonkeyPatch
) -> Any:
    """The real worker-side LMCacheMPConnector (real __init__) over ``worker_adapter``."""
    monkeypatch.setattr(mpc, "LMCacheMPWorkerAdapter", lambda **_: worker_adapter)
    vllm_config = _fake_vllm_config(BLOCK, kv_cache_config.has_mamba_layers)
    return mpc.LMCacheMPConnector(vllm_config, mpc.KVConnectorRole.WORKER, kv_cache_config)


def make_connector(
    kv_cache_config: KVCacheConfig,
    chunk: int,
    monkeypatch: pytest.MonkeyPatch,
    server_layout_format: int | None = None,
    fa_only_chunks: bool = False,
    adapter: FakeSchedulerAdapter | None = None,
) -> Any:
    """The real scheduler-side LMCacheMPConnector, built by its real __init__ (over
    ``adapter`` where given)."""
    if adapter is None:
        adapter = FakeSchedulerAdapter(chunk, server_layout_format, fa_only_chunks)
    monkeypatch.setattr(mpc, "LMCacheMPSchedulerAdapter", lambda **_: adapter)
    monkeypatch.setattr(mpc, "print_banner_once", lambda *_: None)
    vllm_config = _fake_vllm_config(BLOCK, kv_cache_config.has_mamba_layers)
    return mpc.LMCacheMPConnector(vllm_config, mpc.KVConnectorRole.SCHEDULER, kv_cache_config)


@dataclass
class StepResult:
    """What the connector produced in one scheduler step."""

    stores: list[Any] = field(default_factory=list)  # LoadStoreOp, direction STORE
    retrieves: list[Any] = field(default_factory=list)  # LoadStoreOp, direction RETRIEVE
    metadata: Any = None  # the LMCacheMPConnectorMetadata a worker receives


class SchedDriver:
    """A minimal vLLM-0.26-Scheduler-shaped loop over the real KVCacheManager."""

    def __init__(
        self, kv_cache_config: KVCacheConfig, connector: Any, hash_block: int = BLOCK
    ) -> None:
        """``hash_block < BLOCK`` allows partial (sub-block) prefix-cache hits."""
        self.hash_block = hash_block
        self.manager = KVCacheManager(
            kv_cache_config,
            max_model_len=4096,
            scheduler_block_size=BLOCK,
            hash_block_size=hash_block,
            enable_caching=True,
        )
        self.connector = connector
        self.requests: dict[str, Request] = {}
        self.running: set[str] = set()
        # This step's boundary-state offers {req_id: [(group, block id, boundary)]}.
        self.offers: dict[str, list[tuple[int, int, int]]] = {}
        # Pristine append semantics: the ids vLLM reported, concatenated.
        self.reported: dict[str, list[list[int]]] = {}

    def add_request(self, req_id: str, prompt: list[int] | None, **fields: Any) -> Request:
        """A vLLM Request; ``fields``: its other fields (lora_request, cache_salt,
        prompt_embeds with ``prompt=None``, ...)."""
        req = Request(
            req_id,
            prompt,
            SamplingParams(max_tokens=64),
            None,
            block_hasher=get_request_block_hasher(self.hash_block, sha256),
            **fields,
        )
        self.requests[req_id] = req
        return req

    def _local_hit(self, req: Request) -> tuple[Any, int]:
        local_hit = getattr(Scheduler, "_get_local_prefix_cache_hit", None)
        if local_hit is not None:  # vLLM >= 0.29: the scheduler's own lookup
            sched = SimpleNamespace(connector=self.connector, kv_cache_manager=self.manager)
            blocks, hit, *_ = local_hit(sched, req)
            return blocks, hit
        coordinator = self.manager.coordinator
        if isinstance(coordinator, HybridKVCacheCoordinator):
            # Scheduler.schedule's connector + Mamba path.
            computed, per_group_hits = coordinator.find_longest_cache_hit_per_group(
                req.block_hashes, req.num_tokens - 1
            )
            return self.manager.create_kv_cache_blocks(computed), max(per_group_hits)
        blocks, hit, _ = self.manager.get_computed_blocks(req)
        return blocks, hit

    def step(self, num_tokens: dict[str, int]) -> StepResult:
        """Schedule ``num_tokens[req_id]`` new tokens for each request, in order.

        ``num_tokens`` counts tokens beyond the local prefix-cache hit for a waiting
        request; pass ``-1`` to schedule all of its remaining tokens.
        """
        self.manager.new_step_starts()
        new_reqs: list[Any] = []
        cached_ids: list[str] = []
        resumed: set[str] = set()
        new_block_ids: list[Any] = []
        scheduled: dict[str, int] = {}
        for req_id, n in num_tokens.items():
            req = self.requests[req_id]
            if req_id in self.running:
                blocks = self.manager.allocate_slots(req, n)
                assert blocks is not None, "test pool too small"
                cached_ids.append(req_id)
                new_block_ids.append(blocks.get_block_ids(allow_none=True))
                reported = self.reported[req_id]
                for group_ids, ids in zip(reported, blocks.get_block_ids(), strict=True):
                    group_ids.extend(ids)
            else:
                computed_blocks, local = self._local_hit(req)
                ext, load_async = self.connector.get_num_new_matched_tokens(req, local)
                assert ext is not None and not load_async, "driver runs sync loads only"
                n = req.num_tokens - local if n < 0 else n
                blocks = self.manager.allocate_slots(
                    req,
                    n,
                    num_new_computed_tokens=local,
                    new_computed_blocks=computed_blocks,
                    num_external_computed_tokens=ext,
                )
                assert blocks is not None, "test pool too small"
                self.connector.update_state_after_alloc(req, self.manager.get_blocks(req_id), ext)
                self.reported[req_id] = self.vllm_table(req_id)
                if req.status == RequestStatus.PREEMPTED and not RESUMED_AS_NEW:
                    resumed.add(req_id)
                    cached_ids.append(req_id)
                    new_block_ids.append(
                        self.manager.get_blocks(req_id).get_block_ids(allow_none=True)
                    )
                else:
                    new_reqs.append(SimpleNamespace(req_id=req_id))
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = local + ext
                self.running.add(req_id)
            scheduled[req_id] = n
        cached = SimpleNamespace(req_ids=cached_ids, new_block_ids=new_block_ids)
        if not RESUMED_AS_NEW:
            cached.resumed_req_ids = resumed
        output = SimpleNamespace(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=scheduled,
            preempted_req_ids=set(),
        )
        take_offers = getattr(self.manager, "take_boundary_state_offloads", None)
        if take_offers is not None:  # vLLM >= 0.29: Scheduler.schedule's hand-off
            self.offers = take_offers()
            output.kv_connector_block_state = SimpleNamespace(
                block_ids={r: self.manager.get_block_ids(r) for r in scheduled},
                boundary_state_offloads=self.offers,
            )
        metadata = self.connector.build_connector_meta(output)
        result = StepResult(metadata=metadata)
        for req_meta in metadata.requests:
            ops = result.stores if req_meta.direction == "STORE" else result.retrieves
            ops.append(req_meta.op)
        # The forward pass runs; Scheduler.update_from_output commits the tokens.
        for req_id, n in scheduled.items():
            self.requests[req_id].num_computed_tokens += n
        return result

    def preempt(self, req_id: str) -> None:
        """Scheduler._preempt_request: free the blocks, back to waiting."""
        req = self.requests[req_id]
        self.manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.running.discard(req_id)

    def finish(self, req_id: str) -> None:
        req = self.requests[req_id]
        self.connector.request_finished(req, [])
        self.manager.free(req)
        self.running.discard(req_id)

    def vllm_table(self, req_id: str) -> list[list[int]]:
        return [list(ids) for ids in self.manager.get_block_ids(req_id)]

    def tracked_table(self, req_id: str) -> list[list[int]]:
        tracker = self.connector.request_trackers[req_id]
        num_groups = len(self.manager.kv_cache_config.kv_cache_groups)
        return [list(tracker.allocated_block_ids.get(g, [])) for g in range(num_groups)]
