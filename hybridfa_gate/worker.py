"""Worker-side helpers of the engine process, plain functions for ``LLM.collective_rpc``:
``self`` is the worker (or its wrapper). They import torch inside and read the model runner
vLLM runs, either of its two, told apart by what the runner object holds (``runner_kind``):

- V1, ``vllm/v1/worker/gpu_model_runner.py`` (vLLM 0.26-0.33; hybrid models run on it through
  0.28, later only with VLLM_USE_V2_MODEL_RUNNER=0): ``requests`` (request id ->
  CachedRequestState: ``prompt_token_ids``, ``block_ids`` per KV cache group,
  ``num_computed_tokens``), updated each step by ``_update_states``; the MTP layer in
  ``drafter.model``.
- V2, ``vllm/v1/worker/gpu/model_runner.py`` (Model Runner V2: hybrid models run on it from
  0.29, and 0.34 has no other): ``req_states`` (``req_id_to_index``: request id -> row,
  ``num_computed_tokens_np``) and ``block_tables`` (``append_block_ids``, the one writer of a
  row's block ids; on the GPU, ``block_tables[g].gpu`` rows of ``num_blocks.np[g, row]`` ids),
  updated each step by ``add_requests`` and ``update_requests``; the MTP layer in
  ``speculator.model``.

Both bind each layer's KV cache to ``compilation_config.static_forward_context[layer].kv_cache``
and keep ``kv_cache_config`` and ``get_model()``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from hybridfa_gate.prompts import prompt_key

# What each runner holds that the hooks read (the state) and wrap (the step's state update).
V1_ATTRS = ("requests", "_update_states")
V2_ATTRS = ("req_states", "block_tables", "update_requests")


def runner(self: Any) -> Any:
    worker = getattr(self, "worker", None) or self
    return worker.model_runner


def rank_of(self: Any) -> int:
    return int((getattr(self, "worker", None) or self).rank)  # vLLM's WorkerBase sets it


def runner_kind(mr: Any) -> str:
    """The runner's kind, V1 or V2, by what it holds (``V1_ATTRS``, ``V2_ATTRS``), not by
    vLLM's version."""
    kinds = {"V1": V1_ATTRS, "V2": V2_ATTRS}
    for kind, attrs in kinds.items():
        if all(hasattr(mr, a) for a in attrs):
            return kind
    lacks = " and ".join(
        f"{kind}'s {', '.join(a for a in attrs if not hasattr(mr, a))}"
        for kind, attrs in kinds.items()
    )
    raise RuntimeError(
        f"{type(mr).__module__}.{type(mr).__qualname__} is neither of the vLLM model runners "
        f"the gate's hooks read: it lacks {lacks}"
    )


def runner_name(mr: Any) -> str:
    """The runner's kind and class, for the engine's report, e.g.
    "V2 vllm.v1.worker.gpu.model_runner.GPUModelRunner"."""
    return f"{runner_kind(mr)} {type(mr).__module__}.{type(mr).__qualname__}"


def rpc_model_runner(self: Any) -> str:
    """``runner_name`` of this worker's model runner."""
    return runner_name(runner(self))


def rpc_init_weights(self: Any, seed: int, std: float) -> dict[str, Any]:
    """Re-initialise every parameter from a per-name seed: N(0, std), norms 1 + N(0, std), so
    identical after every restart and not load_format="dummy"'s degenerate output. A drafter's
    own parameters (an MTP layer: V1's ``drafter.model``, V2's ``speculator.model``) too, as
    "drafter.*"; those it shares keep the target's."""
    import hashlib

    import torch

    mr = runner(self)
    params = list(mr.get_model().named_parameters())
    drafter = getattr(getattr(mr, "drafter", getattr(mr, "speculator", None)), "model", None)
    if drafter is not None:
        params += [(f"drafter.{n}", p) for n, p in drafter.named_parameters()]
    fingerprint = hashlib.blake2b(digest_size=16)
    count = 0
    seen: set[int] = set()
    with torch.no_grad():
        for name, p in params:
            if p.data_ptr() in seen:
                continue
            seen.add(p.data_ptr())
            digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
            s = int.from_bytes(digest, "little") & ((1 << 63) - 1)
            gen = torch.Generator(device="cpu").manual_seed(s)
            val = torch.randn(tuple(p.shape), generator=gen, dtype=torch.float32) * std
            module, _, leaf = name.rpartition(".")
            if leaf == "weight" and "norm" in module.rpartition(".")[2]:
                val += 1.0  # RMSNorm / LayerNorm scales (input_layernorm, q_norm, ...)
            p.data.copy_(val.to(device=p.device, dtype=p.dtype))
            count += p.numel()
            fingerprint.update(name.encode())
            fingerprint.update(p.data.flatten()[:64].float().cpu().numpy().tobytes())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return {"rank": rank_of(self), "params": count, "fingerprint": fingerprint.hexdigest()}


