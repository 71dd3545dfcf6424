"""The engine process's helpers (hybridfa_gate.engine_proc, hybridfa_gate.worker) on fake CPU
model runners and engines."""

from __future__ import annotations

import sys
import threading
from types import SimpleNamespace as NS

import pytest
from runner_fakes import DRAFTER, RUNNERS, step

from hybridfa_gate import engine_proc, worker
from hybridfa_gate.judge import compare_kv_hashes
from hybridfa_gate.prompts import make_prompt, prompt_key

KINDS = pytest.mark.parametrize("kind", sorted(RUNNERS))  # vLLM's V1 and V2 model runners


def _fa_views(torch, n_kernel: int, page: int, heads: int, width: int, seed: int = 0):
    """Same token-major content as an NHD (strided) and an HND (contiguous) FA cache."""
    g = torch.Generator().manual_seed(seed)
    tok = torch.randn(n_kernel, page, heads, width, generator=g).to(torch.bfloat16)
    nhd = tok.permute(0, 2, 1, 3)  # logical (B, H, page, 2hs), memory (B, page, H, 2hs)
    hnd = tok.permute(0, 2, 1, 3).contiguous()
    return nhd, hnd


def _fake_worker(kind: str, torch, fa=None, gdn=None, n: int = 80):
    """A worker whose model runner is shaped like vLLM's ``kind`` ("V1" or "V2"): one GDN
    layer in KV cache group 0, one FA layer in group 1, blocks of ``n`` tokens."""
    model = torch.nn.ModuleDict(
        {"proj": torch.nn.Linear(4, 4), "input_layernorm": torch.nn.LayerNorm(4)}
    )
    layers = {"fa.0": fa, "gdn.0": gdn}
    mr = RUNNERS[kind](layers, [(n, ["gdn.0"]), (n, ["fa.0"])], model=model)
    return NS(worker=NS(model_runner=mr, rank=0))


def _gdn(torch, nb: int):
    g = torch.Generator().manual_seed(7)
    return [
        torch.randn(nb, 3, 16, generator=g).to(torch.bfloat16),
        torch.randn(nb, 2, 4, 4, generator=g),
    ]


def _hash_run(kind: str, torch, fa, tokens, n=80):
    blocks = ([0, 3, 1, 2], [5, 3, 1, 2])  # GDN group has a null block, FA group none
    w = _fake_worker(kind, torch, fa, _gdn(torch, 8), n)
    assert worker.rpc_install_block_hook(w).startswith(f"{kind} runner_fakes.{kind}Runner")
    w.worker.model_runner.execute_model(step(new=[("r0", tokens, blocks, 0)]))
    return worker.rpc_kv_hashes(w, prompt_key(tokens), len(tokens))


@KINDS
def test_kv_hashes_are_layout_independent_and_per_block(kind: str) -> None:
    torch = pytest.importorskip("torch")
    n, page, r = 80, 16, 5
    tokens = make_prompt(3 * n + 10, seed=4)  # blocks 0..2 full, block 3 partial
    nhd, hnd = _fa_views(torch, 8 * r, page, 2, 8)
    a, b = _hash_run(kind, torch, nhd, tokens), _hash_run(kind, torch, hnd, tokens)
    assert a["layout"] == "NHD" and b["layout"] == "HND" and a["kernel_page"] == page
    assert a["fa"] == b["fa"] and a["gdn"] == b["gdn"]
    assert sorted(a["fa"]["fa.0"], key=int) == ["0", "1", "2", "3"]
    assert sorted(a["gdn"]["gdn.0"], key=int) == ["1", "2"]  # full blocks, nulls skipped
    # one byte in the 4th kernel page of logical block id 1 (prompt block 2) changes only it
    hnd2 = hnd.clone()
    hnd2[1 * r + 3, 1, 5, 0] += 1
    c = _hash_run(kind, torch, hnd2, tokens)
    diff = [j for j in a["fa"]["fa.0"] if a["fa"]["fa.0"][j] != c["fa"]["fa.0"][j]]
    assert diff == ["2"]
    # slots past the prompt in the partial last block (block id 2) are not hashed
    hnd3 = hnd.clone()
    hnd3[2 * r + 4, 0, page - 1, 0] += 1
    assert _hash_run(kind, torch, hnd3, tokens)["fa"] == a["fa"]
    # a pristine-like restore that wrote only one kernel page per block is detected
    partial = hnd.clone()
    partial[r + 1 : 2 * r] = 0
    res = compare_kv_hashes([a], [_hash_run(kind, torch, partial, tokens)], hit_tokens=2 * n)
    assert not res["match"] and res["fa_bad"] == 1


