"""Worker-side helpers of the engine process, plain functions for ``LLM.collective_rpc``:
``self`` is the worker (or its wrapper). They import torch inside and reach the model runner
through vLLM's V1 ``GPUModelRunner`` attributes (``requests``, ``_update_states``,
``kv_cache_config``, ``compilation_config.static_forward_context``)."""

from __future__ import annotations

from typing import Any


def runner(self: Any) -> Any:
    worker = getattr(self, "worker", None) or self
    return worker.model_runner


def rank_of(self: Any) -> int:
    return int((getattr(self, "worker", None) or self).rank)  # vLLM's WorkerBase sets it


def rpc_init_weights(self: Any, seed: int, std: float) -> dict[str, Any]:
    """Re-initialise every parameter from a per-name seed: N(0, std), norms 1 + N(0, std), so
    identical after every restart and not load_format="dummy"'s degenerate output. A drafter's
    own parameters (an MTP layer) too, as "drafter.*"; those it shares keep the target's."""
    import hashlib

    import torch

    mr = runner(self)
    params = list(mr.get_model().named_parameters())
    drafter = getattr(getattr(mr, "drafter", None), "model", None)
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


def rpc_install_block_hook(self: Any) -> str:
    """Record each live request's block table after every _update_states, keyed by
    prompts.prompt_key: the worker drops a finished request's table."""
    mr = runner(self)
    if getattr(mr, "_gate_blocks", None) is not None:
        return type(mr).__name__
    if not hasattr(mr, "_update_states") or not hasattr(mr, "requests"):
        raise RuntimeError(
            f"{type(mr).__module__}.{type(mr).__name__} has no _update_states/requests; "
            "the gate's block-table hook supports the V1 GPUModelRunner only"
        )
    mr._gate_blocks = {}
    mr._gate_watch = {}  # prompt key -> tokens computed at the request's first step
    mr._gate_hit_gdn = {}  # prompt key -> GDN hashes of that hit's checkpoint
    orig = mr._update_states

    def wrapped(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(scheduler_output, *args, **kwargs)
        for st in mr.requests.values():
            toks = list(st.prompt_token_ids or [])
            key = f"{len(toks)}:" + ",".join(str(t) for t in toks[:16])
            blocks = mr._gate_blocks[key] = [list(g) for g in st.block_ids]
            if key not in mr._gate_watch or key in mr._gate_hit_gdn:
                continue
            hit = mr._gate_watch[key]
            if hit is None:
                mr._gate_watch[key] = int(st.num_computed_tokens)
            elif hit > 0:
                groups = mr.kv_cache_config.kv_cache_groups
                only = {hit // int(g.kv_cache_spec.block_size) - 1 for g in groups}
                mr._gate_hit_gdn[key] = hash_blocks(mr, blocks, hit, only)["gdn"]
        return out

    mr._update_states = wrapped
    return type(mr).__name__


def rpc_watch_hit_checkpoint(self: Any, key: str) -> None:
    """Hash the recurrent checkpoint that the next request of prompt ``key`` starts from
    (block hit/N - 1, restored or served by vLLM's prefix cache) on its second step, while it
    still holds that state: from vLLM 0.29 the scheduler frees a Mamba "align" state block
    once the request is past it and the worker's append-only block table keeps naming it, so
    after the request it may hold another state. ``rpc_kv_hashes`` reports this hash."""
    mr = runner(self)
    mr._gate_watch[key] = None
    mr._gate_hit_gdn.pop(key, None)


def rpc_kv_hashes(self: Any, key: str, prompt_tokens: int) -> dict[str, Any]:
    """Per-layer, per-logical-block blake2b of the request's KV, layout independent.

    FA (FlashInfer's (B_kernel, H, page, 2*hs), NHD or HND in memory): logical block L is
    kernel pages L*r .. L*r+r-1, its token slots hashed in token order up to the prompt's end.
    GDN ([conv_state, ssm_state] by block id): full prompt blocks j < P//N only, whose slot
    holds the align-mode checkpoint after (j+1)*N tokens. Null blocks (id 0) are skipped."""
    mr = runner(self)
    blocks = getattr(mr, "_gate_blocks", {}).get(key)
    if blocks is None:
        raise RuntimeError(f"no block table recorded for {key[:40]}...; hook not installed?")
    res = hash_blocks(mr, blocks, prompt_tokens)
    getattr(mr, "_gate_watch", {}).pop(key, None)
    for layer, early in getattr(mr, "_gate_hit_gdn", {}).pop(key, {}).items():
        res["gdn"].setdefault(layer, {}).update(early)
    return {"rank": rank_of(self), **res}


def rpc_block_hashes(self: Any, req_id: str, prompt_tokens: int, only: list[int]) -> dict:
    """``rpc_kv_hashes`` of the prompt blocks ``only`` of a running request, by vLLM's
    internal id (load.py hashes before the blocks can be freed and reused)."""
    mr = runner(self)
    st = getattr(mr, "requests", {}).get(req_id)
    if st is None:
        return {"rank": rank_of(self), "missing": True, "fa": {}, "gdn": {}}
    res = hash_blocks(mr, [list(g) for g in st.block_ids], prompt_tokens, set(only))
    res.pop("block_ids", None)
    return {"rank": rank_of(self), **res}


def hash_blocks(
    mr: Any, blocks: list[list[int]], prompt_tokens: int, only: set[int] | None = None
) -> dict[str, Any]:
    """``rpc_kv_hashes`` over a block table (an id list per KV cache group)."""
    import hashlib

    import torch

    ctx = mr.compilation_config.static_forward_context
    res: dict[str, Any] = {"fa": {}, "gdn": {}, "block_ids": blocks}

    def digest(t: torch.Tensor) -> str:
        data = t.contiguous().flatten().view(torch.uint8).cpu().numpy().tobytes()
        return hashlib.blake2b(data, digest_size=16).hexdigest()

    with torch.no_grad():
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for gi, group in enumerate(mr.kv_cache_config.kv_cache_groups):
            ids = blocks[gi] if gi < len(blocks) else []
            n = res["block_size"] = int(group.kv_cache_spec.block_size)
            for layer in group.layer_names:
                kv = ctx[layer].kv_cache
                gdn = isinstance(kv, (list, tuple))  # GDN / Mamba state list
                nblocks = prompt_tokens // n if gdn else -(-prompt_tokens // n)
                js = [j for j in range(min(nblocks, len(ids))) if only is None or j in only]
                wanted = [(j, ids[j]) for j in js if ids[j] != 0]  # 0: the null block
                if gdn:
                    res["gdn"][layer] = {
                        str(j): digest(torch.cat([s[b].flatten().view(torch.uint8) for s in kv]))
                        for j, b in wanted
                    }
                    continue
                if kv.dim() != 4:
                    raise RuntimeError(f"{layer}: unexpected FA cache rank {kv.dim()}")
                page = res["kernel_page"] = int(kv.shape[2])
                r = n // page
                # Memory order of the logical (B, H, page, 2hs) view; with one kv head per rank
                # the strides cannot tell, so report nothing.
                if kv.shape[1] > 1:
                    res["layout"] = "NHD" if kv.stride(2) > kv.stride(1) else "HND"
                fa: dict[str, str] = {}
                for j, b in wanted:
                    pages = kv[b * r : (b + 1) * r]  # (r, H, page, 2hs)
                    tok = pages.permute(0, 2, 1, 3).reshape(r * page, kv.shape[1], kv.shape[3])
                    fa[str(j)] = digest(tok[: min(n, prompt_tokens - j * n)])
                res["fa"][layer] = fa
    return res
