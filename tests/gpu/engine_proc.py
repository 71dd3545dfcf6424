"""One vLLM engine in a fresh process, for the restart gate (gate.py starts it).

    python tests/gpu/engine_proc.py SPEC.json OUT.json

SPEC (written by gate.engine_spec): role cold|store|restore, model_dir, prompt/warmup/health
token ids, engine knobs, optional "lmcache" connector settings, and for the store role the
L2 folder to watch and "also_store" prompts; a restore spec may hold "warm_first" prompts
(timed, before the measured one), a "cold_reference" (timed, after it) and "timed_pairs"
(a restore and a cold prefill each, timed after that). Role
fault-store (fault_kill_mid_store.py) is a store engine that runs the health request too
and does not wait for L2; role load (load.py) keeps many requests in flight through
LLMEngine and writes per-request records (see ``load.load_loop``). OUT gets a JSON result with
"ok"; on failure "error" holds the traceback. The parent sets
VLLM_KV_CACHE_LAYOUT, VLLM_ENABLE_V1_MULTIPROCESSING=0 and the PYTHONPATH (lmcache under
test first).

Worker-side helpers are plain functions handed to ``LLM.collective_rpc``; they receive
the worker (or its WorkerWrapperBase, which forwards attributes) as ``self`` and import
what they need inside, so they also pickle by value into TP worker processes.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import gate  # noqa: E402  (stdlib only: the L2 folder helpers)
import load  # noqa: E402  (stdlib only: the load role's request loop)

# ---------------------------------------------------------------------------------------
# Worker side (run through collective_rpc)
# ---------------------------------------------------------------------------------------


def _runner(self: Any) -> Any:
    worker = getattr(self, "worker", None) or self
    return worker.model_runner


def _rank(self: Any) -> int:
    worker = getattr(self, "worker", None) or self
    r = getattr(worker, "rank", None)
    if r is None:
        import torch.distributed as dist

        r = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return int(r)


def _rpc_init_weights(self: Any, seed: int, std: float) -> dict[str, Any]:
    """Re-initialise every parameter from a per-name seed: N(0, std), norms 1 + N(0, std).

    Identical after every restart (CPU generator, seed from the parameter name), and
    not the degenerate output of load_format="dummy" alone. A speculative drafter's own
    parameters (an MTP layer) too, under "drafter."; those it shares with the target model
    (embeddings, LM head) keep the target's values.
    """
    import hashlib

    import torch

    mr = _runner(self)
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
            s = int.from_bytes(
                hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little"
            ) & ((1 << 63) - 1)
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
    return {"rank": _rank(self), "params": count, "fingerprint": fingerprint.hexdigest()}


def _rpc_install_block_hook(self: Any) -> str:
    """Record each live request's block table after every _update_states.

    The worker drops finished requests from model_runner.requests, so the table of the
    measured request is snapshotted while it runs, keyed by gate.prompt_key.
    """
    mr = _runner(self)
    if getattr(mr, "_gate_blocks", None) is not None:
        return type(mr).__name__
    if not hasattr(mr, "_update_states") or not hasattr(mr, "requests"):
        raise RuntimeError(
            f"{type(mr).__module__}.{type(mr).__name__} has no _update_states/requests; "
            "the gate's block-table hook supports the V1 GPUModelRunner only"
        )
    mr._gate_blocks = {}
    orig = mr._update_states

    def wrapped(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(scheduler_output, *args, **kwargs)
        for st in mr.requests.values():
            toks = list(st.prompt_token_ids or [])
            key = f"{len(toks)}:" + ",".join(str(t) for t in toks[:16])
            mr._gate_blocks[key] = [list(g) for g in st.block_ids]
        return out

    mr._update_states = wrapped
    return type(mr).__name__


def _rpc_kv_hashes(self: Any, key: str, prompt_tokens: int) -> dict[str, Any]:
    """Per-layer, per-logical-block blake2b of the request's KV, layout independent.

    FA (rank-4 FlashInfer tensor, logical shape (B_kernel, H, page, 2*hs), NHD or HND in
    memory): logical block id L covers kernel pages L*r .. L*r+r-1; its token slots are
    gathered in token order (N, H, 2*hs) and only the first k slots hashed, k = prompt
    tokens inside that block. Every prompt block is hashed.
    GDN ([conv_state, ssm_state] indexed by block id): only full prompt blocks j < P//N,
    whose slot holds the align-mode checkpoint after (j+1)*N tokens. Null blocks (id 0)
    are skipped: a restored request holds nulls below its hit.
    """
    mr = _runner(self)
    blocks = getattr(mr, "_gate_blocks", {}).get(key)
    if blocks is None:
        raise RuntimeError(f"no block table recorded for {key[:40]}...; hook not installed?")
    return {"rank": _rank(self), **_hash_blocks(mr, blocks, prompt_tokens)}


def _rpc_block_hashes(
    self: Any, req_id: str, prompt_tokens: int, only: list[int]
) -> dict[str, Any]:
    """``_rpc_kv_hashes`` for a request that is still running, by vLLM's internal request id,
    restricted to the prompt block indices in ``only`` (load.py hashes while the request
    decodes, before its blocks can be freed and reused)."""
    mr = _runner(self)
    st = getattr(mr, "requests", {}).get(req_id)
    if st is None:
        return {"rank": _rank(self), "missing": True, "fa": {}, "gdn": {}}
    res = _hash_blocks(mr, [list(g) for g in st.block_ids], prompt_tokens, set(only))
    res.pop("block_ids", None)
    return {"rank": _rank(self), **res}


def _hash_blocks(
    mr: Any, blocks: list[list[int]], prompt_tokens: int, only: set[int] | None = None
) -> dict[str, Any]:
    """The hashing of ``_rpc_kv_hashes`` over a block table (one id list per KV cache
    group); ``only``: hash just these prompt block indices (None: every block)."""
    import hashlib

    import torch

    ctx = mr.compilation_config.static_forward_context
    groups = mr.kv_cache_config.kv_cache_groups
    res: dict[str, Any] = {"fa": {}, "gdn": {}, "block_ids": blocks}

    def digest(t: torch.Tensor) -> str:
        data = t.contiguous().flatten().view(torch.uint8).cpu().numpy().tobytes()
        return hashlib.blake2b(data, digest_size=16).hexdigest()

    def wanted(j: int) -> bool:
        return only is None or j in only

    with torch.no_grad():
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for gi, group in enumerate(groups):
            ids = blocks[gi] if gi < len(blocks) else []
            n = int(group.kv_cache_spec.block_size)
            res["block_size"] = n
            for layer in group.layer_names:
                kv = ctx[layer].kv_cache
                if isinstance(kv, (list, tuple)):  # GDN / Mamba state list
                    out: dict[str, str] = {}
                    for j in range(min(prompt_tokens // n, len(ids))):
                        b = ids[j]
                        if b == 0 or not wanted(j):
                            continue
                        out[str(j)] = digest(
                            torch.cat([s[b].flatten().view(torch.uint8) for s in kv])
                        )
                    res["gdn"][layer] = out
                    continue
                if kv.dim() != 4:
                    raise RuntimeError(f"{layer}: unexpected FA cache rank {kv.dim()}")
                page = int(kv.shape[2])
                r = n // page
                res["kernel_page"] = page
                # Memory order of the logical (B, H, page, 2hs) view; with one kv head
                # per rank the strides cannot tell, so report nothing.
                if kv.shape[1] > 1:
                    res["layout"] = "NHD" if kv.stride(2) > kv.stride(1) else "HND"
                fa: dict[str, str] = {}
                nblocks = -(-prompt_tokens // n)
                for j in range(min(nblocks, len(ids))):
                    b = ids[j]
                    if b == 0 or not wanted(j):
                        continue
                    k = min(n, prompt_tokens - j * n)
                    pages = kv[b * r : (b + 1) * r]  # (r, H, page, 2hs)
                    tok = pages.permute(0, 2, 1, 3).reshape(r * page, kv.shape[1], kv.shape[3])
                    fa[str(j)] = digest(tok[:k])
                res["fa"][layer] = fa
    return res


# ---------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------


def _wait_l2(
    tier: str, min_objects: int, timeout: float = 90.0, server_log: str | None = None
) -> dict[str, Any]:
    """Stores are asynchronous: keep this process (and its GPU KV, which the server reads
    through CUDA IPC) alive until the chunks reached the server's L2 tier, or until the
    tier is quiet and the server logged failed stores (the rest will never come)."""
    t0 = time.monotonic()
    log = Path(server_log) if server_log else None
    res = gate.wait_l2_stable(tier, min_objects, timeout=timeout, server_log=log)
    return {"store_failures": 0, **res, "waited_s": time.monotonic() - t0}


class PrefillTap:
    """(local, external) cached prompt tokens per internal request id.

    vLLM 0.26 attaches ``prefill_stats`` (num_local_cached_tokens: the engine's own prefix
    cache; num_external_cached_tokens: the KV connector's, i.e. LMCache's) to a request's
    first EngineCoreOutput, but RequestOutput only carries their sum. The tap wraps the
    engine-core client's ``get_output`` (in-process with VLLM_ENABLE_V1_MULTIPROCESSING=0)
    and keeps the split.
    """

    def __init__(self, client: Any) -> None:
        self.stats: dict[str, tuple[int, int]] = {}
        self._orig = client.get_output
        client.get_output = self._get_output

    def _get_output(self) -> Any:
        outs = self._orig()
        for o in getattr(outs, "outputs", None) or []:
            ps = getattr(o, "prefill_stats", None)
            if ps is not None:
                self.stats[o.request_id] = (
                    int(ps.num_local_cached_tokens),
                    int(ps.num_external_cached_tokens),
                )
        return outs


# The run's PrefillTap: the local/external split of every request's cached tokens.
TAP: PrefillTap | None = None


def _output(o: Any) -> dict[str, Any]:
    c = o.outputs[0]
    steps = []
    for d in c.logprobs or []:
        steps.append({str(t): float(lp.logprob) for t, lp in d.items()})
    return {
        "tokens": list(c.token_ids),
        "logprobs": steps,
        "num_cached_tokens": getattr(o, "num_cached_tokens", None),
        "metrics": vars(o.metrics) if getattr(o, "metrics", None) is not None else None,
    }


def _generate_timed(
    llm: Any,
    prompt: list[int],
    params: Any,
    steps: list[dict[str, float]] | None = None,
    prefill: dict[str, Any] | None = None,
) -> tuple[Any, float, float]:
    """One request through LLMEngine's step loop: (final output, TTFT s, total s).

    LLM.generate only returns the finished request, so its wall time includes every decode
    step; the prefill the gate compares is the time to the first token. ``steps`` gets each
    engine step's start and duration (s from t0, perf_counter); ``prefill`` gets the
    request's local and external cached tokens (from the run's PrefillTap).
    """
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = params.clone()
    params.output_kind = RequestOutputKind.CUMULATIVE
    probe = _request_probe()
    t0 = time.perf_counter()
    rid = f"timed-{time.monotonic_ns()}"  # one per call: an engine times several requests
    internal = engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
    ttft: float | None = None
    while True:
        ts = time.perf_counter()
        outs = engine.step()  # the only request in flight
        if steps is not None:
            steps.append({"t": ts, "s": time.perf_counter() - ts})
        for o in outs:
            if ttft is None and o.outputs and o.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
            if o.finished:
                total = time.perf_counter() - t0
                if prefill is not None and TAP is not None:
                    local, external = TAP.stats.pop(internal or rid, (None, None))
                    prefill.update(local_cached_tokens=local, external_cached_tokens=external)
                if prefill is not None:
                    prefill["probe"] = [probe, _request_probe()]
                return o, (total if ttft is None else ttft), total


def _timed_summary(llm: Any, prompt: list[int], params: Any) -> dict[str, Any]:
    """TTFT, request time and prompt tokens served from a cache of one timed request."""
    split: dict[str, Any] = {}
    out, ttft, total = _generate_timed(llm, prompt, params, prefill=split)
    return {
        "ttft_s": ttft,
        "gen_s": total,
        "num_cached_tokens": getattr(out, "num_cached_tokens", None),
        **split,
    }


def _scheduler_connector(llm: Any) -> Any:
    """The scheduler-side KV connector of an in-process engine core
    (VLLM_ENABLE_V1_MULTIPROCESSING=0), None without one."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    return getattr(getattr(core, "scheduler", None), "connector", None)


