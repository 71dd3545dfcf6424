"""One vLLM engine in a fresh process: ``python -m hybridfa_gate.engine_proc SPEC.json OUT.json``.

SPEC (``specs.engine_spec`` and friends) names the role: cold, store or restore (the restart
gate), fault-store (``fault.py``: a store that also runs the health request and does not wait
for L2) or load (``load.py``: many requests through LLMEngine, see ``load_loop.py``). OUT gets
the result, with "ok" and, on failure, the traceback in "error". The parent sets
VLLM_KV_CACHE_LAYOUT, VLLM_ENABLE_V1_MULTIPROCESSING=0 and PYTHONPATH (lmcache under test
first). The worker-side helpers are in ``worker.py``. This process imports only the gate
modules it runs (tests/harness/test_engine_imports.py pins them).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hybridfa_gate.forge import snapshot
from hybridfa_gate.l2 import wait_l2_stable
from hybridfa_gate.load_loop import load_loop
from hybridfa_gate.prompts import prompt_key
from hybridfa_gate.worker import (
    enum_name,
    rpc_block_hashes,
    rpc_compilation,
    rpc_init_weights,
    rpc_install_block_hook,
    rpc_kv_hashes,
    rpc_model_runner,
    rpc_watch_checkpoints,
)


def _wait_l2(
    tier: str, min_objects: int, timeout: float = 90.0, server_log: str | None = None
) -> dict[str, Any]:
    """Stores are asynchronous: keep this process (and its GPU KV, which the server reads
    through CUDA IPC) alive until the chunks reached the L2 tier (``l2.wait_l2_stable``)."""
    t0 = time.monotonic()
    log = Path(server_log) if server_log else None
    res = wait_l2_stable(tier, min_objects, timeout=timeout, server_log=log)
    return {"store_failures": 0, **res, "waited_s": time.monotonic() - t0}


# (d)'s timed requests of concurrent cases take turns, machine-wide as the GPU is: on 2026-12-06
# two of four cases that timed in the same seconds on one GPU missed (d) by 6 and 45 ms.
TIMING_LOCK = Path(tempfile.gettempdir()) / "hybridfa-gate-timing.lock"
TIMING_TURN_WAIT_S = 120.0


@contextlib.contextmanager
def timing_turn(
    lock: Path | None, record: list[dict[str, Any]], wait_s: float = TIMING_TURN_WAIT_S
) -> Iterator[None]:
    """Hold ``lock`` (flock) around timed requests, so that no other case on this machine
    times its own meanwhile. Without it after ``wait_s`` (a holder that hangs) the requests
    run anyway; ``record`` gets whether the turn was held and how long it took to get."""
    if lock is None:
        yield
        return
    t0 = time.monotonic()
    fd = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o644)  # read-only: another user's file works
    try:
        held = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.monotonic() - t0 >= wait_s:
                    break
                time.sleep(0.02)
        record.append({"held": held, "waited_s": round(time.monotonic() - t0, 3)})
        yield
    finally:
        os.close(fd)  # releases the lock


class PrefillTap:
    """(local, external) cached prompt tokens per internal request id, from a request's first
    EngineCoreOutput (RequestOutput has only their sum): wraps the core client's get_output."""

    def __init__(self, client: Any) -> None:
        self.stats: dict[str, tuple[int, int]] = {}
        self._orig = client.get_output
        client.get_output = self._get_output

    def _get_output(self) -> Any:
        outs = self._orig()
        for o in getattr(outs, "outputs", None) or []:
            if (ps := getattr(o, "prefill_stats", None)) is not None:
                split = (int(ps.num_local_cached_tokens), int(ps.num_external_cached_tokens))
                self.stats[o.request_id] = split
        return outs


# The run's PrefillTap: the local/external split of every request's cached tokens.
TAP: PrefillTap | None = None