@KINDS
def test_the_hook_records_each_requests_block_table_as_the_forward_pass_reads_it(
    kind: str,
) -> None:
    """Blocks added over steps, a finished request's row reused by the next (V2 writes it
    over), a request running beside it: each table as the runner holds it after the step's
    state update, and a running request's ids as ``rpc_block_hashes`` reads them."""
    torch = pytest.importorskip("torch")
    w = _fake_worker(kind, torch)
    mr = w.worker.model_runner
    worker.rpc_install_block_hook(w)
    a, b, c = make_prompt(200, seed=1), make_prompt(90, seed=2), make_prompt(30, seed=3)
    mr.execute_model(step(new=[("a", a, ([1], [2, 3]), 0)]))
    mr.execute_model(step(cached=[("a", 80, ([4], [5]))]))
    assert mr._gate_blocks[prompt_key(a)] == [[1, 4], [2, 3, 5]]
    mr.execute_model(step(new=[("b", b, ([6], [7]), 0)], cached=[("a", 160, None)]))
    mr.execute_model(step(new=[("c", c, ([8], [9, 10]), 0)], finished=["a"]))
    mr.execute_model(step(cached=[("b", 80, ([11], [12])), ("c", 16, None)]))
    assert mr._gate_blocks == {
        prompt_key(a): [[1, 4], [2, 3, 5]],
        prompt_key(b): [[6, 11], [7, 12]],
        prompt_key(c): [[8], [9, 10]],
    }
    assert worker.request_blocks(mr, "c") == [[8], [9, 10]]
    assert worker.request_blocks(mr, "b") == [[6, 11], [7, 12]]
    assert worker.request_blocks(mr, "a") is None


def test_a_runner_of_neither_shape_is_refused_naming_what_it_lacks() -> None:
    mr = NS(requests={}, req_states=NS(), update_requests=None)
    with pytest.raises(RuntimeError, match="lacks V1's _update_states and V2's block_tables"):
        worker.rpc_install_block_hook(NS(model_runner=mr, rank=0))


def _watched(kind: str, torch, blocks):
    """A watched request of three full blocks of 80 tokens and a partial one: (fake worker,
    its GDN state tensors, prompt tokens, prompt key)."""
    tokens = make_prompt(3 * 80 + 10, seed=4)
    gdn = _gdn(torch, 8)
    w = _fake_worker(kind, torch, _fa_views(torch, 40, 16, 2, 8)[1], gdn, 80)
    worker.rpc_install_block_hook(w)
    key = prompt_key(tokens)
    worker.rpc_watch_checkpoints(w, key)
    return w, gdn, tokens, key


def _watched_run(kind: str, torch, first_step_tokens: int):
    """A request whose first step computed ``first_step_tokens`` (its hit), watched over two
    steps; then vLLM reuses GDN block id 3 (position 1, the checkpoint of a two-block hit)
    for another state."""
    blocks = ([0, 3, 1, 2], [5, 3, 1, 2])
    w, gdn, tokens, key = _watched(kind, torch, blocks)
    mr = w.worker.model_runner
    mr.execute_model(step(new=[("r0", tokens, blocks, first_step_tokens)]))
    mr.execute_model(step(cached=[("r0", first_step_tokens, None)]))
    before = worker.hash_blocks(mr, [list(b) for b in blocks], len(tokens))["gdn"]["gdn.0"]
    gdn[1][3] += 1
    return w, key, len(tokens), before


@KINDS
def test_the_hit_checkpoint_is_hashed_while_the_request_holds_it(kind: str) -> None:
    torch = pytest.importorskip("torch")
    w, key, p, before = _watched_run(kind, torch, 2 * 80)
    got = worker.rpc_kv_hashes(w, key, p)["gdn"]["gdn.0"]
    assert got == before
    # reported once: the next request of the prompt is hashed as its block table stands
    assert worker.rpc_kv_hashes(w, key, p)["gdn"]["gdn.0"]["1"] != before["1"]