def _time_lookups(llm: Any, calls: list[dict[str, Any]]) -> bool:
    """Record every call of the scheduler-side connector's lookup (in-process engine core:
    VLLM_ENABLE_V1_MULTIPROCESSING=0). A lookup returns None tokens while LMCache is still
    bringing the chunks into L1; the scheduler asks again on the next step."""
    connector = _scheduler_connector(llm)
    if connector is None:
        return False
    from torch.profiler import record_function

    lookup = connector.get_num_new_matched_tokens

    def timed(request: Any, num_computed_tokens: int) -> Any:
        t = time.perf_counter()
        with record_function("hybridfa: connector lookup"):
            res = lookup(request, num_computed_tokens)
        calls.append({"t": t, "s": time.perf_counter() - t, "tokens": res[0]})
        return res

    connector.get_num_new_matched_tokens = timed
    return True


def restore_timeline(
    t0: float, ttft: float, lookups: list[dict[str, Any]], steps: list[dict[str, float]]
) -> dict[str, Any]:
    """Where a restore's time to first token went, from the engine's side.

    wait_for_hit: from the request's arrival to the lookup that first returned a token
    count (LMCache was reading L2 until then); after_hit: the load into vLLM's KV cache,
    the recomputed tail and the first token.
    """
    answered = [c for c in lookups if c["tokens"] is not None]
    hit_at = answered[0]["t"] + answered[0]["s"] - t0 if answered else None
    return {
        "ttft_s": ttft,
        "lookups": len(lookups),
        "lookups_unanswered": len(lookups) - len(answered),
        "lookup_call_s": round(sum(c["s"] for c in lookups), 6),
        "hit_tokens": answered[0]["tokens"] if answered else None,
        "wait_for_hit_s": hit_at,
        "after_hit_s": None if hit_at is None else ttft - hit_at,
        "steps": len(steps),
        "longest_step_s": max((st["s"] for st in steps), default=None),
    }