def _output(o: Any) -> dict[str, Any]:
    c = o.outputs[0]
    return {
        "tokens": list(c.token_ids),
        "logprobs": [{str(t): float(lp.logprob) for t, lp in d.items()} for d in c.logprobs or []],
        "num_cached_tokens": getattr(o, "num_cached_tokens", None),
        "metrics": vars(o.metrics) if getattr(o, "metrics", None) is not None else None,
    }


def generate_timed(
    llm: Any, prompt: list[int], params: Any, steps: list | None = None, lora: Any = None
) -> tuple[Any, dict[str, Any]]:
    """One request through LLMEngine's step loop: its final output and its TTFT, request time,
    prompt tokens from a cache (all; vLLM's own, local; the connector's, external) and probes
    before and after. ``steps`` gets each step's start and duration; ``lora``: a LoRARequest."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = params.clone()
    params.output_kind = RequestOutputKind.CUMULATIVE
    probe = _request_probe()
    t0 = time.perf_counter()
    rid = f"timed-{time.monotonic_ns()}"  # one per call: an engine times several requests
    tokens = TokensPrompt(prompt_token_ids=prompt)
    internal = engine.add_request(rid, tokens, params, lora_request=lora)
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
                split = TAP.stats.pop(internal or rid, (None, None)) if TAP else (None, None)
                return o, {
                    "ttft_s": total if ttft is None else ttft,
                    "gen_s": total,
                    "num_cached_tokens": getattr(o, "num_cached_tokens", None),
                    "local_cached_tokens": split[0],
                    "external_cached_tokens": split[1],
                    "probe": [probe, _request_probe()],
                }


def scheduler_connector(llm: Any) -> Any:
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    return getattr(getattr(core, "scheduler", None), "connector", None)


def time_lookups(llm: Any, calls: list[dict[str, Any]]) -> bool:
    """Record every call of the scheduler-side connector's lookup. One returns None tokens
    while LMCache still brings the chunks into L1; the scheduler asks again next step."""
    connector = scheduler_connector(llm)
    if connector is None:
        return False
    lookup = connector.get_num_new_matched_tokens

    def timed(request: Any, num_computed_tokens: int) -> Any:
        t = time.perf_counter()
        res = lookup(request, num_computed_tokens)
        calls.append({"t": t, "s": time.perf_counter() - t, "tokens": res[0]})
        return res

    connector.get_num_new_matched_tokens = timed
    return True


@contextlib.contextmanager
def lookups_timed(llm: Any, calls: list[dict[str, Any]], wanted: bool = True) -> Iterator[bool]:
    """``time_lookups`` for the requests run inside only (``wanted``); yields whether the
    lookups are timed."""
    connector = scheduler_connector(llm)
    if not wanted or connector is None:
        yield False
        return
    name = "get_num_new_matched_tokens"
    own = connector.__dict__.get(name)
    time_lookups(llm, calls)
    try:
        yield True
    finally:
        if own is None:
            delattr(connector, name)
        else:
            setattr(connector, name, own)


def restore_timeline(
    t0: float, ttft: float, lookups: list[dict[str, Any]], steps: list[dict[str, float]]
) -> dict[str, Any]:
    """Where a restore's TTFT went: wait_for_hit, until the first lookup that returned tokens
    (LMCache read L2 until then); after_hit, the load, the tail's prefill and the first token,
    with each engine step from the hit to the first token as [start after t0, seconds]."""
    answered = [c for c in lookups if c["tokens"] is not None]
    hit_at = answered[0]["t"] + answered[0]["s"] - t0 if answered else None
    after = [
        [round(st["t"] - t0, 4), round(st["s"], 4)]
        for st in steps
        if hit_at is not None and st["t"] + st["s"] > t0 + hit_at and st["t"] < t0 + ttft
    ]
    return {
        "ttft_s": ttft,
        "lookups": len(lookups),
        "lookups_unanswered": len(lookups) - len(answered),
        "lookup_call_s": round(sum(c["s"] for c in lookups), 6),
        "hit_tokens": answered[0]["tokens"] if answered else None,
        "wait_for_hit_s": hit_at,
        "after_hit_s": None if hit_at is None else ttft - hit_at,
        "steps_after_hit": after,
    }


def _request_probe() -> dict[str, Any]:
    """Wall clock and the bytes this process has read from storage (the OffloadingConnector's
    file tier reads in-process), around each timed request, for bench/gpu_restore.py."""
    io = Path("/proc/self/io")
    lines = io.read_text().splitlines() if io.exists() else []
    read = [int(ln.split(":")[1]) for ln in lines if ln.startswith("read_bytes:")] or [None]
    return {"epoch": time.time(), "read_bytes": read[0]}


def llm_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM ``LLM`` keyword arguments of an engine spec."""
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {
        "model": spec["model_dir"],
        # the tiny models ship a tokenizer only where vLLM needs one (models.write_model_dir)
        "skip_tokenizer_init": not (Path(spec["model_dir"]) / "tokenizer.json").exists(),
        "load_format": "dummy",
        "dtype": "bfloat16",
        # Eager unless the spec says otherwise (``"enforce_eager": false``: CUDA graphs and
        # compilation as vLLM defaults them, the bench's default arm and the gate's graphs
        # cases; ``resolved_compilation`` reads back what vLLM made of it).
        "enforce_eager": bool(spec.get("enforce_eager", True)),
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
        # DSL package ("SM90 GDN prefill DSL kernel is unavailable" where it is missing). The
        # Triton/FLA kernel computes the same recurrence; the KV cache layout is unchanged.
        "gdn_prefill_backend": "triton",
    }
    if spec.get("kv_cache_memory_bytes"):
        kw["kv_cache_memory_bytes"] = int(spec["kv_cache_memory_bytes"])
    if spec.get("kv_cache_dtype"):
        kw["kv_cache_dtype"] = spec["kv_cache_dtype"]
        flashinfer = kw["attention_config"]["backend"] == "FLASHINFER"
        if spec["kv_cache_dtype"] == "fp8_e5m2" and flashinfer:
            # vLLM's FlashInfer backend quantizes the query to e4m3 whatever the KV format and
            # then plans for an e5m2 query: the first prefill raises (vLLM 0.27.1 on SM90). A
            # bf16 query is what its own option for this offers; the KV cache is unchanged.
            kw["attention_config"]["disable_flashinfer_q_quantization"] = True
    if lora := spec.get("lora"):
        kw.update(enable_lora=True, max_lora_rank=int(lora["max_lora_rank"]))
        kw["max_loras"] = max(1, len(lora["adapters"]))
    if spec.get("language_model_only"):
        kw["language_model_only"] = True
    if spec.get("log_stats"):  # RequestOutput.metrics (TTFT) for bench/gpu_restore.py
        kw["disable_log_stats"] = False
    if spec.get("kv_transfer_config"):  # another connector (the bench's OffloadingConnector arm)
        kw["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    elif lmc := spec.get("lmcache"):
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheMPConnector",
            kv_connector_module_path=lmc["module_path"],
            kv_role="kv_both",
            kv_connector_extra_config=lmc["extra_config"],
        )
    return kw