@KINDS
def test_a_request_that_hit_nothing_is_hashed_after_it_ended(kind: str) -> None:
    torch = pytest.importorskip("torch")
    w, key, p, before = _watched_run(kind, torch, 0)
    got = worker.rpc_kv_hashes(w, key, p)["gdn"]["gdn.0"]
    assert got["1"] != before["1"] and got["2"] == before["2"]


@KINDS
def test_each_checkpoint_is_kept_as_it_stood_on_the_step_after_it_was_complete(
    kind: str,
) -> None:
    """A storing request (no hit): vLLM 0.29 hands a finished checkpoint's block out again
    while the request runs, so the block table read after the request names other states."""
    torch = pytest.importorskip("torch")
    n = 80
    blocks = ([4, 3, 1, 2], [5, 3, 1, 2])
    w, gdn, tokens, key = _watched(kind, torch, blocks)
    mr = w.worker.model_runner

    def run_step(computed: int) -> dict[str, str]:
        new = [("r0", tokens, blocks, computed)] if computed == 0 else []
        mr.execute_model(step(new=new, cached=[("r0", computed, None)] if computed else []))
        return worker.hash_blocks(mr, [list(b) for b in blocks], len(tokens))["gdn"]["gdn.0"]

    run_step(0)
    at_n = run_step(n)
    gdn[0][4] += 1  # block 0's slot, reused
    run_step(2 * n)
    at_3n = run_step(3 * n)
    gdn[1][3] += 1
    gdn[0][1] += 1
    got = worker.rpc_kv_hashes(w, key, len(tokens))["gdn"]["gdn.0"]
    assert got == {"0": at_n["0"], "1": at_3n["1"], "2": at_3n["2"]}
    assert at_n["0"] != at_3n["0"]


@KINDS
def test_init_weights_is_deterministic(kind: str) -> None:
    torch = pytest.importorskip("torch")
    fps = []
    for _ in range(2):
        w = _fake_worker(kind, torch)
        out = worker.rpc_init_weights(w, 1234, 0.02)
        model = w.worker.model_runner.model
        fps.append(out["fingerprint"])
        assert out["params"] == sum(p.numel() for p in model.parameters())
        norm, proj = model["input_layernorm"], model["proj"]
        assert abs(float(norm.weight.detach().mean()) - 1.0) < 0.1  # norm scales near 1
        assert abs(float(norm.bias.detach().mean())) < 0.1
        assert float(proj.weight.detach().std()) < 0.1
    assert fps[0] == fps[1]


def test_restore_timeline_splits_ttft_at_the_first_answered_lookup() -> None:
    lookups = [
        {"t": 100.00, "s": 0.001, "tokens": None},  # LMCache still reading L2
        {"t": 100.50, "s": 0.001, "tokens": None},
        {"t": 101.00, "s": 0.002, "tokens": 4800},
    ]
    steps = [{"t": 100.0, "s": 0.3}, {"t": 100.5, "s": 0.01}, {"t": 101.0, "s": 0.2}]
    steps.append({"t": 101.6, "s": 0.04})  # a decode step, after the first token
    tl = engine_proc.restore_timeline(100.0, 1.5, lookups, steps)
    assert tl["lookups"] == 3 and tl["lookups_unanswered"] == 2 and tl["hit_tokens"] == 4800
    assert tl["wait_for_hit_s"] == pytest.approx(1.002)
    assert tl["after_hit_s"] == pytest.approx(0.498)
    assert tl["steps_after_hit"] == [[1.0, 0.2]]


def test_restore_timeline_without_an_answer() -> None:
    tl = engine_proc.restore_timeline(0.0, 2.0, [{"t": 0.0, "s": 0.1, "tokens": None}], [])
    assert tl["wait_for_hit_s"] is None and tl["after_hit_s"] is None and tl["hit_tokens"] is None


