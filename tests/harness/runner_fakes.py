"""CPU stand-ins for vLLM's two GPU model runners, holding what hybridfa_gate.worker reads
under the names vLLM gives it (test_vllm_api.py finds each of them in the installed vLLM):

- ``V1Runner``, vllm/v1/worker/gpu_model_runner.py: ``requests`` (request id -> a
  CachedRequestState's ``prompt_token_ids``, ``block_ids``, ``num_computed_tokens``), brought
  up to date by ``_update_states``; the MTP layer in ``drafter.model``.
- ``V2Runner``, vllm/v1/worker/gpu/model_runner.py: ``req_states`` (``req_id_to_index``,
  ``num_computed_tokens_np``) and ``block_tables`` (``append_block_ids`` stages a row's ids,
  ``apply_staged_writes`` writes them into ``block_tables[g].gpu``; ``num_blocks.np``),
  brought up to date by ``finish_requests``, ``add_requests``, ``update_requests`` and then
  the staged writes, in ``execute_model``; the MTP layer in ``speculator.model``.

Each runs ``execute_model(step(...))``, a step's SchedulerOutput as far as they read it."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace as NS
from typing import Any

# (request id, prompt tokens, block ids per KV cache group, tokens computed)
New = tuple[str, Sequence[int], Sequence[Sequence[int]], int]
# (request id, tokens computed, block ids added per group or None)
Cached = tuple[str, int, Sequence[Sequence[int]] | None]


def step(new: Sequence[New] = (), cached: Sequence[Cached] = (), finished: Sequence[str] = ()):
    """A SchedulerOutput's scheduled_new_reqs, scheduled_cached_reqs and finished_req_ids."""
    return NS(
        scheduled_new_reqs=[
            NS(req_id=r, prompt_token_ids=list(p), block_ids=tuple(b), num_computed_tokens=c)
            for r, p, b, c in new
        ],
        scheduled_cached_reqs=NS(
            req_ids=[r for r, _, _ in cached],
            num_computed_tokens=[c for _, c, _ in cached],
            new_block_ids=[None if b is None else tuple(b) for _, _, b in cached],
        ),
        finished_req_ids=set(finished),
    )


class _Runner:
    def __init__(self, layers: dict[str, Any], groups: list[tuple[int, list[str]]], model=None):
        """``layers``: each layer's KV cache; ``groups``: (block size, layer names) per KV
        cache group."""
        self.compilation_config = NS(
            static_forward_context={name: NS(kv_cache=kv) for name, kv in layers.items()}
        )
        self.kv_cache_config = NS(
            kv_cache_groups=[
                NS(kv_cache_spec=NS(block_size=n), layer_names=names) for n, names in groups
            ]
        )
        self.model = model

    def get_model(self) -> Any:
        return self.model


class V1Runner(_Runner):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests: dict[str, NS] = {}
        self.drafter = None

    def _update_states(self, scheduler_output: Any) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.req_id] = NS(
                prompt_token_ids=new.prompt_token_ids,
                block_ids=tuple(list(g) for g in new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed, ids in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_block_ids, strict=True
        ):
            st = self.requests[req_id]
            st.num_computed_tokens = computed
            for group, more in zip(st.block_ids, ids or (), strict=False):
                group.extend(more)

    def execute_model(self, scheduler_output: Any) -> None:
        self._update_states(scheduler_output)


class BlockTables:
    """vLLM's V2 BlockTables: a request row's ids are staged and reach the table (on the GPU
    there) only when ``apply_staged_writes`` runs."""

    def __init__(self, groups: int, max_reqs: int, max_blocks: int) -> None:
        import numpy as np
        import torch

        self.block_tables = [
            NS(gpu=torch.zeros(max_reqs, max_blocks, dtype=torch.int32)) for _ in range(groups)
        ]
        self.num_blocks = NS(np=np.zeros((groups, max_reqs), dtype=np.int32))
        self.staged: list[tuple[int, int, int, list[int]]] = []

    def append_block_ids(
        self, req_index: int, new_block_ids: tuple[list[int], ...], overwrite: bool
    ) -> None:
        for g, ids in enumerate(new_block_ids):
            start = 0 if overwrite else int(self.num_blocks.np[g, req_index])
            self.staged.append((g, req_index, start, list(ids)))
            self.num_blocks.np[g, req_index] = start + len(ids)

    def apply_staged_writes(self) -> None:
        import torch

        for g, row, start, ids in self.staged:
            gpu = self.block_tables[g].gpu
            gpu[row, start : start + len(ids)] = torch.tensor(ids, dtype=gpu.dtype)
        self.staged.clear()


class V2Runner(_Runner):
    def __init__(self, *args: Any, max_reqs: int = 4, max_blocks: int = 16, **kwargs: Any):
        import numpy as np

        super().__init__(*args, **kwargs)
        self.req_states = NS(
            req_id_to_index={},
            num_computed_tokens_np=np.zeros(max_reqs, dtype=np.int32),
            free_indices=list(range(max_reqs)),
        )
        groups = len(self.kv_cache_config.kv_cache_groups)
        self.block_tables = BlockTables(groups, max_reqs, max_blocks)
        self.speculator = None

    def finish_requests(self, scheduler_output: Any) -> None:
        for req_id in scheduler_output.finished_req_ids:
            if (row := self.req_states.req_id_to_index.pop(req_id, None)) is not None:
                self.req_states.free_indices.append(row)

    def add_requests(self, scheduler_output: Any) -> None:
        for new in scheduler_output.scheduled_new_reqs:
            row = self.req_states.free_indices.pop()
            self.req_states.req_id_to_index[new.req_id] = row
            self.req_states.num_computed_tokens_np[row] = new.num_computed_tokens
            self.block_tables.append_block_ids(row, new.block_ids, overwrite=True)

    def update_requests(self, scheduler_output: Any) -> None:
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed, ids in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_block_ids, strict=True
        ):
            row = self.req_states.req_id_to_index[req_id]
            self.req_states.num_computed_tokens_np[row] = computed
            if ids is not None:
                self.block_tables.append_block_ids(row, ids, overwrite=False)

    def execute_model(self, scheduler_output: Any) -> None:
        self.finish_requests(scheduler_output)
        self.add_requests(scheduler_output)
        self.update_requests(scheduler_output)
        self.block_tables.apply_staged_writes()


RUNNERS = {"V1": V1Runner, "V2": V2Runner}
DRAFTER = {"V1": "drafter", "V2": "speculator"}  # where each keeps the MTP layer's module