def lora_requests(spec: dict[str, Any]) -> dict[str, Any]:
    """{adapter name: LoRARequest} of a LoRA case's adapters (ids 1, 2, ... by name)."""
    adapters = (spec.get("lora") or {}).get("adapters") or {}
    if not adapters:
        return {}
    from vllm.lora.request import LoRARequest

    return {
        name: LoRARequest(lora_name=name, lora_int_id=i, lora_path=path)
        for i, (name, path) in enumerate(sorted(adapters.items()), 1)
    }


def _build_llm(spec: dict[str, Any], result: dict[str, Any], t_start: float) -> Any:
    import vllm
    from vllm import LLM

    llm = LLM(**llm_kwargs(spec))
    vc = llm.llm_engine.vllm_config
    result["vllm"] = vllm.__version__
    result["engine_up_s"] = round(time.monotonic() - t_start, 2)
    result["cache_block_size"] = vc.cache_config.block_size
    result["mamba_page_size_padded"] = vc.cache_config.mamba_page_size_padded
    result["kv_cache_dtype"] = str(vc.cache_config.cache_dtype)
    # vLLM 0.29+: the layout the engine core resolved (VLLM_KV_CACHE_LAYOUT among the
    # backends' candidates); older vLLMs have no such field.
    if (layout := getattr(vc.cache_config, "kv_cache_layout", None)) is not None:
        result["kv_cache_layout"] = layout
    result["compilation"] = resolved_compilation(llm)
    mode = result["compilation"]["cudagraph_mode"]
    print(f"[gate] engine up in {result['engine_up_s']}s block_size={vc.cache_config.block_size}")
    print(f"[gate] enforce_eager={result['compilation']['enforce_eager']} cudagraph_mode={mode}")
    return llm