def test_block_table_resyncs_are_counted_when_a_slot_is_rewritten() -> None:
    from types import ModuleType

    class Tracker:
        def __init__(self) -> None:
            self.allocated_block_ids = {0: [1, 2]}
            self.live = [[1, 2]]

        def sync_block_ids(self) -> None:
            self.allocated_block_ids = dict(enumerate(self.live))

    module = ModuleType("fake_lmcache_mp_connector")
    module.LMCacheMPRequestTracker = Tracker
    connector_cls = type("LMCacheMPConnector", (), {"__module__": module.__name__})
    sys.modules[module.__name__] = module
    try:
        core = NS(scheduler=NS(connector=connector_cls()))
        llm = NS(llm_engine=NS(engine_core=NS(engine_core=core)))
        counts = engine_proc._count_block_table_resyncs(llm)
        t = Tracker()
        t.live = [[1, 2, 3]]  # appended: no rewrite
        t.sync_block_ids()
        t.live = [[1, 0, 4]]  # the speculative tail moved, the old slot nulled
        t.sync_block_ids()
        assert counts == {"calls": 2, "rewrites": 1}
        assert engine_proc._count_block_table_resyncs(NS(llm_engine=NS())) is None
    finally:
        del sys.modules[module.__name__]


@KINDS
def test_init_weights_covers_the_drafter_but_not_what_it_shares(kind: str) -> None:
    torch = pytest.importorskip("torch")
    w = _fake_worker(kind, torch)
    runner = w.worker.model_runner
    shared = runner.model["proj"]
    drafter = NS(model=torch.nn.ModuleDict({"fc": torch.nn.Linear(4, 4), "head": shared}))
    setattr(runner, DRAFTER[kind], drafter)
    worker.rpc_init_weights(w, 1234, 0.02)
    target_proj = shared.weight.detach().clone()
    fresh = _fake_worker(kind, torch)
    worker.rpc_init_weights(fresh, 1234, 0.02)
    assert torch.equal(target_proj, fresh.worker.model_runner.model["proj"].weight)
    fc = drafter.model["fc"].weight
    assert float(fc.detach().abs().max()) < 0.2 and float(fc.detach().std()) > 0.005


def _spec(**extra: object) -> dict:
    spec = {"model_dir": "/m", "gpu_memory_utilization": 0.2, "max_model_len": 100}
    spec.update(max_num_batched_tokens=159, tensor_parallel_size=1)
    return {**spec, **extra}


def test_llm_kwargs_take_the_kv_cache_dtype_and_the_lora_settings() -> None:
    pytest.importorskip("vllm")
    kw = engine_proc.llm_kwargs(_spec())
    assert "kv_cache_dtype" not in kw and "enable_lora" not in kw
    assert kw["mamba_cache_mode"] == "align" and kw["enable_prefix_caching"]
    kw = engine_proc.llm_kwargs(_spec(kv_cache_dtype="fp8_e5m2"))
    assert kw["kv_cache_dtype"] == "fp8_e5m2"
    lora = {"max_lora_rank": 8, "adapters": {"A": "/a", "B": "/b"}}
    kw = engine_proc.llm_kwargs(_spec(lora=lora))
    assert (kw["enable_lora"], kw["max_lora_rank"], kw["max_loras"]) == (True, 8, 2)


def test_an_e5m2_cache_under_flashinfer_keeps_a_bf16_query() -> None:
    pytest.importorskip("vllm")
    kw = engine_proc.llm_kwargs(_spec(kv_cache_dtype="fp8_e5m2"))
    assert kw["attention_config"]["disable_flashinfer_q_quantization"] is True
    others = ({"kv_cache_dtype": "fp8_e4m3"}, {"attention_backend": "FLASH_ATTN"})
    for extra in others:
        kw = engine_proc.llm_kwargs(_spec(**{"kv_cache_dtype": "fp8_e5m2", **extra}))
        assert "disable_flashinfer_q_quantization" not in kw["attention_config"]


def test_a_spec_without_adapters_has_no_lora_requests() -> None:
    assert engine_proc.lora_requests(_spec()) == {}


def test_timed_requests_of_two_cases_take_turns(tmp_path) -> None:
    lock, first, second = tmp_path / "timing.lock", [], []
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with engine_proc.timing_turn(lock, first):
            inside.set()
            release.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(5)
    threading.Timer(0.3, release.set).start()
    with engine_proc.timing_turn(lock, second):
        assert release.is_set()  # the other case's timed requests had ended
    holder.join()
    assert first[0]["held"] and second[0]["held"] and second[0]["waited_s"] >= 0.25