def _profiled(spec: dict[str, Any], run_request: Any) -> tuple[Any, dict[str, Any] | None]:
    """run_request() under torch.profiler when the spec names a profile_dir: a gzipped
    Chrome trace and the top ops by host and by GPU time go there."""
    out_dir = spec.get("profile_dir")
    if not out_dir:
        return run_request(), None
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        value = run_request()
    trace = out / "trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()
    averages = prof.key_averages()
    for key, name in (("self_cpu_time_total", "cpu"), ("self_device_time_total", "device")):
        try:
            (out / f"ops-by-{name}.txt").write_text(averages.table(sort_by=key, row_limit=30))
        except (AttributeError, KeyError, ValueError) as e:
            (out / f"ops-by-{name}.txt").write_text(f"no table: {type(e).__name__}: {e}\n")
    return value, {"dir": str(out), "trace": f"{trace}.gz"}


def _request_probe() -> dict[str, Any]:
    """Wall clock and the bytes this process has read from storage (the OffloadingConnector's
    file tier reads in-process), around each timed request, for bench/gpu_restore.py."""
    io = Path("/proc/self/io")
    lines = io.read_text().splitlines() if io.exists() else []
    read = [int(ln.split(":")[1]) for ln in lines if ln.startswith("read_bytes:")] or [None]
    return {"epoch": time.time(), "read_bytes": read[0]}


