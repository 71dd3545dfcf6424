"""A request's cache keys end to end, on CPU.

vLLM side: the real ``Request`` (with its LoRA adapter, cache_salt or prompt
embeddings) over the real ``KVCacheManager`` (``SchedDriver``). LMCache side: the real
scheduler-side ``LMCacheMPConnector`` derives the keys' token ids and cache_salt; the
scheduler adapter hands them to a whole LMCache server on CPU over an fs L2 folder
(restore_server), which builds the real ``IPCCacheServerKey`` (where 0.5.3 raised on a
salt it does not accept) and stores and looks them up. The model is a full-attention
model, which the connector keys as any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hybrid_kv import build_fa_only_kv
from restore_server import RealServer, ServerFactory
from vllm_sched_fakes import (
    BLOCK,
    FakeSchedulerAdapter,
    SchedDriver,
    make_connector,
    make_kv_cache_config,
)

CHUNK = 4 * BLOCK
CHUNKS = 4
PROMPT_TOKENS = CHUNKS * CHUNK + 1
NUM_BLOCKS = 64


class ServerLookups(FakeSchedulerAdapter):
    """The scheduler adapter, its lookups answered by a RealServer."""

    def __init__(self, server: RealServer) -> None:
        super().__init__(CHUNK)
        self.server = server

    def maybe_submit_lookup_request(
        self, request_id: str, token_ids: list[int], cache_salt: str = ""
    ) -> None:
        end = len(token_ids) // CHUNK * CHUNK
        found = self.server.lookup(request_id, list(token_ids[:end]), cache_salt)
        self.hits[request_id] = found * CHUNK


class KeyedEngine:
    """One engine (scheduler side) and one LMCache server."""

    def __init__(
        self, real_servers: ServerFactory, l2: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        kv = build_fa_only_kv(BLOCK, "NHD", num_blocks=NUM_BLOCKS)
        self.server = real_servers(kv, CHUNK, l2, False)
        config = make_kv_cache_config(None, num_blocks=NUM_BLOCKS)
        adapter = ServerLookups(self.server)
        self.connector = make_connector(config, CHUNK, monkeypatch, adapter=adapter)
        self.driver = SchedDriver(config, self.connector)
        self.stored = 0

    def request(self, req_id: str, prompt: list[int] | None = None, **fields: Any) -> Any:
        if prompt is None and "prompt_embeds" not in fields:
            prompt = list(range(1000, 1000 + PROMPT_TOKENS))
        return self.driver.add_request(req_id, prompt, **fields)

    def store(self, request: Any) -> None:
        """vLLM prefills ``request`` in one step; the server stores what the
        connector asks to store, under the keys it derived."""
        result = self.driver.step({request.request_id: -1})
        metas = [m for m in result.metadata.requests if m.direction == "STORE"]
        assert [(m.op.start, m.op.end) for m in metas] == [(0, CHUNKS * CHUNK)]
        (meta,) = metas
        tokens = list(meta.op.token_ids[: meta.op.end])
        assert self.server.store(request.request_id, tokens, meta.op.block_ids, meta.cache_salt)
        self.stored += CHUNKS
        self.server.wait_l2_objects(self.stored)

    def hit(self, request: Any) -> int:
        """The chunks the connector reports as an external hit for ``request``."""
        tokens, _ = self.connector.get_num_new_matched_tokens(request, 0)
        return int(tokens) // CHUNK

    def l2_names(self) -> list[str]:
        return [p.name for p in self.server.l2_dir.iterdir()]