def enum_name(value: Any) -> Any:
    """An enum member's name ("FULL_AND_PIECEWISE"), anything else as it is."""
    return getattr(value, "name", value)


def rpc_compilation(self: Any) -> dict[str, Any]:
    """The compilation and CUDA-graph modes of this worker's model runner, which may lower the
    CUDA-graph mode it was configured with to what its attention backends support."""
    cc = getattr(runner(self), "compilation_config", None)
    mode, graphs = (enum_name(getattr(cc, k, None)) for k in ("mode", "cudagraph_mode"))
    return {"rank": rank_of(self), "mode": mode, "cudagraph_mode": graphs}


def rpc_install_block_hook(self: Any) -> str:
    """Record each live request's block ids per KV cache group after every step's state
    update, as that step's forward pass reads them, keyed by prompts.prompt_key (the runner
    drops a finished request's); copy a watched request's GDN checkpoints
    (``rpc_watch_checkpoints``) then. Returns ``runner_name``."""
    mr = runner(self)
    if getattr(mr, "_gate_blocks", None) is None:
        hook = {"V1": _hook_v1, "V2": _hook_v2}[runner_kind(mr)]
        mr._gate_blocks = {}
        mr._gate_watch = {}  # prompt key -> tokens computed at the request's first step
        mr._gate_gdn = {}  # prompt key -> {layer: {block: copy of its GDN checkpoint}}
        hook(mr)
    return runner_name(mr)