def _build_llm(spec: dict[str, Any], result: dict[str, Any], t_start: float) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {
        "model": spec["model_dir"],
        "skip_tokenizer_init": True,
        "load_format": "dummy",
        "dtype": "bfloat16",
        "enforce_eager": True,
        "seed": 0,
        "gpu_memory_utilization": spec["gpu_memory_utilization"],
        "max_model_len": spec["max_model_len"],
        "max_num_batched_tokens": spec["max_num_batched_tokens"],
        "enable_prefix_caching": True,
        "mamba_cache_mode": "align",
        "attention_config": {"backend": spec.get("attention_backend", "FLASHINFER")},
        "tensor_parallel_size": spec["tensor_parallel_size"],
        "speculative_config": spec.get("speculative_config"),
        # Qwen3.5's GDN prefill defaults to FlashInfer on SM90, whose kernel needs the CuTe
        # DSL package our node lacks ("SM90 GDN prefill DSL kernel is unavailable"). The
        # Triton/FLA kernel computes the same recurrence; the KV cache layout is unchanged.
        "gdn_prefill_backend": spec.get("gdn_prefill_backend", "triton"),
    }
    if spec.get("kv_cache_memory_bytes"):
        kw["kv_cache_memory_bytes"] = int(spec["kv_cache_memory_bytes"])
    if spec.get("language_model_only"):
        kw["language_model_only"] = True
    if spec.get("log_stats"):  # RequestOutput.metrics (TTFT) for bench/gpu_restore.py
        kw["disable_log_stats"] = False
    lmc = spec.get("lmcache")
    if spec.get("kv_transfer_config"):  # another connector (the bench's OffloadingConnector arm)
        kw["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    elif lmc:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheMPConnector",
            kv_connector_module_path=lmc["module_path"],
            kv_role="kv_both",
            kv_connector_extra_config=lmc["extra_config"],
        )
    llm = LLM(**kw)
    vc = llm.llm_engine.vllm_config
    result["engine_up_s"] = round(time.monotonic() - t_start, 2)
    result["cache_block_size"] = vc.cache_config.block_size
    result["mamba_page_size_padded"] = vc.cache_config.mamba_page_size_padded
    print(
        f"[gate] engine up in {result['engine_up_s']}s block_size={vc.cache_config.block_size}",
        flush=True,
    )
    return llm


