"""The scheduler-side connector starts inside vLLM's own Scheduler (0.5.6 base).

vLLM's engine core builds the scheduler, whose constructor builds the KV connector through
vLLM's connector factory; the connector's own constructor builds LMCache's scheduler adapter,
which asks each server for its chunk size and its capabilities. Here all of it is real except
the server (a request client that answers that handshake as this build's server does) and the
model (a tiny OlmoHybrid config without weights; vLLM's CPU platform builds the engine config).
On a GPU, revision 6 of this base stopped every engine right there: the connector read an
attribute the real adapter did not have. A request then runs through the scheduler to its
last token (the model runner's outputs stood in for), past the steps where pristine 0.5.6
crashes on vLLM 0.34.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

from handshake_client import (  # noqa: E402
    HandshakeClient,
    answered,
    connect_to,
    real_server_experimental,
)
from vllm_cpu_engine import engine_config  # noqa: E402
from vllm_sched_fakes import BLOCK, make_kv_cache_config  # noqa: E402

pytestmark = pytest.mark.bases("0.5.6")


def make_scheduler(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, server: type) -> Any:
    """vLLM's Scheduler of a tiny OlmoHybrid with this connector, its servers ``server``
    (a HandshakeClient class) started with chunk size BLOCK."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from hybridfa_gate.models import MODELS, write_model_dir

    config = engine_config(write_model_dir(MODELS["olmo-r5"], tmp_path), BLOCK, monkeypatch)
    connect_to(monkeypatch, server(BLOCK, real_server_experimental()))
    kv_cache_config = make_kv_cache_config(0)
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


def test_a_hybrid_engine_s_scheduler_starts_with_the_connector(tmp_path, monkeypatch):
    scheduler = make_scheduler(tmp_path, monkeypatch, HandshakeClient)
    assert type(scheduler.connector).__name__ == "LMCacheMPConnector"
    assert scheduler.connector._cache_refused is None


class FreshServer(HandshakeClient):
    """A server that holds nothing yet: every lookup is a miss."""

    def lookup(self, *_: Any) -> Any:
        return answered(None)

    def query_prefetch_status(self, *_: Any) -> Any:
        return answered(0)

    def free_lookup_locks(self, *_: Any) -> Any:
        return answered(None)

    def end_session(self, *_: Any) -> Any:
        return answered(None)

    def report_block_allocation(self, *_: Any) -> Any:
        return answered(None)


def model_runner_output(scheduler: Any, output: Any) -> Any:
    """What the model runner returns for a scheduled step: one sampled token for each
    request whose prompt is now computed, none for a partial prefill."""
    from dataclasses import fields

    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(output.num_scheduled_tokens)
    sampled = [
        [7]
        if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_prompt_tokens
        else []
        for r in req_ids
    ]
    extra = {}
    if "req_id_to_index" in {f.name for f in fields(ModelRunnerOutput)}:  # vLLM < 0.34
        extra["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, **extra)


def test_a_hybrid_request_runs_through_the_scheduler_and_its_chunks_are_stored_once(
    tmp_path, monkeypatch
):
    """One prompt of three chunks and five tokens through vLLM's scheduler to its last
    token: the lookup misses, the connector's metadata stores the three complete chunks
    once, and the request finishes."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    scheduler = make_scheduler(tmp_path, monkeypatch, FreshServer)
    prompt = list(range(1, 3 * BLOCK + 6))
    request = Request(
        "req-0",
        prompt,
        SamplingParams(max_tokens=4, ignore_eos=True),
        None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )
    scheduler.add_request(request)
    stores = []
    for _ in range(12):
        output = scheduler.schedule()
        stores += [r for r in output.kv_connector_metadata.requests if r.direction == "STORE"]
        scheduler.update_from_output(output, model_runner_output(scheduler, output))
        if request.is_finished():
            break
    assert request.is_finished() and len(request.output_token_ids) == 4
    assert [(r.request_id, r.op.start, r.op.end) for r in stores] == [("req-0", 0, 3 * BLOCK)]
    op = stores[0].op
    assert op.token_ids[: op.end] == prompt[: op.end]
    assert [len(ids) for ids in op.block_ids] == [3, 3], op.block_ids