def test_a_turn_not_given_within_its_wait_times_anyway(tmp_path) -> None:
    lock, record = tmp_path / "timing.lock", []
    with engine_proc.timing_turn(lock, []), engine_proc.timing_turn(lock, record, wait_s=0.1):
        pass
    assert record[0]["held"] is False and record[0]["waited_s"] >= 0.1


class _Connector:
    def get_num_new_matched_tokens(self, request: object, computed: int) -> tuple[int, bool]:
        return 0, False


def test_a_restore_engine_watches_its_measured_request_and_times_others_unwatched(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(d)'s pairs run after the measured request's checks: no checkpoint watch and no timed
    lookups on them."""
    connector = _Connector()
    core = NS(scheduler=NS(connector=connector))
    watching: set[str] = set()
    seen: dict[str, tuple[bool, bool]] = {}

    def collective_rpc(fn, args=()):
        if fn is worker.rpc_watch_checkpoints:
            watching.add(args[0])
        if fn is worker.rpc_kv_hashes:
            watching.discard(args[0])
            return [{"rank": 0, "block_size": 80, "kernel_page": 16, "fa": {}, "gdn": {}}]
        return ["Runner"]

    llm = NS(collective_rpc=collective_rpc, llm_engine=NS(engine_core=NS(engine_core=core)))
    out = NS(outputs=[NS(token_ids=[5] * 8, logprobs=None)], num_cached_tokens=80, metrics=None)

    def generate_timed(llm_, tokens, params, steps=None, lora=None):
        timed = "get_num_new_matched_tokens" in vars(connector)
        seen[str(tokens[0])] = (bool(watching), timed)
        return out, {"ttft_s": 0.1, "num_cached_tokens": 80}

    monkeypatch.setattr(engine_proc, "start_engine", lambda spec, result: llm)
    monkeypatch.setattr(engine_proc, "sampling", lambda *a: None)
    monkeypatch.setattr(engine_proc, "generate", lambda *a: out)
    monkeypatch.setattr(engine_proc, "generate_timed", generate_timed)
    monkeypatch.setattr(engine_proc, "PrefillTap", lambda core: None)
    monkeypatch.setattr(engine_proc, "TIMING_LOCK", tmp_path / "timing.lock")
    spec = {
        "role": "restore",
        "new_tokens": 2,
        "top_k": 5,
        "warmup": [0],
        "health": [0],
        "warm_first": {"restore": [1], "cold": [2]},
        "prompt": [3],
        "prompt_key": "measured",
        "timed_pairs": [{"restore": [4], "cold": [5]}, {"restore": [6], "cold": [7]}],
    }
    result: dict = {"cache_block_size": 80}
    engine_proc.run(spec, result)
    assert seen["3"] == (True, True)  # the measured request: watched, its lookups timed
    assert {k: v for k, v in seen.items() if k != "3"} == dict.fromkeys("124567", (False, False))
    assert len(result["timed_pairs"]) == 2 and result["timing_turns"][0]["held"]
    assert "get_num_new_matched_tokens" not in vars(connector)  # the connector's own again


def test_the_compilation_vllm_resolved_is_read_back_from_engine_and_workers() -> None:
    pytest.importorskip("vllm")
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    asked = NS(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    asked.max_cudagraph_capture_size = 512
    # the model runner lowered the mode to what its attention backends support
    ran = NS(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.PIECEWISE)
    workers = [NS(worker=NS(model_runner=NS(compilation_config=ran), rank=0))]
    vc = NS(compilation_config=asked, model_config=NS(enforce_eager=False))
    llm = NS(
        llm_engine=NS(vllm_config=vc),
        collective_rpc=lambda fn: [fn(w) for w in workers],
    )
    assert engine_proc.resolved_compilation(llm) == {
        "enforce_eager": False,
        "mode": "VLLM_COMPILE",
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "max_cudagraph_capture_size": 512,
        "workers": [{"rank": 0, "mode": "VLLM_COMPILE", "cudagraph_mode": "PIECEWISE"}],
    }