def _count_block_table_resyncs(llm: Any) -> dict[str, int] | None:
    """Count how often patch 0003's tracker resync found vLLM's live block table changed
    (a slot rewritten in place, not just appended): the speculative tail's moves and the
    freed skipped blocks. None where the connector has no resync (pristine, no connector)."""
    connector = _scheduler_connector(llm)
    module = sys.modules.get(type(connector).__module__) if connector is not None else None
    tracker = getattr(module, "LMCacheMPRequestTracker", None)
    sync = getattr(tracker, "sync_block_ids", None)
    if sync is None:
        return None
    counts = {"calls": 0, "rewrites": 0}

    def counted(self: Any) -> None:
        # allocated_block_ids: engine group index -> block ids
        before = {g: list(ids) for g, ids in self.allocated_block_ids.items()}
        sync(self)
        counts["calls"] += 1
        after = self.allocated_block_ids
        if any(list(after.get(g, []))[: len(b)] != b for g, b in before.items()):
            counts["rewrites"] += 1

    tracker.sync_block_ids = counted
    return counts


def _init_weights(llm: Any, spec: dict[str, Any], result: dict[str, Any]) -> None:
    inits = [{"fingerprint": "dummy"}]  # weight_std null: keep the dummy weights (timing runs)
    if spec.get("weight_std") is not None:
        args = (spec["weight_seed"], spec["weight_std"])
        inits = llm.collective_rpc(_rpc_init_weights, args=args)
    result["weights"] = inits
    result["weights_fingerprint"] = ",".join(i["fingerprint"] for i in inits)


# Roles that run the health request after the measured one. fault-store is a store engine
# whose LMCache server fault_kill_mid_store.py SIGKILLs during the measured request: the
# health request is then the "further request" that must finish within a bounded time.
HEALTH_ROLES = ("restore", "cold", "fault-store")


