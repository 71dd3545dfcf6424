"""A full external hit never promises the last prompt token to a hybrid model.

LMCache's real scheduler-side LMCacheMPConnector (and its real LMCacheMPSchedulerAdapter)
talks to a fake LMCache server that answers like the real one: a LOOKUP hashes every whole
chunk of the token ids it is sent (lookup.py) and the hit is the prefix of those chunks the
server holds. Requests, KV cache specs and the full-hit rewind are vLLM 0.26's own.

Geometry: block N = 16 tokens, LMCache chunk C = 2N = 32 tokens. Hybrid = one MambaSpec
group in "align" mode plus one FullAttentionSpec group; non-hybrid = FullAttentionSpec only.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm.v1.core.sched.scheduler")
pytest.importorskip("lmcache.integration.vllm.lmcache_mp_connector")

from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig, SchedulerConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.request import Request  # noqa: E402
from vllm_sched_fakes import this_build_experimental  # noqa: E402

from lmcache.integration.vllm import lmcache_mp_connector, vllm_multi_process_adapter  # noqa: E402
from lmcache.v1.multiprocess.protocol import RequestType  # noqa: E402

N = 16  # vLLM block size (tokens); the Mamba state is checkpointed once per block
CHUNK = 2 * N  # LMCache chunk size


class _Done:
    def __init__(self, value: Any) -> None:
        self._value = value

    def result(self, timeout: float | None = None) -> Any:
        return self._value


class _FakeServer:
    """Holds the first ``held_tokens`` tokens of every prompt (whole chunks)."""

    def __init__(self, held_tokens: int) -> None:
        self.held_chunks = held_tokens // CHUNK
        self.hit_chunks: dict[str, int] = {}
        self.locked_chunks: dict[str, int] = {}

    def client(self, url: str, context: Any) -> _FakeMQClient:
        return _FakeMQClient(self)

    def answer(self, request_type: RequestType, payloads: list[Any]) -> Any:
        if request_type == RequestType.GET_CHUNK_SIZE:
            return CHUNK
        if request_type == RequestType.GET_EXPERIMENTAL:  # the layout handshake
            return this_build_experimental()
        if request_type == RequestType.PING:  # the scheduler's heartbeat
            return True
        if request_type == RequestType.LOOKUP:
            key = payloads[0]
            hit = min(self.held_chunks, len(key.token_ids) // CHUNK)
            self.hit_chunks[key.request_id] = hit
            self.locked_chunks[key.request_id] = hit  # a hit locks its chunks
            return True
        if request_type == RequestType.QUERY_PREFETCH_STATUS:
            return self.hit_chunks[payloads[0]]
        return None


class _FakeMQClient:
    def __init__(self, server: _FakeServer) -> None:
        self._server = server

    def submit_request(
        self, request_type: RequestType, payloads: list[Any], response_class: Any
    ) -> _Done:
        return _Done(self._server.answer(request_type, payloads))

    def close(self) -> None:
        pass


def _kv_cache_config(hybrid: bool) -> KVCacheConfig:
    fa = FullAttentionSpec(block_size=N, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec(["model.layers.1.self_attn.attn"], fa)]
    if hybrid:
        mamba = MambaSpec(
            block_size=N,
            shapes=((3, 32), (2, 32, 32)),
            dtypes=(torch.bfloat16, torch.bfloat16),
            page_size_padded=fa.page_size_bytes,
            mamba_cache_mode="align",
        )
        groups.insert(0, KVCacheGroupSpec(["model.layers.0.linear_attn"], mamba))
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def _connector(
    monkeypatch: pytest.MonkeyPatch, hybrid: bool, server: _FakeServer
) -> lmcache_mp_connector.LMCacheMPConnector:
    monkeypatch.setenv("LMCACHE_DISABLE_BANNER", "1")
    monkeypatch.setattr(vllm_multi_process_adapter, "MessageQueueClient", server.client)
    vllm_config = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMCacheMPConnector",
            kv_role="kv_both",
            kv_connector_module_path="lmcache.integration.vllm.lmcache_mp_connector",
        ),
        cache_config=CacheConfig(block_size=N, mamba_cache_mode="align" if hybrid else "none"),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=N, max_num_seqs=1, max_model_len=4096, is_encoder_decoder=False
        ),
        parallel_config=ParallelConfig(),
        model_config=SimpleNamespace(model="tiny", use_mla=False, is_hybrid=hybrid),
    )
    return lmcache_mp_connector.LMCacheMPConnector(
        vllm_config, KVConnectorRole.SCHEDULER, _kv_cache_config(hybrid)
    )


def _request(prompt_len: int) -> Request:
    return Request("req-0", list(range(1000, 1000 + prompt_len)), SamplingParams(), None)


def _matched(
    monkeypatch: pytest.MonkeyPatch,
    hybrid: bool,
    prompt_len: int,
    held_tokens: int,
    local_hit: int = 0,
) -> tuple[int | None, bool]:
    connector = _connector(monkeypatch, hybrid, _FakeServer(held_tokens))
    return connector.get_num_new_matched_tokens(_request(prompt_len), local_hit)


# --- hybrid (Mamba align + full attention) ---------------------------------------------


@pytest.mark.fix
def test_hybrid_full_hit_prompt_multiple_of_chunk_recomputes_final_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # P = 3C, all of it held: the promise stops at the chunk boundary before the last token.
    assert _matched(monkeypatch, True, 3 * CHUNK, 3 * CHUNK) == (2 * CHUNK, True)


@pytest.mark.fix
def test_hybrid_full_hit_prompt_of_one_chunk_promises_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _matched(monkeypatch, True, CHUNK, CHUNK) == (0, False)


@pytest.mark.fix
def test_hybrid_full_hit_on_top_of_local_hit_stays_below_prompt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vLLM's local prefix cache already holds 3N tokens (block aligned, < P).
    assert _matched(monkeypatch, True, 3 * CHUNK, 3 * CHUNK, local_hit=3 * N) == (N, True)


@pytest.mark.fix
def test_hybrid_full_hit_does_not_lock_the_final_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine recomputes the chunk holding the last token: the lookup must not lock
    # (nor prefetch) it, or its lock would only be released by the TTL.
    server = _FakeServer(3 * CHUNK)
    _connector(monkeypatch, True, server).get_num_new_matched_tokens(_request(3 * CHUNK), 0)
    assert server.locked_chunks["req-0"] == 2


@pytest.mark.fix
def test_hybrid_full_hit_engine_resumes_at_the_restored_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Run vLLM's own post-load step: it rewinds a full prompt hit by one token.

    In align mode the engine then resumes the recurrent state from block
    (num_computed_tokens - 1) // N (mamba_utils.preprocess_mamba), the checkpoint after
    ((num_computed_tokens - 1) // N + 1) * N tokens. That equals num_computed_tokens only
    when the engine resumes exactly where the restored data ends on a block boundary.
    """
    request = _request(3 * CHUNK)
    connector = _connector(monkeypatch, True, _FakeServer(3 * CHUNK))
    promised, load_async = connector.get_num_new_matched_tokens(request, 0)
    assert load_async
    request.num_computed_tokens = promised  # what Scheduler.schedule() does for an async load
    scheduler = SimpleNamespace(
        connector=connector,
        failed_recving_kv_req_ids=set(),
        finished_recving_kv_req_ids={request.request_id},
        kv_cache_manager=SimpleNamespace(cache_blocks=lambda req, num_tokens: None),
        needs_kv_cache_zeroing=True,
    )
    Scheduler._update_waiting_for_remote_kv(scheduler, request)  # type: ignore[arg-type]
    resumed = request.num_computed_tokens
    checkpoint_tokens = ((resumed - 1) // N + 1) * N
    assert checkpoint_tokens == resumed, (
        f"engine resumes at token {resumed} from a checkpoint after {checkpoint_tokens} tokens"
    )


@pytest.mark.parametrize("prompt_len", [5 * N, 5 * N + 3, 3 * CHUNK + 1])
def test_hybrid_full_hit_prompt_not_multiple_of_chunk_keeps_its_hit(
    monkeypatch: pytest.MonkeyPatch, prompt_len: int
) -> None:
    # Every whole chunk is held; the partial tail was never storable.
    held = prompt_len // CHUNK * CHUNK
    assert _matched(monkeypatch, True, prompt_len, held) == (held, True)


def test_hybrid_partial_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _matched(monkeypatch, True, 3 * CHUNK, CHUNK) == (CHUNK, True)


def test_hybrid_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _matched(monkeypatch, True, 3 * CHUNK, 0) == (0, False)


# --- non-hybrid (full attention only): pristine behaviour, hit rate included ------------


def test_non_hybrid_full_hit_prompt_multiple_of_chunk_promises_every_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _matched(monkeypatch, False, 3 * CHUNK, 3 * CHUNK) == (3 * CHUNK, True)


def test_non_hybrid_full_hit_on_top_of_local_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _matched(monkeypatch, False, 3 * CHUNK, 3 * CHUNK, local_hit=3 * N) == (
        3 * CHUNK - 3 * N,
        True,
    )


@pytest.mark.parametrize("prompt_len", [5 * N, 5 * N + 3])
def test_non_hybrid_full_hit_prompt_not_multiple_of_chunk(
    monkeypatch: pytest.MonkeyPatch, prompt_len: int
) -> None:
    held = prompt_len // CHUNK * CHUNK
    assert _matched(monkeypatch, False, prompt_len, held) == (held, True)


def test_non_hybrid_partial_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _matched(monkeypatch, False, 3 * CHUNK, CHUNK) == (CHUNK, True)


def test_non_hybrid_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _matched(monkeypatch, False, 3 * CHUNK, 0) == (0, False)
