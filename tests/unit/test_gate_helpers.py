"""CPU tests of the GPU restart gate's pure helpers (tests/gpu/gate.py)."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from script_modules import GPU_DIR
from script_modules import load_script as _load

gate = _load("hybridfa_gpu_gate", GPU_DIR / "gate.py")


@pytest.mark.parametrize("name", sorted(gate.MODELS))
def test_expected_geometry_of_each_tiny_model(name: str) -> None:
    ratio = int(name.rsplit("-r", 1)[1])
    n = {5: 80, 17: 544, 25: 1600}[ratio]  # N of each ratio
    assert gate.expected_geometry(gate.MODELS[name]) == gate.Geometry(n, n // ratio, ratio)


def test_expected_geometry_matches_the_three_required_ratios() -> None:
    got = {
        (g.block_size, g.kernel_page, g.ratio)
        for g in map(gate.expected_geometry, gate.MODELS.values())
    }
    assert got == {(80, 16, 5), (544, 32, 17), (1600, 64, 25)}


def test_select_kernel_page_is_largest_dividing_size() -> None:
    assert gate.select_kernel_page(80) == 16
    assert gate.select_kernel_page(544) == 32
    assert gate.select_kernel_page(1600) == 64
    assert gate.select_kernel_page(32) == 32
    with pytest.raises(ValueError):
        gate.select_kernel_page(40)


class _FlashInferLike:
    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return list(gate.FLASHINFER_KERNEL_SIZES)


@pytest.mark.parametrize("name", sorted(gate.MODELS))
def test_geometry_agrees_with_vllm_specs(name: str) -> None:
    """Page sizes from vLLM 0.26's own spec classes and state-shape calculator."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    m = gate.MODELS[name]
    dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        1,
        m.linear_num_key_heads,
        m.linear_num_value_heads,
        m.linear_key_head_dim,
        m.linear_value_head_dim,
        m.conv_kernel,
        0,
    )
    mamba = MambaSpec(shapes=shapes, dtypes=(dt[m.kv_dtype], dt[m.ssm_dtype]), block_size=-1)
    attn = FullAttentionSpec(
        block_size=1, num_kv_heads=m.num_kv_heads, head_size=m.head_dim, dtype=dt[m.kv_dtype]
    )
    assert mamba.page_size_bytes == gate.mamba_page_bytes(m)
    assert attn.page_size_bytes == gate.attn_bytes_per_token(m)


@pytest.mark.parametrize("name", sorted(gate.MODELS))
def test_kernel_page_agrees_with_vllm_select_common_block_size(name: str) -> None:
    # vllm.v1.worker.utils pulls in einops (absent from the CPU venv): skip there.
    utils = pytest.importorskip("vllm.v1.worker.utils")
    g = gate.expected_geometry(gate.MODELS[name])
    assert utils.select_common_block_size(g.block_size, [_FlashInferLike]) == g.kernel_page


@pytest.mark.parametrize("name", sorted(gate.MODELS))
def test_model_config_loads_in_vllm_config_classes(name: str) -> None:
    pytest.importorskip("transformers")
    m = gate.MODELS[name]
    cfg = gate.model_config_dict(m)
    if m.family == "olmo_hybrid":
        from vllm.transformers_utils.configs.olmo_hybrid import OlmoHybridConfig

        c = OlmoHybridConfig(**cfg)
        text = c
        assert c.hidden_size // c.num_attention_heads == m.head_dim
    else:
        from vllm.transformers_utils.configs.qwen3_5 import Qwen3_5Config

        c = Qwen3_5Config(**cfg)
        text = c.text_config
        assert text.head_dim == m.head_dim
        assert text.mamba_ssm_dtype == "float32"
        rope = text.rope_parameters
        assert sum(rope["mrope_section"]) == int(m.head_dim * 0.25) // 2
    assert text.layer_types.count("full_attention") == 2
    assert text.layer_types.count("linear_attention") == 6
    assert text.linear_num_value_heads == m.linear_num_value_heads