def run(spec: dict[str, Any], result: dict[str, Any], out_path: Path) -> None:
    t_start = time.monotonic()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    global TAP
    llm = _build_llm(spec, result, t_start)
    vc = llm.llm_engine.vllm_config
    _init_weights(llm, spec, result)
    result["model_runner"] = llm.collective_rpc(_rpc_install_block_hook)[0]
    TAP = PrefillTap(llm.llm_engine.engine_core)
    resyncs = _count_block_table_resyncs(llm)

    greedy = SamplingParams(
        max_tokens=spec["new_tokens"],
        temperature=0.0,
        logprobs=spec["top_k"],
        detokenize=False,
        ignore_eos=True,
    )
    short = SamplingParams(max_tokens=2, temperature=0.0, detokenize=False, ignore_eos=True)

    llm.generate([TokensPrompt(prompt_token_ids=spec["warmup"])], short, use_tqdm=False)
    for name, tokens in (spec.get("warm_first") or {}).items():
        result.setdefault("warm_first", {})[name] = _timed_summary(llm, tokens, greedy)

    lookups: list[dict[str, Any]] = []
    steps: list[dict[str, float]] = []
    timed_lookups = spec["role"] == "restore" and _time_lookups(llm, lookups)
    e0 = time.time()
    t0 = time.perf_counter()
    split: dict[str, Any] = {}
    (out, result["ttft_s"], result["gen_s"]), result["profile"] = _profiled(
        spec, functools.partial(_generate_timed, llm, spec["prompt"], greedy, steps, split)
    )
    result["request_epoch"] = [e0, time.time()]
    result.update(split)
    if timed_lookups:
        result["timeline"] = restore_timeline(t0, result["ttft_s"], lookups, steps)
    result.update(_output(out))
    print(
        f"[gate] {spec['role']} ttft_s={result['ttft_s']:.3f} gen_s={result['gen_s']:.3f} "
        f"cached={result['num_cached_tokens']} tokens={result['tokens'][:8]}",
        flush=True,
    )

    hashes = [{"block_size": vc.cache_config.block_size}]  # kv_hashes false: timing runs
    if spec.get("kv_hashes", True):
        args = (spec["prompt_key"], len(spec["prompt"]))
        hashes = llm.collective_rpc(_rpc_kv_hashes, args=args)
    result["kv_hashes"] = hashes
    h0 = hashes[0]
    n = h0.get("block_size")
    page = h0.get("kernel_page")
    result["geometry"] = {
        "block_size": n,
        "kernel_page": page,
        "ratio": (n // page) if n and page else None,
    }
    result["observed_layout"] = h0.get("layout")
    if resyncs is not None:
        result["block_table_resyncs"] = dict(resyncs)
        print(f"[gate] {spec['role']} block-table resyncs (patch 0003): {resyncs}", flush=True)

    if spec.get("turn2_question"):
        # vLLM's own prefix cache serves turn 1's prompt and answer to turn 2.
        p2 = [*spec["prompt"], *result["tokens"], *spec["turn2_question"]]
        turn2 = greedy.clone()
        turn2.max_tokens = int(spec["turn2_new_tokens"])
        split2: dict[str, Any] = {}
        out2, ttft2, _ = _generate_timed(llm, p2, turn2, prefill=split2)
        result["turn2"] = {"prompt_tokens": len(p2), "ttft_s": ttft2, **_output(out2), **split2}
        result["turn2"]["kv_hashes"] = llm.collective_rpc(
            _rpc_kv_hashes, args=(gate.prompt_key(p2), len(p2))
        )
        print(f"[gate] turn 2 prefix-cache hit {split2} of {len(p2)} tokens", flush=True)

    if spec.get("cold_reference"):
        # The same prefill with nothing to restore, in this engine and under this load,
        # timed after the measured request (which so pays any first-use costs).
        result["cold_reference"] = _timed_summary(llm, spec["cold_reference"], greedy)
    for pair in spec.get("timed_pairs") or []:
        # (d)'s repeats: a restore of another stored prompt, then a cold prefill, in turn.
        timed = {name: _timed_summary(llm, tokens, greedy) for name, tokens in pair.items()}
        result.setdefault("timed_pairs", []).append(timed)

    for tokens in spec.get("also_store") or []:
        llm.generate([TokensPrompt(prompt_token_ids=tokens)], short, use_tqdm=False)
    if spec.get("drain_s"):  # the OffloadingConnector moves its stores on only while we step
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        until = time.monotonic() + float(spec["drain_s"])
        while sched.has_requests() and time.monotonic() < until:
            llm.llm_engine.step()
        result["drained"] = not sched.has_requests()

    if spec["role"] == "store" and spec.get("l2"):
        result["l2_wait"] = _wait_l2(
            spec["l2"], int(spec.get("l2_min_objects", 1)), server_log=spec.get("server_log")
        )

    if spec["role"] in HEALTH_ROLES:
        t1 = time.perf_counter()
        e1 = time.time()
        try:
            h = llm.generate(
                [TokensPrompt(prompt_token_ids=spec["health"])],
                SamplingParams(max_tokens=8, temperature=0.0, detokenize=False, ignore_eos=True),
                use_tqdm=False,
            )
            toks = list(h[0].outputs[0].token_ids)
            result["health"] = {"ok": len(toks) == 8, "tokens": toks, "s": time.perf_counter() - t1}
        except Exception as e:  # noqa: BLE001 - reported, judged by the gate
            result["health"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        result["health"]["epoch"] = [e1, time.time()]
    result["ok"] = True
    out_path.write_text(json.dumps(result))
    print(f"[gate] {spec['role']} done in {time.monotonic() - t_start:.1f}s", flush=True)
    # Graceful shutdown when it is quick; the watchdog ends a hung teardown.
    threading.Timer(30.0, os._exit, args=(0,)).start()
    del llm


# ---------------------------------------------------------------------------------------
# Role "load" (tests/gpu/load.py): many concurrent requests through LLMEngine
# ---------------------------------------------------------------------------------------


def run_load(spec: dict[str, Any], result: dict[str, Any], out_path: Path) -> None:
    t_start = time.monotonic()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = _build_llm(spec, result, t_start)
    if result["cache_block_size"] != spec["block_size"]:
        # load.py's block keys and hash ranges assume the gate's expected geometry
        raise RuntimeError(
            f"vLLM block size {result['cache_block_size']} != expected {spec['block_size']}"
        )
    _init_weights(llm, spec, result)
    short = SamplingParams(max_tokens=2, temperature=0.0, detokenize=False, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=spec["warmup"])], short, use_tqdm=False)
    result["ready_epoch"] = time.time()
    result["deadline_shift_s"] = load.shift_deadlines(spec, result["ready_epoch"])
    if "kill_epoch" in spec:  # --kill hard: die mid-load the way a SIGKILL from outside would
        delay = max(0.0, float(spec["kill_epoch"]) - time.time())
        threading.Timer(delay, os.kill, args=(os.getpid(), signal.SIGKILL)).start()

    engine = llm.llm_engine
    tap = PrefillTap(engine.engine_core)
    params = SamplingParams(
        max_tokens=spec["new_tokens"], temperature=0.0, detokenize=False, ignore_eos=True
    )
    # LLM.generate renders a prompt before LLMEngine.add_request; do the same (raw prompts
    # are deprecated there).
    pre = getattr(llm, "_preprocess_cmpl_one", None)

    def render(tokens: list[int]) -> Any:
        prompt = TokensPrompt(prompt_token_ids=list(tokens))
        return pre(prompt) if pre is not None else prompt

    rpc = llm.collective_rpc

    def hash_rpc(req_id: str, prompt_tokens: int, only: list[int]) -> list[dict[str, Any]]:
        return rpc(_rpc_block_hashes, args=(req_id, prompt_tokens, only))

    with open(spec["records_path"], "a") as fh:

        def emit(rec: dict[str, Any]) -> None:
            fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
            fh.flush()

        result["load"] = load.load_loop(engine, render, params, hash_rpc, tap.stats, spec, emit)
    print(f"[gate] load {result['load']}", flush=True)
    if spec.get("l2"):
        # Keep the KV (read by the server through CUDA IPC) alive until the stores landed.
        left = float(spec.get("exit_epoch", spec["end_epoch"])) - time.time()
        wait = max(0.0, min(float(spec.get("l2_quiet_timeout", 15.0)), left))
        result["l2_wait"] = _wait_l2(spec["l2"], 0, timeout=wait, server_log=spec.get("server_log"))
    result["ok"] = True
    out_path.write_text(json.dumps(result))
    print(f"[gate] load done in {time.monotonic() - t_start:.1f}s", flush=True)
    threading.Timer(30.0, os._exit, args=(0,)).start()
    del llm


def main() -> None:
    spec_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    result: dict[str, Any] = {"role": spec["role"], "ok": False}
    try:
        (run_load if spec["role"] == "load" else run)(spec, result, out_path)
    except BaseException:  # noqa: BLE001 - the gate reads the traceback from OUT
        result["ok"] = False
        result["error"] = traceback.format_exc()[-6000:]
        out_path.write_text(json.dumps(result))
        print(result["error"], file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