def _hook_v1(mr: Any) -> None:
    """V1: after ``_update_states``, each of ``requests``."""
    update = mr._update_states

    def update_states(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        out = update(scheduler_output, *args, **kwargs)
        live = mr.requests.values()
        _record(mr, ((st.prompt_token_ids, st.block_ids, st.num_computed_tokens) for st in live))
        return out

    mr._update_states = update_states


def _hook_v2(mr: Any) -> None:
    """V2: after ``update_requests`` (``execute_model`` runs it after ``finish_requests`` and
    ``add_requests``, then applies the block tables' staged writes to the GPU, then the
    forward pass), each request of ``req_states.req_id_to_index``: its prompt from the step's
    ``scheduled_new_reqs``, its block ids as ``block_tables.append_block_ids`` wrote them into
    its row (so nothing here waits for the GPU)."""
    rows: dict[int, list[list[int]]] = {}  # request row -> its block ids per group
    prompts: dict[str, list[int]] = {}  # live request id -> its prompt tokens
    tables, update = mr.block_tables, mr.update_requests
    append = tables.append_block_ids

    def append_block_ids(req_index: int, new_block_ids: Any, overwrite: bool, **kw: Any) -> Any:
        out = append(req_index, new_block_ids, overwrite, **kw)
        old = [] if overwrite else rows.get(req_index, [])
        rows[req_index] = [
            [*(old[g] if g < len(old) else []), *ids] for g, ids in enumerate(new_block_ids)
        ]
        return out

    def update_requests(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        out = update(scheduler_output, *args, **kwargs)
        for new in scheduler_output.scheduled_new_reqs:
            prompts[new.req_id] = list(new.prompt_token_ids or [])
        live = mr.req_states.req_id_to_index
        for req_id in prompts.keys() - live.keys():
            del prompts[req_id]
        computed = mr.req_states.num_computed_tokens_np
        reqs = [(prompts[r], rows.get(i, []), computed[i]) for r, i in live.items() if r in prompts]
        _record(mr, reqs)
        return out

    tables.append_block_ids = append_block_ids
    mr.update_requests = update_requests


def _record(mr: Any, live: Iterable[tuple[Any, Any, Any]]) -> None:
    """Keep the block table of each live request (prompt tokens, block ids per KV cache group,
    tokens computed), and copy a watched request's completed GDN checkpoints."""
    for prompt, block_ids, computed in live:
        toks = list(prompt or [])
        key = prompt_key(toks)
        blocks = mr._gate_blocks[key] = [list(g) for g in block_ids]
        if key not in mr._gate_watch:
            continue
        if mr._gate_watch[key] is None:
            mr._gate_watch[key] = int(computed)  # its hit block is kept for the next step
        else:
            copy_checkpoints(mr, blocks, min(int(computed), len(toks)), mr._gate_gdn[key])


def rpc_watch_checkpoints(self: Any, key: str) -> None:
    """Keep each GDN checkpoint of the next request of prompt ``key`` as it stood on the first
    step after it was complete, the restored (or prefix-cached) one, block hit/N - 1, on the
    request's second step: from vLLM 0.29 the scheduler frees a Mamba "align" state block
    once the request is two blocks past it and reuses it at once (LIFO) for a later block of
    this or another request, while the worker's append-only block table keeps naming it, so
    after the request that slot may hold another state. ``rpc_kv_hashes`` reports these."""
    mr = runner(self)
    mr._gate_watch[key] = None
    mr._gate_gdn[key] = {}


def kv_layers(mr: Any, blocks: list[list[int]]) -> Iterator[tuple[str, Any, list[int], int]]:
    """(layer, its KV cache, the request's block ids of its group, the group's block size)
    for every layer of every KV cache group; ``blocks``: an id list per group."""
    ctx = mr.compilation_config.static_forward_context
    for gi, group in enumerate(mr.kv_cache_config.kv_cache_groups):
        ids = blocks[gi] if gi < len(blocks) else []
        n = int(group.kv_cache_spec.block_size)
        for layer in group.layer_names:
            yield layer, ctx[layer].kv_cache, ids, n


def copy_checkpoints(
    mr: Any, blocks: list[list[int]], tokens: int, kept: dict[str, dict[str, Any]]
) -> None:
    """Copy into ``kept`` the GDN checkpoints complete at ``tokens`` that it lacks."""
    import torch

    new = []
    for layer, kv, ids, n in kv_layers(mr, blocks):
        if isinstance(kv, (list, tuple)):
            have = kept.setdefault(layer, {})
            end = min(tokens // n, len(ids))
            new += [(kv, have, j, ids[j]) for j in range(end) if ids[j] and str(j) not in have]
    if not new:
        return
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the step that completed them has run
    for kv, have, j, b in new:
        have[str(j)] = [s[b].clone() for s in kv]
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # copied before any later step, on whatever stream, runs


def rpc_kv_hashes(self: Any, key: str, prompt_tokens: int) -> dict[str, Any]:
    """Per-layer, per-logical-block digests (``digest_rows``) of the request's KV, layout
    independent.

    FA (FlashInfer's (B_kernel, H, page, 2*hs), NHD or HND in memory): logical block L is
    kernel pages L*r .. L*r+r-1, its token slots hashed in token order up to the prompt's end.
    GDN ([conv_state, ssm_state] by block id): full prompt blocks j < P//N only, whose slot
    holds the align-mode checkpoint after (j+1)*N tokens, or for a watched request the copy
    ``rpc_watch_checkpoints`` kept. Null blocks (id 0) are skipped."""
    mr = runner(self)
    blocks = getattr(mr, "_gate_blocks", {}).get(key)
    if blocks is None:
        raise RuntimeError(f"no block table recorded for {key[:40]}...; hook not installed?")
    res = hash_blocks(mr, blocks, prompt_tokens)
    getattr(mr, "_gate_watch", {}).pop(key, None)
    for layer, kept in getattr(mr, "_gate_gdn", {}).pop(key, {}).items():
        res["gdn"].setdefault(layer, {}).update({j: digest(s) for j, s in kept.items()})
    return {"rank": rank_of(self), **res}


def request_blocks(mr: Any, req_id: str) -> list[list[int]] | None:
    """The block ids per KV cache group of the running request ``req_id`` (vLLM's internal
    id), None where the runner holds no such request. Between steps: V2's are read from its
    GPU block table, which holds a step's ids from before its forward pass on."""
    if runner_kind(mr) == "V1":
        st = mr.requests.get(req_id)
        return None if st is None else [list(g) for g in st.block_ids]
    row = mr.req_states.req_id_to_index.get(req_id)
    if row is None:
        return None
    tables = mr.block_tables
    counts = [int(n) for n in tables.num_blocks.np[:, row]]
    return [t.gpu[row, :n].tolist() for t, n in zip(tables.block_tables, counts, strict=True)]


def rpc_block_hashes(self: Any, req_id: str, prompt_tokens: int, only: list[int]) -> dict:
    """``rpc_kv_hashes`` of the prompt blocks ``only`` of a running request, by vLLM's
    internal id (load.py hashes before the blocks can be freed and reused)."""
    mr = runner(self)
    blocks = request_blocks(mr, req_id)
    if blocks is None:
        return {"rank": rank_of(self), "missing": True, "fa": {}, "gdn": {}}
    res = hash_blocks(mr, blocks, prompt_tokens, set(only))
    res.pop("block_ids", None)
    return {"rank": rank_of(self), **res}


# The KV digest: two lanes of sum(w_i * x_i) mod 2**61 - 1 over the bytes' 32-bit words x_i, with
# fixed pseudo-random weights w_i in [1, 2**31) per word position. Exact integer arithmetic on
# the tensor's own device (no product or sum leaves int64): the KV stays on the GPU and only 16
# bytes per block reach the host. Any change to one word changes both lanes (w_i is invertible
# mod the prime); a random change of several collides with odds of about 2**-122.
_PRIME = (1 << 61) - 1
_SEED = 0x6B76_6861_7368
_BATCH_BYTES = 64 << 20  # input bytes digested at once (the int64 temporaries are 2-4x)
_WEIGHTS: dict[tuple[int, str], Any] = {}


def _weights(words: int, device: Any) -> Any:
    """(2, words) int64 weights in [1, 2**31), the same for a length on every device."""
    import torch

    key = (words, str(device))
    if key not in _WEIGHTS:
        if len(_WEIGHTS) > 64:
            _WEIGHTS.clear()
        gen = torch.Generator(device="cpu").manual_seed(_SEED ^ words)
        w = torch.randint(1, 1 << 31, (2, words), generator=gen, dtype=torch.int64)
        _WEIGHTS[key] = w.to(device)
    return _WEIGHTS[key]


def _fold(x: Any) -> Any:
    """Row sums mod the prime of (rows, k) values in [0, prime): four at a time, which stay
    below 2**63."""
    import torch

    while x.shape[1] > 1:
        if pad := -x.shape[1] % 4:
            x = torch.cat([x, x.new_zeros(x.shape[0], pad)], dim=1)
        x = x.view(x.shape[0], -1, 4).sum(dim=2) % _PRIME
    return x[:, 0]


def digest_rows(rows: Any) -> list[str]:
    """One digest per row of a (rows, bytes) uint8 tensor: 32 hex digits, on its device."""
    import torch

    if pad := -rows.shape[1] % 4:
        rows = torch.cat([rows, rows.new_zeros(rows.shape[0], pad)], dim=1)
    words = rows.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if words.shape[1] == 0:
        return ["0" * 32] * rows.shape[0]
    lanes = [_fold(words * w % _PRIME).tolist() for w in _weights(words.shape[1], rows.device)]
    return [f"{a:016x}{b:016x}" for a, b in zip(*lanes, strict=True)]


def _as_rows(parts: list[Any]) -> Any:
    """(rows, bytes) uint8: each part (rows, ...) flattened per row, the parts side by side."""
    import torch

    flat = [p.contiguous().reshape(p.shape[0], -1) for p in parts]
    return torch.cat([f.view(torch.uint8).reshape(f.shape[0], -1) for f in flat], dim=1)


def digest(parts: list[Any]) -> str:
    """The digest of the tensors' bytes, in order (``digest_rows`` of one row)."""
    return digest_rows(_as_rows([p.reshape(1, -1) for p in parts]))[0]


def _batches(items: list[Any], item_bytes: int) -> Iterator[list[Any]]:
    step = max(1, _BATCH_BYTES // max(item_bytes, 1))
    for i in range(0, len(items), step):
        yield items[i : i + step]


def _fa_rows(kv: Any, ids: list[int], r: int) -> Any:
    """Blocks ``ids`` of a FlashInfer cache (B_kernel, H, page, 2hs) in token order:
    (len(ids), r * page, H, 2hs)."""
    import torch

    pages = torch.tensor([b * r + i for b in ids for i in range(r)], device=kv.device)
    got = kv.index_select(0, pages)  # (len(ids) * r, H, page, 2hs)
    got = got.view(len(ids), r, *kv.shape[1:]).permute(0, 1, 3, 2, 4)
    return got.reshape(len(ids), r * kv.shape[2], kv.shape[1], kv.shape[3])


def hash_blocks(
    mr: Any, blocks: list[list[int]], prompt_tokens: int, only: set[int] | None = None
) -> dict[str, Any]:
    """``rpc_kv_hashes`` over a block table (an id list per KV cache group)."""
    import torch

    res: dict[str, Any] = {"fa": {}, "gdn": {}, "block_ids": blocks}

    with torch.no_grad():
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for layer, kv, ids, n in kv_layers(mr, blocks):
            res["block_size"] = n
            gdn = isinstance(kv, (list, tuple))  # GDN / Mamba state list
            nblocks = prompt_tokens // n if gdn else -(-prompt_tokens // n)
            js = [j for j in range(min(nblocks, len(ids))) if only is None or j in only]
            wanted = [(j, ids[j]) for j in js if ids[j] != 0]  # 0: the null block
            out: dict[str, str] = {}
            if gdn:
                size = sum(s[0].numel() * s.element_size() for s in kv) if wanted else 0
                for batch in _batches(wanted, size):
                    idx = torch.tensor([b for _, b in batch], device=kv[0].device)
                    rows = _as_rows([s.index_select(0, idx) for s in kv])
                    out.update(zip((str(j) for j, _ in batch), digest_rows(rows), strict=True))
                res["gdn"][layer] = out
                continue
            if kv.dim() != 4:
                raise RuntimeError(f"{layer}: unexpected FA cache rank {kv.dim()}")
            page = res["kernel_page"] = int(kv.shape[2])
            r = n // page
            # Memory order of the logical (B, H, page, 2hs) view; with one kv head per rank
            # the strides cannot tell, so report nothing.
            if kv.shape[1] > 1:
                res["layout"] = "NHD" if kv.stride(2) > kv.stride(1) else "HND"
            full = [(j, b) for j, b in wanted if (j + 1) * n <= prompt_tokens]
            size = n * kv[0].numel() // page * kv.element_size()
            for batch in _batches(full, size):
                rows = _as_rows([_fa_rows(kv, [b for _, b in batch], r)])
                out.update(zip((str(j) for j, _ in batch), digest_rows(rows), strict=True))
            for j, b in (x for x in wanted if x not in full):  # the prompt's partial last block
                tok = _fa_rows(kv, [b], r)[:, : prompt_tokens - j * n]
                out[str(j)] = digest_rows(_as_rows([tok]))[0]
            res["fa"][layer] = out
    return res