def resolved_compilation(llm: Any) -> dict[str, Any]:
    """How vLLM resolved torch.compile and CUDA graphs for ``llm`` (an ``LLM``), whatever was
    asked: the engine's config (``enforce_eager``, the compilation mode, the CUDA-graph mode,
    the largest captured batch) and each worker's model runner's modes (``workers``)."""
    vc = llm.llm_engine.vllm_config
    cc = vc.compilation_config
    return {
        "enforce_eager": bool(vc.model_config.enforce_eager),
        "mode": enum_name(getattr(cc, "mode", None)),
        "cudagraph_mode": enum_name(cc.cudagraph_mode),
        "max_cudagraph_capture_size": getattr(cc, "max_cudagraph_capture_size", None),
        "workers": llm.collective_rpc(rpc_compilation),
    }


def _count_block_table_resyncs(llm: Any) -> dict[str, int] | None:
    """Count the connector tracker's resyncs that found vLLM's block table rewritten in place (the
    speculative tail's moves, freed skipped blocks); None without a resync (pristine)."""
    connector = scheduler_connector(llm)
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


def start_engine(spec: dict[str, Any], result: dict[str, Any]) -> Any:
    """The engine with the spec's weights (weight_std null: the dummy weights, for timing)."""
    llm = _build_llm(spec, result, time.monotonic())
    # vLLM's V1 or V2 model runner, as vLLM chose it (worker.runner_name)
    result["model_runner"] = llm.collective_rpc(rpc_model_runner)[0]
    inits = [{"fingerprint": "dummy"}]
    if spec.get("weight_std") is not None:
        args = (spec["weight_seed"], spec["weight_std"])
        inits = llm.collective_rpc(rpc_init_weights, args=args)
    result["weights"] = inits
    result["weights_fingerprint"] = ",".join(i["fingerprint"] for i in inits)
    return llm


def sampling(max_tokens: int, logprobs: int | None = None) -> Any:
    from vllm import SamplingParams

    greedy = {"temperature": 0.0, "detokenize": False, "ignore_eos": True}
    return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **greedy)


def generate(llm: Any, tokens: list[int], params: Any) -> Any:
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]


# Roles that run the health request after the measured one. fault-store is a store engine
# whose LMCache server fault.py SIGKILLs during the measured request: the
# health request is then the "further request" that must finish within a bounded time.
HEALTH_ROLES = ("restore", "cold", "fault-store")


