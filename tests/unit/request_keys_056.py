"""A request's cache keys end to end on the lmcache 0.5.6 base, on CPU.

vLLM side: the real ``Request`` (with its cache_salt, LoRA adapter, prompt embeddings or
multimodal items) over the real ``KVCacheManager`` (``SchedDriver``). LMCache side: the
real scheduler-side ``LMCacheMPConnector`` derives each key's token ids and cache_salt
and hands them to its scheduler adapter; ``KeyedLookups`` builds from them what 0.5.6's
adapter and server build: the ``IPCCacheServerKey`` (``_create_key``, where 0.5.6 raises
on a salt it does not accept), the chunk hashes (``TokenHasher``), the ``ObjectKey``s
(``ipc_key_to_object_keys``) and the fs L2 file name of each (``_object_key_to_filename``).
A lookup hits the chunk prefix whose file names were stored. The model is a
full-attention model, which the connector keys as any other.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm.v1.request")

from vllm_sched_fakes import (  # noqa: E402
    BLOCK,
    FakeSchedulerAdapter,
    SchedDriver,
    make_connector,
    make_kv_cache_config,
)

from lmcache.integration.vllm.vllm_multi_process_adapter import (  # noqa: E402
    LMCacheMPSchedulerAdapter,
)
from lmcache.v1.distributed.api import ipc_key_to_object_keys  # noqa: E402
from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import (  # noqa: E402
    _object_key_to_filename,
)
from lmcache.v1.multiprocess.token_hasher import TokenHasher  # noqa: E402

CHUNK = 4 * BLOCK
CHUNKS = 4
PROMPT_TOKENS = CHUNKS * CHUNK + 1
NUM_BLOCKS = 64
MODEL = "tiny-model"


class KeyedLookups(FakeSchedulerAdapter):
    """The scheduler adapter: keys built as 0.5.6's adapter and server build them."""

    def __init__(self) -> None:
        super().__init__(CHUNK)
        # What LMCacheMPSchedulerAdapter._create_key reads of its adapter.
        self.model_name = MODEL
        self.world_size = 1
        self.parallel_strategy = SimpleNamespace(num_kv_readers=1)
        self.hasher = TokenHasher(chunk_size=CHUNK)
        self.l2_names: list[str] = []

    def file_names(
        self, request_id: str, token_ids: list[int], end: int, cache_salt: str
    ) -> list[str]:
        key = LMCacheMPSchedulerAdapter._create_key(
            self,  # type: ignore[arg-type]
            list(token_ids),
            start=0,
            end=end,
            request_id=request_id,
            cache_salt=cache_salt,
        ).no_worker_id_version()
        hashes = self.hasher.compute_chunk_hashes(list(key.token_ids), end=end)
        (keys,) = ipc_key_to_object_keys(key, hashes, [0])
        return [_object_key_to_filename(k) for k in keys]

    def maybe_submit_lookup_request(
        self, request_id: str, token_ids: list[int], cache_salt: str = "", **_: Any
    ) -> None:
        end = (len(token_ids) - 1) // CHUNK * CHUNK
        found = 0
        for name in self.file_names(request_id, token_ids, end, cache_salt):
            if name not in self.l2_names:
                break
            found += 1
        self.hits[request_id] = found * CHUNK


class KeyedEngine:
    """One engine (scheduler side) and what its keys name in an fs L2 tier."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        config = make_kv_cache_config(None, num_blocks=NUM_BLOCKS)
        self.lookups = KeyedLookups()
        self.connector = make_connector(config, CHUNK, monkeypatch, adapter=self.lookups)
        self.driver = SchedDriver(config, self.connector)

    def request(self, req_id: str, prompt: list[int] | None = None, **fields: Any) -> Any:
        if prompt is None and "prompt_embeds" not in fields:
            prompt = list(range(1000, 1000 + PROMPT_TOKENS))
        return self.driver.add_request(req_id, prompt, **fields)

    def store(self, request: Any) -> None:
        """vLLM prefills ``request`` in one step; its chunks are stored under the keys
        the connector derived."""
        result = self.driver.step({request.request_id: -1})
        metas = [m for m in result.metadata.requests if m.direction == "STORE"]
        assert [(m.op.start, m.op.end) for m in metas] == [(0, CHUNKS * CHUNK)]
        (meta,) = metas
        names = self.lookups.file_names(
            request.request_id, list(meta.op.token_ids), meta.op.end, meta.cache_salt
        )
        assert len(names) == CHUNKS
        self.lookups.l2_names.extend(names)

    def hit(self, request: Any) -> int:
        """The chunks the connector reports as an external hit for ``request``."""
        tokens, _ = self.connector.get_num_new_matched_tokens(request, 0)
        return int(tokens) // CHUNK