def test_write_model_dir(tmp_path: Path) -> None:
    d = gate.write_model_dir(gate.MODELS["olmo-r5"], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["OlmoHybridForCausalLM"]


def test_make_prompt_is_deterministic_with_a_buried_key() -> None:
    a = gate.make_prompt(4207, seed=1)
    assert a == gate.make_prompt(4207, seed=1)
    assert a != gate.make_prompt(4207, seed=2)
    assert len(a) == 4207
    assert all(gate.TOKEN_LO <= t < gate.TOKEN_HI for t in a)
    start = 4207 // 2 - gate.KEY_LEN // 2
    key = a[start : start + gate.KEY_LEN]
    assert max(key) - min(key) < 64  # the narrow-band run
    assert gate.prompt_key(a) == gate.prompt_key(list(a))
    assert gate.prompt_key(a) != gate.prompt_key(a[:-1])


@pytest.mark.parametrize(
    "n,chunk_blocks", [(80, 1), (80, 2), (544, 1), (544, 2), (1600, 1), (1600, 2)]
)
def test_prompt_lengths(n: int, chunk_blocks: int) -> None:
    c = n * chunk_blocks
    exact = gate.prompt_length(n, c, exact=True)
    assert exact % c == 0 and exact >= gate.MIN_PROMPT_TOKENS
    p = gate.prompt_length(n, c, exact=False)
    assert p % n != 0
    assert gate.max_promisable_hit(p, c) >= gate.HIT_FRACTION * p
    assert gate.required_hit(p, c) >= gate.HIT_FRACTION * p
    # exact multiple: the last chunk is recomputed, so at most (m-1)*C can be required
    assert gate.required_hit(exact, c) == min(math.ceil(gate.HIT_FRACTION * exact), exact - c)
    assert exact // c >= gate.EXACT_MIN_CHUNKS  # at least 3/4 of it restorable


def test_case_selection() -> None:
    quick, every, full = (gate.select_cases(s) for s in ("quick", "all", "full"))
    assert len(quick) == 3 and len(every) == 18 and len(full) == 48
    assert len({c.case_id for c in full}) == 48
    assert set(quick) <= set(full) and set(every) <= set(full)
    assert {c.geometry.ratio for c in every} == {5, 17, 25}
    assert {c.layout for c in every} == {"NHD", "HND"}
    assert {c.chunk_blocks for c in every} == {1, 2}
    assert {c.exact for c in every} == {True, False}
    assert {c.spec.family for c in every} == {"olmo_hybrid", "qwen3_5"}
    picked = gate.select_cases("olmo-r5-NHD-c1N-offset,qwen35-r25-.*-exact")
    assert [c.case_id for c in picked] == [
        "olmo-r5-NHD-c1N-offset",
        "qwen35-r25-NHD-c1N-exact",
        "qwen35-r25-NHD-c2N-exact",
        "qwen35-r25-HND-c1N-exact",
        "qwen35-r25-HND-c2N-exact",
    ]
    with pytest.raises(ValueError):
        gate.select_cases("nope")
    assert gate.select_cases("quick", tp=2)[0].case_id.endswith("-tp2")


def test_compare_logprobs() -> None:
    a = [{"1": -0.5, "2": -1.0}, {"3": -0.1, "4": -2.0}]
    assert gate.compare_logprobs(a, a) == (True, 0.0)
    ok, diff = gate.compare_logprobs(a, [{"1": -0.5004, "2": -1.0}, {"3": -0.1, "4": -2.0}])
    assert ok and diff == pytest.approx(4e-4)
    assert not gate.compare_logprobs(a, [{"1": -0.51, "2": -1.0}, a[1]])[0]
    assert gate.compare_logprobs(a, [{"1": -0.5, "9": -1.0}, a[1]])[0] is False
    assert gate.compare_logprobs(a, a[:1])[0] is False


def _hashes(fa: dict[str, str], gdn: dict[str, str], rank: int = 0) -> dict:
    return {"rank": rank, "block_size": 80, "fa": {"l3": fa}, "gdn": {"l0": gdn}}


def test_compare_kv_hashes_equal_and_restored_checkpoint_covered() -> None:
    store = [_hashes({"0": "a", "1": "b", "2": "c"}, {"0": "x", "1": "y"})]
    restore = [_hashes({"0": "a", "1": "b", "2": "c"}, {"1": "y"})]  # nulls below the hit
    res = gate.compare_kv_hashes(store, restore, hit_tokens=160)
    assert res["match"] and res["fa_blocks"] == 3 and res["gdn_blocks"] == 1


def test_compare_kv_hashes_detects_wrong_fa_pages() -> None:
    store = [_hashes({"0": "a", "1": "b"}, {"0": "x"})]
    restore = [_hashes({"0": "a", "1": "B"}, {"0": "x"})]
    res = gate.compare_kv_hashes(store, restore, hit_tokens=80)
    assert not res["match"] and res["fa_bad"] == 1
    assert res["mismatches"] == ["rank0 fa l3 block 1"]


def test_compare_kv_hashes_requires_the_restored_gdn_checkpoint() -> None:
    store = [_hashes({"0": "a"}, {"0": "x", "1": "y"})]
    restore = [_hashes({"0": "a"}, {"0": "x"})]
    res = gate.compare_kv_hashes(store, restore, hit_tokens=160)  # hit block is 1
    assert not res["match"] and res["problems"]


def test_compare_kv_hashes_per_rank() -> None:
    store = [_hashes({"0": "a"}, {}, 0), _hashes({"0": "b"}, {}, 1)]
    assert gate.compare_kv_hashes(store, list(reversed(store)), 0)["match"]
    assert not gate.compare_kv_hashes(store, store[:1], 0)["match"]


def _engine(tokens, lps, gen_s, cached=None, kv=None, health=True) -> dict:
    return {
        "ok": True,
        "tokens": tokens,
        "logprobs": lps,
        "gen_s": gen_s,
        "ttft_s": gen_s,
        "num_cached_tokens": cached,
        "external_cached_tokens": cached,
        "local_cached_tokens": 0,
        "kv_hashes": kv,
        "weights_fingerprint": "w",
        "geometry": {"block_size": 80, "kernel_page": 16, "ratio": 5},
        "observed_layout": "NHD",
        "health": {"ok": health, "tokens": [1, 2]},
    }


def _restored_case(
    exact: bool, restore_ttft: float, cold_reference_ttft: float
) -> tuple[Any, dict, dict, dict]:
    """olmo-r5, NHD, chunk N: cold, store and restore engine results, the restore engine
    having restored every promisable block and cold-prefilled its own reference."""
    case = gate.Case("olmo-r5", "NHD", 1, exact)
    kv = [_hashes({"0": "a"}, {})]
    hit = gate.max_promisable_hit(case.prompt_tokens, 80)
    cold, store = _engine([5], [], 3.0), _engine([5], [], 3.0, kv=kv)
    restore = {**_engine([5], [], 2.0, cached=hit, kv=kv), "ttft_s": restore_ttft}
    restore["cold_reference"] = {"ttft_s": cold_reference_ttft, "num_cached_tokens": 0}
    return case, cold, store, restore


def test_evaluate_case_pass_and_pristine_like_failure() -> None:
    case = gate.Case("olmo-r5", "NHD", 1, False)
    p = case.prompt_tokens
    lps = [{"5": -1.0}]
    kv = [_hashes({"0": "a"}, {str(p // 80 - 1): "x"})]
    cold = _engine([5], lps, 2.0)
    store = _engine([5], lps, 2.1, kv=kv)
    restore = _engine([5], lps, 0.5, cached=p // 80 * 80, kv=kv)
    ev = gate.evaluate_case(case, cold, store, restore)
    assert ev["pass"], ev
    bad = _engine(
        [5], lps, 0.5, cached=p // 80 * 80, kv=[_hashes({"0": "WRONG"}, {str(p // 80 - 1): "x"})]
    )
    ev = gate.evaluate_case(case, cold, store, bad)
    assert ev["completed"] and ev["bytes_match"] is False and not ev["pass"]
    assert ev["b"] and ev["c"] and ev["d"] and ev["e"]


def test_evaluate_case_times_d_by_first_token() -> None:
    """(d) compares prefill (TTFT), not TTFT plus the same decode steps on both sides."""
    case = gate.Case("olmo-r5", "NHD", 1, False)
    kv = [_hashes({"0": "a"}, {})]
    cold = {**_engine([5], [], 3.0), "ttft_s": 1.0}
    store = _engine([5], [], 3.0, kv=kv)
    hit = case.prompt_tokens // 80 * 80
    slow_decode = {**_engine([5], [], 3.2, cached=hit, kv=kv), "ttft_s": 0.4}
    ev = gate.evaluate_case(case, cold, store, slow_decode)
    assert ev["d"] and (ev["restore_s"], ev["cold_s"]) == (0.4, 1.0)
    slow_prefill = {**_engine([5], [], 2.0, cached=hit, kv=kv), "ttft_s": 1.2}
    assert not gate.evaluate_case(case, cold, store, slow_prefill)["d"]


def test_evaluate_case_prefers_the_restore_engines_own_cold_prefill_for_d() -> None:
    case = gate.Case("olmo-r5", "NHD", 1, False)
    kv = [_hashes({"0": "a"}, {})]
    hit = case.prompt_tokens // 80 * 80
    cold = {**_engine([5], [], 3.0), "ttft_s": 0.5}  # another process, quieter moment
    store = _engine([5], [], 3.0, kv=kv)
    restore = {**_engine([5], [], 2.0, cached=hit, kv=kv), "ttft_s": 0.8}
    restore["cold_reference"] = {"ttft_s": 1.6, "num_cached_tokens": 0}
    ev = gate.evaluate_case(case, cold, store, restore)
    assert ev["d"] and ev["cold_same_engine_s"] == 1.6
    restore["cold_reference"] = {"ttft_s": 1.6, "num_cached_tokens": 80}  # not cold
    ev = gate.evaluate_case(case, cold, store, restore)
    assert ev["cold_same_engine_s"] is None and not ev["d"]


def test_the_restore_engine_warms_up_on_other_prompts_before_the_timed_restore(
    tmp_path: Path,
) -> None:
    # Measured 2026-11-29: a fresh engine's first long request paid 0.7-2.5 s of one-time costs, so
    # the timed restore (first) lost (d) to the cold reference (after it) in every case.
    case = gate.Case("olmo-r17", "NHD", 1, True)
    rc = gate.RunConfig(arm="patched", lmcache_dir=tmp_path, out=tmp_path)
    store = gate.store_spec(case, tmp_path, rc, 1, tmp_path / "l2")
    restore = gate.restore_spec(case, tmp_path, rc, 2)
    first, warm_cold = restore["warm_first"]["restore"], restore["warm_first"]["cold"]
    assert list(restore["warm_first"]) == ["restore", "cold"]  # in this order
    pairs = restore["timed_pairs"]
    assert len(pairs) == gate.D_REPEATS - 1 and all(list(p) == ["restore", "cold"] for p in pairs)
    # Every prompt the restore engine restores was stored, and the store waits for all of it.
    assert store["also_store"] == [first] + [p["restore"] for p in pairs]
    assert store["l2_min_objects"] == (1 + len(store["also_store"])) * (4352 // 544)
    prompts = [store["prompt"], *store["also_store"], warm_cold, restore["cold_reference"]]
    prompts += [p["cold"] for p in pairs]
    assert restore["prompt"] == store["prompt"]
    assert {len(t) for t in prompts} == {case.prompt_tokens}
    assert len({tuple(t[:64]) for t in prompts}) == len(prompts)  # no two share a prefix block


def test_evaluate_case_reports_the_engines_first_restore() -> None:
    case, cold, store, restore = _restored_case(False, 0.3, 0.5)
    hit = restore["num_cached_tokens"]
    restore["warm_first"] = {"restore": {"ttft_s": 1.4, "num_cached_tokens": hit}}
    ev = gate.evaluate_case(case, cold, store, restore)
    assert ev["d"] and ev["first_restore_s"] == 1.4
    restore["warm_first"]["restore"]["num_cached_tokens"] = 0  # it restored nothing
    assert gate.evaluate_case(case, cold, store, restore)["first_restore_s"] is None


def test_evaluate_case_criteria_c_d_and_errors() -> None:
    case = gate.Case("olmo-r5", "NHD", 1, False)
    kv = [_hashes({"0": "a"}, {})]
    cold = _engine([5], [], 1.0)
    store = _engine([5], [], 1.0, kv=kv)
    ev = gate.evaluate_case(case, cold, store, _engine([5], [], 1.5, cached=80, kv=kv))
    assert not ev["c"] and not ev["d"] and not ev["pass"]
    ev = gate.evaluate_case(case, cold, store, {"ok": False, "error": "boom"})
    assert not ev["completed"] and "restore: boom" in ev["errors"][0]
    wrong_geo = _engine([5], [], 0.1, cached=case.prompt_tokens, kv=kv)
    wrong_geo["geometry"] = {"block_size": 48, "kernel_page": 16}
    ev = gate.evaluate_case(case, cold, store, wrong_geo)
    assert not ev["pass"] and "geometry" in ev["errors"][0]


def test_evaluate_case_without_a_hit_proves_nothing() -> None:
    """Seen on the H200: every store failed, the restore recomputed everything and the
    KV bytes matched trivially. That must not read as "bytes match" on either arm."""
    case = gate.Case("qwen35-r5", "HND", 2, False)
    kv = [_hashes({"0": "a"}, {"0": "g"})]
    cold = _engine([5], [], 2.0)
    store = _engine([5], [], 2.0, kv=kv)
    ev = gate.evaluate_case(case, cold, store, _engine([5], [], 1.0, cached=0, kv=kv))
    assert ev["bytes_match"] is None and not ev["a"] and not ev["pass"]
    assert any("no external hit" in e for e in ev["errors"])


def test_expected_chunk_bytes_section_m() -> None:
    # Section M: a correct 80-token chunk of the tiny OlmoHybrid is 8 x 81,920 B.
    assert gate.expected_chunk_bytes(gate.MODELS["olmo-r5"], 80) == 655_360


def test_engine_log_facts() -> None:
    text = (
        "Setting attention block size to 80 tokens\n"
        "KV cache group edits applied: {'mamba-page-view': 6}\nRetrieved 6000 tokens\n"
    )
    facts = gate.engine_log_facts(text)
    assert facts["attention_block_size"] == "80"
    assert facts["group_edits"] == "{'mamba-page-view': 6}"
    assert facts["lmcache_retrieved"] == "6000" and facts["tracebacks"] == 0


def test_child_env_puts_lmcache_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", f"/tmp/site:{tmp_path}")
    env = gate.child_env(tmp_path, "HND")
    assert env["PYTHONPATH"].split(":") == [str(tmp_path.resolve()), "/tmp/site"]
    assert env["VLLM_KV_CACHE_LAYOUT"] == "HND"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["TRITON_CACHE_AUTOTUNING"] == "1"


def test_core_matrix_covers_every_dimension_per_ratio() -> None:
    core = gate.select_cases("core")
    assert len(core) == 6 and set(core) <= set(gate.select_cases("full"))
    for ratio in (5, 17, 25):
        mine = [c for c in core if c.geometry.ratio == ratio]
        assert {c.layout for c in mine} == {"NHD", "HND"}
        assert {c.chunk_blocks for c in mine} == {1, 2}
        assert {c.exact for c in mine} == {True, False}
    for family in ("olmo_hybrid", "qwen3_5"):
        assert {c.layout for c in core if c.spec.family == family} == {"NHD", "HND"}


def test_cold_runs_run_once_across_threads_and_skip_failures() -> None:
    import threading
    import time

    cold = gate.ColdRuns()
    calls: list[int] = []

    def slow_ok() -> dict:
        calls.append(1)
        time.sleep(0.2)
        return {"ok": True, "gen_s": 1.5}

    got: list[dict] = []
    threads = [
        threading.Thread(target=lambda: got.append(cold.get_or_run(("m", 1, "NHD", 1), slow_ok)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and got == [{"ok": True, "gen_s": 1.5}] * 4
    assert cold.get_or_run(("m", 2, "NHD", 1), lambda: {"ok": False})["ok"] is False
    assert ("m", 2, "NHD", 1) not in cold.results


def test_fixed_kv_cache_reaches_the_engine_spec(tmp_path: Path) -> None:
    case = gate.Case("olmo-r5", "NHD", 1, False)
    rc = gate.RunConfig(arm="patched", lmcache_dir=tmp_path, out=tmp_path)
    assert "kv_cache_memory_bytes" not in gate.engine_spec(case, "cold", tmp_path, rc, None, None)
    rc.kv_cache_memory_bytes = 2**31
    spec = gate.engine_spec(case, "cold", tmp_path, rc, None, None)
    assert spec["kv_cache_memory_bytes"] == 2**31
    with pytest.raises(SystemExit):
        gate.main(["--arm", "patched", "--lmcache-dir", str(tmp_path), "--jobs", "2"])


def test_sigterm_kills_the_engines_and_servers_the_gate_started(tmp_path: Path) -> None:
    """`timeout` on the node sends SIGTERM to gate.py only; its children run in their own
    sessions, so without the handler they would outlive it and hold the GPU."""
    import os
    import signal
    import subprocess
    import time

    script = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); import gate; "
        "child = gate.spawn(['sleep', '60'], None, {'PATH': '/usr/bin:/bin'}); "
        "gate.install_cleanup_handler(); print(child.pid, flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(GPU_DIR)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    os.kill(child, 0)  # running
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 124
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        # a killed child stays a zombie until its parent (gone) is reaped by init
        if Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail("the spawned child survived the gate's SIGTERM")


def test_engine_spec_and_report(tmp_path: Path) -> None:
    case = gate.Case("qwen35-r17", "HND", 2, False)
    rc = gate.RunConfig(arm="patched", lmcache_dir=tmp_path, out=tmp_path)
    spec = gate.engine_spec(case, "store", tmp_path, rc, 5555, tmp_path / "l2")
    assert spec["max_num_batched_tokens"] == 2 * 544 - 1
    assert spec["language_model_only"] is True
    assert spec["lmcache"]["extra_config"]["lmcache.mp.port"] == 5555
    assert spec["prompt_key"] == gate.prompt_key(spec["prompt"])
    assert spec["l2_min_objects"] == case.prompt_tokens // case.chunk
    assert "lmcache" not in gate.engine_spec(case, "cold", tmp_path, rc, None, None)
    rec = {
        "case": case.case_id,
        "model": case.model,
        "geometry": {"block_size": 544, "kernel_page": 32, "ratio": 17},
        "layout": "HND",
        "chunk": case.chunk,
        "prompt_tokens": case.prompt_tokens,
        "eval": {"completed": False, "errors": ["store: boom"]},
    }
    md = gate.markdown_report({"arm": "patched", "date": "d", "cases": [rec]})
    assert "| patched | qwen35-r17-HND-c2N-offset |" in md and "ERROR" in md
    assert "store: boom" in md


def test_arm_problem(tmp_path: Path) -> None:
    pkg = tmp_path / "lmcache"
    v = {"lmcache_path": str(pkg), "lmcache_hybridfa": True}
    assert gate.arm_problem("patched", v, tmp_path) is None
    assert "_hybridfa" in gate.arm_problem("pristine", v, tmp_path)
    assert "not from" in gate.arm_problem("patched", v, tmp_path / "other")


def test_gpu_conftest_skips_without_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    conf = _load("hybridfa_gpu_conftest", GPU_DIR / "conftest.py")
    reason = conf.gpu_skip_reason()
    assert reason and "no CUDA GPU" in reason


# --- worker-side helpers of engine_proc.py, on fake CPU model runners -------------------

engine_proc = _load("hybridfa_gpu_engine_proc", GPU_DIR / "engine_proc.py")


def _fa_views(torch, n_kernel: int, page: int, heads: int, width: int, seed: int = 0):
    """Same token-major content as an NHD (strided) and an HND (contiguous) FA cache."""
    g = torch.Generator().manual_seed(seed)
    tok = torch.randn(n_kernel, page, heads, width, generator=g).to(torch.bfloat16)
    nhd = tok.permute(0, 2, 1, 3)  # logical (B, H, page, 2hs), memory (B, page, H, 2hs)
    hnd = tok.permute(0, 2, 1, 3).contiguous()
    return nhd, hnd


def _fake_runner(torch, fa, gdn, n: int, blocks, tokens):
    from types import SimpleNamespace as NS

    class Runner:
        def __init__(self) -> None:
            self.requests = {"r0": NS(prompt_token_ids=tokens, block_ids=blocks)}
            self.compilation_config = NS(
                static_forward_context={"fa.0": NS(kv_cache=fa), "gdn.0": NS(kv_cache=gdn)}
            )
            self.kv_cache_config = NS(
                kv_cache_groups=[
                    NS(kv_cache_spec=NS(block_size=n), layer_names=["gdn.0"]),
                    NS(kv_cache_spec=NS(block_size=n), layer_names=["fa.0"]),
                ]
            )
            self.model = torch.nn.ModuleDict(
                {"proj": torch.nn.Linear(4, 4), "input_layernorm": torch.nn.LayerNorm(4)}
            )

        def _update_states(self, scheduler_output):
            return "orig"

        def get_model(self):
            return self.model

    return NS(worker=NS(model_runner=Runner(), rank=0))


def _gdn(torch, nb: int):
    g = torch.Generator().manual_seed(7)
    return [
        torch.randn(nb, 3, 16, generator=g).to(torch.bfloat16),
        torch.randn(nb, 2, 4, 4, generator=g),
    ]


def _hash_run(torch, fa, tokens, n=80):
    blocks = ([0, 3, 1, 2], [5, 3, 1, 2])  # GDN group has a null block, FA group none
    w = _fake_runner(torch, fa, _gdn(torch, 8), n, blocks, tokens)
    assert engine_proc._rpc_install_block_hook(w) == "Runner"
    assert w.worker.model_runner._update_states(None) == "orig"
    return engine_proc._rpc_kv_hashes(w, gate.prompt_key(tokens), len(tokens))


def test_kv_hashes_are_layout_independent_and_per_block() -> None:
    torch = pytest.importorskip("torch")
    n, page, r = 80, 16, 5
    tokens = gate.make_prompt(3 * n + 10, seed=4)  # blocks 0..2 full, block 3 partial
    nhd, hnd = _fa_views(torch, 8 * r, page, 2, 8)
    a, b = _hash_run(torch, nhd, tokens), _hash_run(torch, hnd, tokens)
    assert a["layout"] == "NHD" and b["layout"] == "HND" and a["kernel_page"] == page
    assert a["fa"] == b["fa"] and a["gdn"] == b["gdn"]
    assert sorted(a["fa"]["fa.0"], key=int) == ["0", "1", "2", "3"]
    assert sorted(a["gdn"]["gdn.0"], key=int) == ["1", "2"]  # full blocks, nulls skipped
    # one byte in the 4th kernel page of logical block id 1 (prompt block 2) changes only it
    hnd2 = hnd.clone()
    hnd2[1 * r + 3, 1, 5, 0] += 1
    c = _hash_run(torch, hnd2, tokens)
    diff = [j for j in a["fa"]["fa.0"] if a["fa"]["fa.0"][j] != c["fa"]["fa.0"][j]]
    assert diff == ["2"]
    # slots past the prompt in the partial last block (block id 2) are not hashed
    hnd3 = hnd.clone()
    hnd3[2 * r + 4, 0, page - 1, 0] += 1
    assert _hash_run(torch, hnd3, tokens)["fa"] == a["fa"]
    # a pristine-like restore that wrote only one kernel page per block is detected
    partial = hnd.clone()
    partial[r + 1 : 2 * r] = 0
    res = gate.compare_kv_hashes([a], [_hash_run(torch, partial, tokens)], hit_tokens=2 * n)
    assert not res["match"] and res["fa_bad"] == 1


def test_init_weights_is_deterministic() -> None:
    torch = pytest.importorskip("torch")
    fps = []
    for _ in range(2):
        w = _fake_runner(torch, None, None, 80, ([],), [])
        out = engine_proc._rpc_init_weights(w, 1234, 0.02)
        model = w.worker.model_runner.model
        fps.append(out["fingerprint"])
        assert out["params"] == sum(p.numel() for p in model.parameters())
        norm, proj = model["input_layernorm"], model["proj"]
        assert abs(float(norm.weight.detach().mean()) - 1.0) < 0.1  # norm scales near 1
        assert abs(float(norm.bias.detach().mean())) < 0.1
        assert float(proj.weight.detach().std()) < 0.1
    assert fps[0] == fps[1]


def _one_l2_object(l2: Path) -> None:
    (l2 / "m@0x1000000@0x0@0001.data").parent.mkdir(parents=True, exist_ok=True)
    (l2 / "m@0x1000000@0x0@0001.data").write_bytes(b"\0" * 64)


def test_l2_wait_gives_up_when_the_server_failed_stores(tmp_path: Path) -> None:
    l2, log = tmp_path / "l2", tmp_path / "server1.log"
    _one_l2_object(l2)
    log.write_text(f"[x] LMCache ERROR: {gate.STORE_FAILED} (transfer.py:1126)\n" * 2)
    t0 = time.monotonic()
    got = gate.wait_l2_stable(l2, 5, timeout=60.0, quiet=0.5, server_log=log)
    assert time.monotonic() - t0 < 10
    assert got["objects"] == 1 and not got["stable"] and got["store_failures"] == 2
    got = engine_proc._wait_l2(str(l2), 5, timeout=60.0, server_log=str(log))
    assert got["waited_s"] < 10 and not got["stable"] and got["store_failures"] == 2
    assert gate.server_log_facts(log.read_text())["store_failures"] == 2


def test_l2_wait_keeps_waiting_for_a_healthy_server(tmp_path: Path) -> None:
    l2, log = tmp_path / "l2", tmp_path / "server1.log"
    _one_l2_object(l2)
    log.write_text("[x] LMCache INFO: Stored 80 tokens in 0.001 seconds\n")
    got = gate.wait_l2_stable(l2, 5, timeout=2.0, quiet=0.5, server_log=log)
    assert not got["stable"] and "store_failures" not in got
    assert gate.wait_l2_stable(l2, 1, timeout=10.0, quiet=0.5, server_log=log)["stable"]


FAKE_ENGINE = """
import json, sys
from pathlib import Path
from typing import Any
spec, out = Path(sys.argv[1]), Path(sys.argv[2])
tries = spec.with_suffix(".tries")
n = int(tries.read_text()) + 1 if tries.exists() else 1
tries.write_text(str(n))
if n <= int(json.loads(spec.read_text())["fail_times"]):
    print("WorkerProc failed to start. ... code: -98, name: EADDRINUSE, message: address in use")
    sys.exit(1)
out.write_text(json.dumps({"ok": True, "try": n}))
"""


@pytest.mark.parametrize("fail_times,ok,attempts", [(0, True, 1), (1, True, 2), (2, False, 2)])
def test_run_engine_starts_again_once_after_a_lost_port_race(
    tmp_path: Path, monkeypatch, fail_times: int, ok: bool, attempts: int
) -> None:
    fake = tmp_path / "fake_engine.py"
    fake.write_text(FAKE_ENGINE)
    monkeypatch.setattr(gate, "ENGINE_PROC", fake)
    res = gate.run_engine(sys.executable, {}, {"fail_times": fail_times}, tmp_path, "store", 30)
    assert bool(res.get("ok")) is ok and res["attempts"] == attempts
    assert (tmp_path / "store.port-race.log").exists() is (fail_times > 0)


def test_run_engine_does_not_retry_other_failures(tmp_path: Path, monkeypatch) -> None:
    fake = tmp_path / "fake_engine.py"
    fake.write_text("import sys; print('CUDA error: invalid argument'); sys.exit(1)\n")
    monkeypatch.setattr(gate, "ENGINE_PROC", fake)
    res = gate.run_engine(sys.executable, {}, {}, tmp_path, "store", 30)
    assert not res["ok"] and res["attempts"] == 1 and "invalid argument" in res["error"]


def test_evaluate_case_needs_kv_hashes_from_every_tp_rank() -> None:
    case = gate.Case("olmo-r5", "NHD", 1, False, tp=2)
    p = case.prompt_tokens
    gdn = {str(p // 80 - 1): "x"}
    one_rank = [_hashes({"0": "a"}, gdn, 0)]
    both = [_hashes({"0": "a"}, gdn, 0), _hashes({"0": "b"}, gdn, 1)]
    cold = {**_engine([5], [], 3.0), "ttft_s": 2.0}
    for hashes, ok in ((both, True), (one_rank, False)):
        store = _engine([5], [], 3.0, kv=hashes)
        restore = {**_engine([5], [], 1.0, cached=p // 80 * 80, kv=hashes), "ttft_s": 0.5}
        ev = gate.evaluate_case(case, cold, store, restore)
        assert ev["a"] is ok, ev["kv"]


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


def _matrix_rec(case: str, failed: str = "", **ev: object) -> dict[str, object]:
    """A completed gate record that misses the criteria named in ``failed``."""
    base = {"completed": True, "hit_tokens": 4000, "hit_pct": 97.0, "restore_s": 0.1}
    base.update(cold_same_engine_s=0.3, tokens_match=True, logprobs_match=True)
    base.update({k: k not in failed for k in "abcde"}, kv={"match": True, "fa_blocks": 8})
    base["pass"] = not failed
    return {"case": case, "eval": {**base, **ev}}


def test_matrix_report_shows_first_runs_reruns_and_empty_restores() -> None:
    first = _matrix_rec("olmo-r5-NHD-c1N-offset", "d")
    rerun = _matrix_rec("olmo-r5-NHD-c1N-offset", restore_s=0.05)
    empty = _matrix_rec("olmo-r5-HND-c1N-offset", "acd", hit_tokens=0)
    reports = [
        {"arm": "patched", "date": "T1", "versions": {"lmcache_dist": "x.7"}, "cases": [first]},
        {"arm": "patched", "date": "T2", "cases": [rerun]},
        {"arm": "pristine", "date": "T0", "cases": [empty]},
    ]
    md = gate.matrix_report(reports)
    rows = {line.split(" | ")[0][2:]: line for line in md.splitlines() if line.startswith("| ")}
    assert "fails (d); rerun: pass (0.05 / 0.3)" in rows["olmo-r5-NHD-c1N-offset"]
    assert "nothing restored | fails (a) (c) (d)" in rows["olmo-r5-HND-c1N-offset"]
    assert "| not run |" in rows["qwen35-r25-HND-c2N-exact"]
    assert {c.case_id for c in gate.full_matrix()} <= set(rows)  # every case has its row
    assert "- patched: 1 of 48 ran; 0 pass a-e on their first run; 0 fail (a)" in md
    assert "- pristine: 1 of 48 ran; 0 pass; 1 fail (a)" in md
    assert "lmcache x.7" in md


def test_d_compares_medians_of_the_repeated_restores_and_cold_prefills() -> None:
    # Measured 2026-11-29: one restore against one cold prefill lost by 0.03 s under load, and
    # passed when rerun alone; one slow outlier on the restore side no longer decides (d).
    case, cold, store, restore = _restored_case(True, 0.185, 0.155)  # 0.185: the outlier
    hit = restore["num_cached_tokens"]
    pairs = [((0.11, hit), (0.15, 0)), ((0.12, hit), (0.16, 0))]
    restore["timed_pairs"] = [
        {
            "restore": {"ttft_s": r, "num_cached_tokens": rc},
            "cold": {"ttft_s": c, "num_cached_tokens": cc},
        }
        for (r, rc), (c, cc) in pairs
    ]
    ev = gate.evaluate_case(case, cold, store, restore)
    assert ev["restore_runs_s"] == [0.185, 0.11, 0.12] and ev["restore_s"] == 0.12
    assert (
        ev["cold_same_engine_runs_s"] == [0.155, 0.15, 0.16] and ev["cold_same_engine_s"] == 0.155
    )
    assert ev["d"] and not ev["errors"]
    restore.pop("timed_pairs")  # one of each, as before: the outlier decides
    assert not gate.evaluate_case(case, cold, store, restore)["d"]


def test_a_repeat_that_restored_nothing_or_hit_a_cache_is_an_error() -> None:
    case, cold, store, restore = _restored_case(False, 0.3, 1.0)
    restore["timed_pairs"] = [
        {
            "restore": {"ttft_s": 0.9, "num_cached_tokens": 0},
            "cold": {"ttft_s": 0.2, "num_cached_tokens": 80},
        }
    ]
    ev = gate.evaluate_case(case, cold, store, restore)
    assert ev["errors"] == [
        "repeat 1: its restore restored nothing",
        "repeat 1: its cold prefill hit a cache",
    ]
    assert (
        not ev["pass"] and ev["restore_runs_s"] == [0.3] and ev["cold_same_engine_runs_s"] == [1.0]
    )


def test_pristine_chunk_objects_hold_one_fa_page_of_r() -> None:
    # Measured on the H200 (2026-11-29): olmo-r25 at C = 2N, pristine 19,922,944 B.
    m = gate.MODELS["olmo-r25"]
    assert gate.expected_pristine_chunk_bytes(m, 3200) == 19_922_944
    fa = 2 * 3200 * gate.attn_bytes_per_token(m)  # 2 FA layers of 8, every page
    assert gate.expected_chunk_bytes(m, 3200) - gate.expected_pristine_chunk_bytes(m, 3200) == (
        fa * 24 // 25
    )


def test_chunk_bytes_table_sets_measured_objects_beside_expected() -> None:
    def rec(per: float) -> dict[str, object]:
        return {"model": "olmo-r5", "chunk": 80, "l2_bytes_per_object": per}

    runs = {
        ("patched", "olmo-r5-NHD-c1N-offset"): [rec(655_400.0)],
        ("pristine", "olmo-r5-NHD-c1N-offset"): [rec(524_288.0)],
        ("pristine", "olmo-r5-HND-c1N-offset"): [rec(0.0)],  # stored nothing
    }
    rows = gate.chunk_bytes_table(runs)[2:]
    assert rows == ["| olmo-r5 | 80/16/5 | 80 | 655,360 | 655,400 | 524,288 | 524,288 | 0.8 |"]


def test_extra_server_args_come_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("HYBRIDFA_SERVER_ARGS", "--separate-object-groups --x 'a b'")
    assert gate.extra_server_args() == ["--separate-object-groups", "--x", "a b"]
    monkeypatch.delenv("HYBRIDFA_SERVER_ARGS")
    assert gate.extra_server_args() == []


def test_matrix_refuses_to_mix_server_configurations() -> None:
    plain = {"arm": "patched", "date": "T1", "cases": [_matrix_rec("olmo-r5-NHD-c1N-offset")]}
    opt = {**plain, "date": "T2", "server_args": ["--separate-object-groups"]}
    with pytest.raises(ValueError, match="different server args"):
        gate.matrix_report([plain, opt])
    assert "server args --separate-object-groups" in gate.matrix_report([opt])


def test_matrix_counts_a_chunk_of_separate_object_groups_as_fa_plus_one_gdn_block() -> None:
    # olmo-r5, chunk 2N, as measured on the H200 (2026-11-30): FA 327,720 B and GDN
    # 491,560 B objects, each with its 40-byte trailer.
    rec = _matrix_rec("olmo-r5-NHD-c2N-offset")
    rec.update(model="olmo-r5", chunk=160, l2_bytes_per_object=409640.0)
    rec["l2_after_store"] = {
        "objects": 104,
        "bytes": 52 * (327720 + 491560),
        "per_object_group": {
            "0": {"objects": 52, "bytes": 52 * 491560},
            "1": {"objects": 52, "bytes": 52 * 327720},
        },
    }
    rep = {"arm": "patched", "date": "T", "server_args": ["--separate-object-groups"]}
    md = gate.matrix_report([{**rep, "cases": [rec]}])
    row = next(x for x in md.splitlines() if x.startswith("| olmo-r5 | 80/16/5 | 160 |"))
    assert "| 819,200 | 819,280 |" in row  # expected FA + one GDN block; measured + 2 trailers


def _passing_evaluation() -> dict:
    case = gate.Case("olmo-r5", "NHD", 1, False)
    p = case.prompt_tokens
    kv = [_hashes({"0": "a"}, {str(p // 80 - 1): "x"})]
    cold, store = _engine([5], [], 2.0), _engine([5], [], 2.1, kv=kv)
    ev = gate.evaluate_case(case, cold, store, _engine([5], [], 0.5, cached=p // 80 * 80, kv=kv))
    assert ev["pass"], ev
    return ev


def test_a_case_with_failed_stores_does_not_pass() -> None:
    rec = {"server1": {"store_failures": 3}}
    assert not gate.add_errors(_passing_evaluation(), gate.run_errors(rec))["pass"]


def test_an_l2_folder_that_never_settled_is_an_error() -> None:
    rec = {"l2_after_store": {"objects": 2, "bytes": 10, "stable": False}}
    ev = gate.add_errors(_passing_evaluation(), gate.run_errors(rec))
    assert not ev["pass"] and "did not settle" in ev["errors"][-1]


def test_a_pristine_case_that_stored_nothing_does_not_show_the_bug() -> None:
    shown, why = gate.pristine_shows_the_bug({"bytes_match": None})
    assert not shown and "restored nothing" in why
    assert gate.pristine_shows_the_bug({"bytes_match": False})[0]
    assert not gate.pristine_shows_the_bug({"bytes_match": True})[0]


def test_deployment_cases_name_their_backend_and_batch() -> None:
    cases = {c.case_id: c for c in gate.select_cases("deploy")}
    fa = cases["olmo-r5-NHD-c1N-offset-fa"]
    assert (fa.geometry.kernel_page, fa.geometry.ratio) == (80, 1)
    assert cases["olmo-r5-NHD-c1N-offset-mbtN"].max_num_batched_tokens == 80
    assert gate.select_cases("olmo-r5-NHD-c3N-offset")[0].chunk == 240
    assert gate.Case("olmo-r5", "NHD", 1, False).max_num_batched_tokens == 159


def test_mtp_lengthens_the_conv_state_in_the_expected_page() -> None:
    m = gate.MODELS["qwen35-r5"]
    conv_dim = 2 * 4 * 64 + 8 * 64
    assert gate.mamba_page_bytes(m, spec_tokens=2) - gate.mamba_page_bytes(m) == conv_dim * 2 * 2
    case = gate.Case("qwen35-r5", "NHD", 2, False, spec_tokens=1)
    assert case.case_id == "qwen35-r5-NHD-c2N-offset-mtp1"
    assert case.geometry == gate.expected_geometry(m, 1, 1)


def test_mtp_model_config_takes_vllms_mtp_path() -> None:
    pytest.importorskip("transformers")
    from vllm.config.speculative import SpeculativeConfig
    from vllm.transformers_utils.configs.qwen3_5 import Qwen3_5Config

    cfg = Qwen3_5Config(**gate.model_config_dict(gate.MODELS["qwen35-r5"], mtp=True))
    assert cfg.text_config.mtp_num_hidden_layers == 1
    draft = SpeculativeConfig.hf_config_override(cfg)
    assert draft.architectures == ["Qwen3_5MTP"] and draft.n_predict == 1
    with pytest.raises(ValueError, match="MTP"):
        gate.model_config_dict(gate.MODELS["olmo-r5"], mtp=True)


def test_mtp_cases_ask_every_engine_for_speculative_decoding(tmp_path: Path) -> None:
    rc = gate.RunConfig(arm="patched", lmcache_dir=tmp_path, out=tmp_path)
    case = gate.Case("qwen35-r5", "HND", 1, True, spec_tokens=2)
    for role in ("cold", "store", "restore"):
        spec = gate.engine_spec(case, role, tmp_path, rc, 1, None)
        assert spec["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    assert "speculative_config" not in gate.engine_spec(
        gate.Case("qwen35-r5", "HND", 1, True), "cold", tmp_path, rc, None, None
    )
    assert {c.spec_tokens for c in gate.select_cases("mtp")} == {1, 2}


@pytest.mark.parametrize("case", gate.turn2_matrix(), ids=lambda c: c.case_id)
def test_turn2_answer_ends_where_prefix_cache_and_chunks_agree(case: Any) -> None:
    n, c = case.geometry.block_size, case.chunk
    kv_tokens = case.prompt_tokens + case.answer_tokens - 1
    own = kv_tokens // n * n - (n if case.spec_tokens else 0)  # vLLM's own full-block hit
    assert case.answer_tokens >= 2 * c
    assert own % c == 0 and kv_tokens - own < n + c  # it ends on a chunk boundary
    assert own == case.promisable_hit
    assert case.promisable_hit >= gate.HIT_FRACTION * case.turn2_prompt_tokens - n


def test_turn2_restores_the_prompt_plus_answer_plus_question(tmp_path: Path) -> None:
    rc = gate.RunConfig(arm="patched", lmcache_dir=tmp_path, out=tmp_path)
    case = gate.Case("olmo-r5", "NHD", 2, False, turn=2)
    answer = list(range(100, 100 + case.answer_tokens))
    cold = gate.engine_spec(case, "cold", tmp_path, rc, None, None)
    assert cold["new_tokens"] == case.answer_tokens
    assert cold["turn2_question"] == list(gate.TURN2_QUESTION)
    restore = gate.restore_spec(case, tmp_path, rc, 1, answer)
    assert restore["prompt"] == cold["prompt"] + answer + list(gate.TURN2_QUESTION)
    assert restore["prompt_key"] == gate.prompt_key(restore["prompt"])
    assert len(restore["cold_reference"]) == case.turn2_prompt_tokens
    assert restore["max_model_len"] >= case.turn2_prompt_tokens + gate.NEW_TOKENS
    assert case.turn2_prompt_tokens == len(restore["prompt"])


def _turn2_engines(restore_kv: list, restore_tokens: list[int]) -> tuple[Any, dict, dict, dict]:
    case = gate.Case("olmo-r5", "NHD", 2, False, turn=2)
    p2, hit = case.turn2_prompt_tokens, case.promisable_hit
    ref_kv = [_hashes({"0": "a"}, {str(hit // 80 - 1): "x"})]
    cold = _engine([5] * case.answer_tokens, [], 3.0)
    cold["turn2"] = {
        "tokens": [7],
        "logprobs": [],
        "kv_hashes": ref_kv,
        "local_cached_tokens": hit,
        "external_cached_tokens": 0,
    }
    # the storing engine's own turn-1 prompt: what turn 1 (wrongly) would compare against
    store = _engine([5] * case.answer_tokens, [], 3.0, kv=[_hashes({"0": "turn1"}, {})])
    restore = {**_engine(restore_tokens, [], 0.5, cached=hit, kv=restore_kv), "ttft_s": 0.5}
    restore.update(external_cached_tokens=hit, local_cached_tokens=0)
    restore["cold_reference"] = {"ttft_s": 1.0, "num_cached_tokens": 0}
    assert p2 > hit
    return case, cold, store, restore


def test_turn2_is_judged_against_vllms_own_prefix_cache() -> None:
    case, cold, store, restore = _turn2_engines([], [7])
    restore["kv_hashes"] = cold["turn2"]["kv_hashes"]
    ev = gate.evaluate_case(case, cold, store, restore)
    assert ev["pass"], ev
    assert ev["reference_prefix_cache_hit"] == case.promisable_hit
    _, _, _, flipped = _turn2_engines(cold["turn2"]["kv_hashes"], [8])
    ev = gate.evaluate_case(case, cold, store, flipped)
    assert ev["a"] and not ev["b"] and not ev["pass"]


def test_turn2_without_the_reference_turn_is_an_error() -> None:
    case, cold, store, restore = _turn2_engines([], [7])
    del cold["turn2"]
    ev = gate.evaluate_case(case, cold, store, restore)
    assert "the reference engine did not run turn 2" in ev["errors"] and not ev["pass"]


def test_c_counts_the_connectors_hit_not_the_engines_own_prefix_cache() -> None:
    case, cold, store, restore = _restored_case(False, 0.5, 1.0)
    hit = restore["num_cached_tokens"]
    assert gate.evaluate_case(case, cold, store, restore)["c"]
    # the same cached-token count, served by vLLM's own prefix cache and not LMCache
    local = {**restore, "external_cached_tokens": 0, "local_cached_tokens": hit}
    ev = gate.evaluate_case(case, cold, store, local)
    assert ev["hit_tokens"] == 0 and not ev["c"] and not ev["pass"]
    assert any("own prefix cache served" in e for e in ev["errors"])


def test_block_table_resyncs_are_counted_when_a_slot_is_rewritten() -> None:
    from types import ModuleType
    from types import SimpleNamespace as NS

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


def test_init_weights_covers_the_drafter_but_not_what_it_shares() -> None:
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace as NS

    w = _fake_runner(torch, None, None, 80, ([],), [])
    runner = w.worker.model_runner
    shared = runner.model["proj"]
    runner.drafter = NS(model=torch.nn.ModuleDict({"fc": torch.nn.Linear(4, 4), "head": shared}))
    engine_proc._rpc_init_weights(w, 1234, 0.02)
    target_proj = shared.weight.detach().clone()
    fresh = _fake_runner(torch, None, None, 80, ([],), [])
    engine_proc._rpc_init_weights(fresh, 1234, 0.02)
    assert torch.equal(target_proj, fresh.worker.model_runner.model["proj"].weight)
    fc = runner.drafter.model["fc"].weight
    assert float(fc.detach().abs().max()) < 0.2 and float(fc.detach().std()) > 0.005


def test_l2_cases_name_their_adapter_and_only_patched_refuses_fs_native() -> None:
    cases = {c.case_id: c for c in gate.select_cases("l2")}
    assert {c.l2 for c in cases.values()} == {"resp", "fs_native"}
    native = cases["olmo-r5-NHD-c2N-offset-fsnative"]
    assert native.refused_by("patched") and not native.refused_by("pristine")
    assert not cases["olmo-r5-NHD-c1N-offset-resp"].refused_by("patched")


def _refused_evaluation(hit: int) -> dict:
    case = gate.Case("olmo-r5", "NHD", 2, False, l2="fs_native")
    cold, store = _engine([5], [], 2.0), _engine([5], [], 2.1)
    restore = _engine([5], [], 2.0, cached=hit)
    restore["timed_pairs"] = [{"restore": {"gen_s": 2.0, "num_cached_tokens": hit}}]
    return gate.evaluate_case(case, cold, store, restore, refused=True)


def test_a_refused_case_passes_on_a_miss_with_the_stored_prompts_tokens() -> None:
    ev = _refused_evaluation(0)
    assert ev["pass"] and gate.verdict(ev) == "refused (a miss)"
    assert ev["a"] is None and ev["d"] is None


def test_a_refused_case_with_a_hit_fails_c() -> None:
    ev = _refused_evaluation(320)
    assert not ev["pass"] and ev["c"] is False


def test_a_refusal_the_server_never_logged_or_that_stored_objects_is_an_error() -> None:
    rec = {"expect_refusal": True, "server1": {"refusals": 0}, "l2_after_kill": {"objects": 3}}
    errors = gate.run_errors(rec)
    assert len(errors) == 2 and gate.REFUSAL in errors[0]
    logged = {"expect_refusal": True, "server1": {"refusals": 1}, "l2_after_kill": {"objects": 0}}
    assert gate.run_errors(logged) == []


def test_a_refused_case_waits_for_no_stored_object(tmp_path: Path) -> None:
    case = gate.Case("olmo-r5", "NHD", 2, False, l2="fs_native")
    rc = gate.RunConfig(arm="patched", lmcache_dir=tmp_path, out=tmp_path)
    assert gate.store_spec(case, tmp_path, rc, 1, tmp_path / "l2")["l2_min_objects"] == 0
    pristine = gate.RunConfig(arm="pristine", lmcache_dir=tmp_path, out=tmp_path)
    assert gate.store_spec(case, tmp_path, pristine, 1, tmp_path / "l2")["l2_min_objects"] > 0


@pytest.mark.parametrize(
    ("case_id", "promise"),
    [
        ("qwen35-r5-NHD-c2N-offset-mtp1", 4000),  # not 4160: no state at 4160 (block 52's end)
        ("qwen35-r17-NHD-c1N-offset-mtp2", 8704),  # not 9248
        ("qwen35-r5-HND-c1N-exact-mtp2", 4080),  # an exact prompt: the last chunk anyway
    ],
)
def test_under_mtp_the_promise_ends_a_block_before_the_prompts_last_full_block(
    case_id: str, promise: int
) -> None:
    """Seen on the H200 (vLLM 0.26.0): under MTP the scheduler ends no prefill step at the
    prompt's last full block, so that block's recurrent state never exists."""
    (case,) = gate.select_cases(case_id)
    assert case.promisable_hit == promise
    plain = gate.Case(case.model, case.layout, case.chunk_blocks, case.exact)
    assert plain.promisable_hit >= promise


def test_turn2_under_mtp_is_bounded_by_vllms_own_prefix_cache_hit() -> None:
    case, cold, store, restore = _turn2_engines([], [7])
    mtp = gate.Case("olmo-r5", "NHD", 2, False, spec_tokens=1, turn=2)
    own = case.promisable_hit - 80  # vLLM's own hit: a block short of the usual promise
    cold["turn2"]["local_cached_tokens"] = own
    restore["kv_hashes"] = cold["turn2"]["kv_hashes"]
    bound = own // mtp.chunk * mtp.chunk
    for hit, c in ((bound, True), (bound - mtp.chunk, False)):
        restore.update(external_cached_tokens=hit, num_cached_tokens=hit)
        ev = gate.evaluate_case(mtp, cold, store, restore)
        assert ev["required_hit"] == bound and ev["c"] is c, ev
    cold["turn2"]["local_cached_tokens"] = 0
    ev = gate.evaluate_case(mtp, cold, store, restore)
    assert not ev["pass"] and any("no bound for (c)" in e for e in ev["errors"])


def _recorded_mtp_case(**ev: Any) -> dict[str, Any]:
    """A report of the H200 run of 2026-12-01 (revision 12), one MTP case as it recorded it."""
    base = {"completed": True, "errors": [], "prompt_tokens": 4207, "hit_tokens": 4000}
    base.update(required_hit=4081, a=True, b=True, c=False, d=True, e=True, pass_=False)
    base.update(ev)
    base["pass"] = base.pop("pass_")
    case = {"case": "qwen35-r5-NHD-c2N-offset-mtp1", "model": "qwen35-r5", "tp": 1, "eval": base}
    case.update(geometry={"block_size": 80, "kernel_page": 16, "ratio": 5}, layout="NHD")
    case.update(chunk=160, prompt_tokens=4207)
    return {"arm": "patched", "date": "2026-12-01T180924", "cases": [case]}


def test_rejudge_judges_c_by_todays_promise_and_keeps_the_rest() -> None:
    ev = gate.rejudge(_recorded_mtp_case())["cases"][0]["eval"]
    assert ev["required_hit"] == 4000 and ev["c"] and ev["pass"]
    assert ev["recorded"] == {"required_hit": 4081, "c": False, "pass": False}
    ev = gate.rejudge(_recorded_mtp_case(b=False))["cases"][0]["eval"]
    assert ev["c"] and not ev["pass"]
    ev = gate.rejudge(_recorded_mtp_case(hit_tokens=3840))["cases"][0]["eval"]
    assert not ev["c"] and not ev["pass"]


def test_rejudge_writes_a_report_of_its_own(tmp_path: Path) -> None:
    src = tmp_path / "gpu-gate-2026-12-01T180924-patched.json"
    src.write_text(json.dumps(_recorded_mtp_case()))
    assert gate.main(["--rejudge", str(src), "--out", str(tmp_path / "out")]) == 0
    out = json.loads((tmp_path / "out" / f"{src.stem}-rejudged.json").read_text())
    assert out["summary"]["passed"] == 1 and out["rejudged"]