def run(spec: dict[str, Any], result: dict[str, Any]) -> Any:
    """A gate role: the measured request and what the spec asks around it."""
    global TAP
    llm = start_engine(spec, result)
    llm.collective_rpc(rpc_install_block_hook)
    TAP = PrefillTap(llm.llm_engine.engine_core)
    resyncs = _count_block_table_resyncs(llm)
    greedy = sampling(spec["new_tokens"], spec["top_k"])
    loras = lora_requests(spec)
    generate(llm, spec["warmup"], sampling(2))
    for name, tokens in (spec.get("warm_first") or {}).items():
        result.setdefault("warm_first", {})[name] = generate_timed(llm, tokens, greedy)[1]

    # The measured request, watched: its checkpoints copied as they complete, a restore's
    # lookups and steps timed. Its TTFT is reported, and (d) times other requests.
    lookups: list[dict[str, Any]] = []
    steps: list[dict[str, float]] = []
    if spec.get("kv_hashes", True):
        llm.collective_rpc(rpc_watch_checkpoints, args=(spec["prompt_key"],))
    lora = loras.get(spec.get("prompt_lora") or "")
    with lookups_timed(llm, lookups, spec["role"] == "restore") as timed_lookups:
        e0, t0 = time.time(), time.perf_counter()
        out, timed = generate_timed(llm, spec["prompt"], greedy, steps, lora)
    result.update(timed, request_epoch=[e0, time.time()], **_output(out))
    if timed_lookups:
        result["timeline"] = restore_timeline(t0, result["ttft_s"], lookups, steps)
    print(f"[gate] {spec['role']} ttft_s={result['ttft_s']:.3f} cached={out.num_cached_tokens}")

    hashes = [{"block_size": result["cache_block_size"]}]  # kv_hashes false: timing runs
    if spec.get("kv_hashes", True):
        args = (spec["prompt_key"], len(spec["prompt"]))
        hashes = llm.collective_rpc(rpc_kv_hashes, args=args)
    result["kv_hashes"] = hashes
    n, page = hashes[0].get("block_size"), hashes[0].get("kernel_page")
    ratio = n // page if n and page else None
    result["geometry"] = {"block_size": n, "kernel_page": page, "ratio": ratio}
    result["observed_layout"] = hashes[0].get("layout")
    if resyncs is not None:
        result["block_table_resyncs"] = resyncs
    if (snap := spec.get("l2_snapshot")) and spec.get("l2"):
        # The objects of the measured prompt alone (a forged-object case), once they landed.
        wait = _wait_l2(spec["l2"], int(snap["min_objects"]), server_log=spec.get("server_log"))
        result["l2_snapshot_wait"] = wait
        result["l2_snapshot"] = snapshot(spec["l2"])
    if second := spec.get("second"):
        # The same prompt under another LoRA adapter, right after the measured request.
        lora = loras[second["lora"]]
        out2, timed2 = generate_timed(llm, spec["prompt"], greedy, None, lora)
        result["second"] = {"lora": second["lora"], **timed2, **_output(out2)}
        args = (spec["prompt_key"], len(spec["prompt"]))
        result["second"]["kv_hashes"] = llm.collective_rpc(rpc_kv_hashes, args=args)

    if spec.get("turn2_question"):
        # vLLM's own prefix cache serves turn 1's prompt and answer to turn 2.
        p2 = [*spec["prompt"], *result["tokens"], *spec["turn2_question"]]
        llm.collective_rpc(rpc_watch_checkpoints, args=(prompt_key(p2),))
        out2, timed2 = generate_timed(llm, p2, sampling(spec["turn2_new_tokens"], spec["top_k"]))
        result["turn2"] = {"prompt_tokens": len(p2), **timed2, **_output(out2)}
        args = (prompt_key(p2), len(p2))
        result["turn2"]["kv_hashes"] = llm.collective_rpc(rpc_kv_hashes, args=args)

    if pairs := spec.get("timed_pairs"):
        # (d): a restore of another stored prompt, then a cold prefill, in turn, each
        # unwatched, while no other case on the machine times its own.
        turns: list[dict[str, Any]] = []
        with timing_turn(TIMING_LOCK, turns):
            for pair in pairs:
                timed = {name: generate_timed(llm, t, greedy)[1] for name, t in pair.items()}
                result.setdefault("timed_pairs", []).append(timed)
        result["timing_turns"] = turns

    for tokens in spec.get("also_store") or []:
        generate(llm, tokens, sampling(2))
    if spec.get("step_until_idle_s"):  # the OffloadingConnector's stores move only as we step
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        until = time.monotonic() + float(spec["step_until_idle_s"])
        while sched.has_requests() and time.monotonic() < until:
            llm.llm_engine.step()
        result["idle"] = not sched.has_requests()

    if spec["role"] in HEALTH_ROLES:
        t1, e1 = time.perf_counter(), time.time()
        try:
            toks = list(generate(llm, spec["health"], sampling(8)).outputs[0].token_ids)
            result["health"] = {"ok": len(toks) == 8, "tokens": toks, "s": time.perf_counter() - t1}
        except Exception as e:  # noqa: BLE001 - reported, judged by the gate
            result["health"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        result["health"]["epoch"] = [e1, time.time()]

    if spec["role"] in ("store", "restore") and spec.get("l2"):
        result["l2_wait"] = _wait_l2(
            spec["l2"], int(spec.get("l2_min_objects", 1)), server_log=spec.get("server_log")
        )
    return llm


def run_load(spec: dict[str, Any], result: dict[str, Any]) -> Any:
    """Role load: ``load_loop.load_loop`` for ``load_s`` seconds from when the engine is ready,
    then ``drain_s`` at most; one JSON line per finished request goes to records_path."""
    from vllm.inputs import TokensPrompt

    llm = start_engine(spec, result)
    if (n := result["cache_block_size"]) != spec["block_size"]:  # load.py's block keys need it
        raise RuntimeError(f"vLLM block size {n} != the expected {spec['block_size']}")
    generate(llm, spec["warmup"], sampling(2))
    spec["stop_admitting_epoch"] = time.time() + float(spec["load_s"])
    spec["end_epoch"] = spec["stop_admitting_epoch"] + float(spec["drain_s"])
    engine = llm.llm_engine
    tap = PrefillTap(engine.engine_core)
    params = sampling(spec["new_tokens"])
    # LLMEngine.add_request takes a prompt rendered the way LLM.generate renders it.
    render = getattr(llm, "_preprocess_cmpl_one", None) or (lambda prompt: prompt)

    def submit(request_id: str, tokens: list[int]) -> Any:
        return engine.add_request(request_id, render(TokensPrompt(prompt_token_ids=tokens)), params)

    def hash_rpc(req_id: str, prompt_tokens: int, only: list[int]) -> list[dict[str, Any]]:
        return llm.collective_rpc(rpc_block_hashes, args=(req_id, prompt_tokens, only))

    with open(spec["records_path"], "a") as fh:

        def emit(rec: dict[str, Any]) -> None:
            fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
            fh.flush()

        result["load"] = load_loop(submit, engine.step, hash_rpc, tap.stats, spec, emit)
    print(f"[gate] load {result['load']}")
    if spec.get("l2"):
        # Keep the KV (read by the server through CUDA IPC) alive until the stores landed.
        result["l2_wait"] = _wait_l2(spec["l2"], 0, timeout=15.0, server_log=spec.get("server_log"))
    return llm


def main() -> None:
    spec_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    result: dict[str, Any] = {"role": spec["role"], "ok": False}
    t0 = time.monotonic()
    try:
        llm = (run_load if spec["role"] == "load" else run)(spec, result)
        result["ok"] = True
        out_path.write_text(json.dumps(result))
        print(f"[gate] {spec['role']} done in {time.monotonic() - t0:.1f}s", flush=True)
        # Graceful shutdown when it is quick; the watchdog ends a hung teardown.
        threading.Timer(30.0, os._exit, args=(0,)).start()
        del llm
    except BaseException:  # noqa: BLE001 - the gate reads the traceback from OUT
        result.update(ok=False, error=traceback.format_exc()[-6000:])
        out_path.write_text(json.dumps(result))
        print(result["error"], file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
