"""The bench's engine sequence (bench/bench_engine.py) with a fake vLLM engine: rounds of a cold,
restores and a fixed-cost probe, each cold's files removed, each restore after a prefix reset,
an L1 clear and a quiet folder, a disk restore's files dropped and each of its prompt's files'
residency recorded; the stored prompts' own files; the deadline; the mode read back."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import pytest

from bench import bench_engine as be


class FakeLLM:
    def __init__(self) -> None:
        self.resets: list[bool] = []
        idle = NS(scheduler=NS(has_requests=lambda: False))
        self.llm_engine = NS(engine_core=NS(engine_core=idle))

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        self.resets.append(reset_connector)
        return True

    def collective_rpc(self, *a: Any, **k: Any) -> None:
        return None


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A fake engine whose colds (prompts of 7s) and stores (prompts of 1s before any reset)
    write a file to the tier, as a connector storing them would; ``events`` logs requests and
    drops."""
    tier, llm, events = tmp_path / "tier", FakeLLM(), []
    tier.mkdir()

    def timed(llm_: Any, tokens: list[int], params: Any, steps: Any = None, lora: Any = None):
        events.append(("request", tokens[0], len(tokens)))
        if tokens[0] == 7 or (tokens[0] == 1 and not llm.resets):
            (tier / f"p{tokens[0]}-{len(events)}.data").write_bytes(b"c" * 4096)
        if steps is not None:
            steps += [{"t": 0.0, "s": 0.2}, {"t": 0.2, "s": 0.3}, {"t": 0.9, "s": 0.01}]
        got = {"ttft_s": 0.5, "num_cached_tokens": 0, "external_cached_tokens": 0}
        out = NS(outputs=[NS(token_ids=[3, 4])])
        return out, {**got, "probe": [{"epoch": 1.0}, {"epoch": 2.0}]}

    monkeypatch.setattr(be.ep, "start_engine", lambda spec, result: llm)
    monkeypatch.setattr(be.ep, "generate", lambda *a: None)
    monkeypatch.setattr(be.ep, "generate_timed", timed)
    monkeypatch.setattr(be.ep, "time_lookups", lambda llm_, calls: True)
    monkeypatch.setattr(be.ep, "scheduler_connector", lambda llm_: None)
    monkeypatch.setattr(be.ep, "PrefillTap", lambda core: None)
    monkeypatch.setattr(be, "engine_mode", lambda llm_: {"enforce_eager": False})
    monkeypatch.setattr(be, "_kv", lambda llm_, tokens: [{"rank": 0}])
    monkeypatch.setattr(be.floor, "drop_cache", lambda files: events.append(("drop", len(files))))
    monkeypatch.setattr(be.urllib.request, "urlopen", lambda *a, **k: pytest.fail("no clear_url"))
    monkeypatch.setattr(
        be.floor,
        "wait_quiet",
        lambda folder, suffix, n=0, q=2.0, t=60.0: {
            "quiet": True,
            "waited_s": 0.0,
            "files": be.floor.snapshot(folder, suffix),
        },
    )
    spec = {
        "new_tokens": 2,
        "warmup": [1, 2],
        "tier": str(tier),
        "block_tokens": 2,
        "warm_prompts": [[9, 9, 9]],
        "cold_prompts": [[7, 7, 7, 7, 7], [7, 7, 7, 7, 7]],
        "stored": [[1, 1, 1, 1, 1]],
    }
    return {"llm": llm, "tier": tier, "events": events, "spec": spec}


def _restore(engine: dict[str, Any], **kw: Any) -> dict[str, Any]:
    tier = engine["tier"]
    (tier / "kept.data").write_bytes(b"k" * 4096)
    (tier / "other.data").write_bytes(b"o" * 8192)
    spec = {**engine["spec"], "role": "restore", "rounds": 2}
    spec.update(
        kinds=["cold", "disk", "pagecache", "fixed"], stored_files=[[str(tier / "kept.data")]]
    )
    spec.update(kw)
    result: dict[str, Any] = {}
    be.run(spec, result)
    return result


def test_a_restore_engine_runs_rounds_of_a_cold_restores_and_a_fixed_probe(
    engine: dict[str, Any],
) -> None:
    result = _restore(engine)
    kinds = [r["kind"] for r in result["requests"]]
    assert kinds == ["cold", "disk", "pagecache", "fixed"] * 2
    assert engine["llm"].resets == [False] * 5  # the warm restore and 2 per round, not the probe


def test_each_colds_files_are_removed_and_their_writes_timed(engine: dict[str, Any]) -> None:
    result = _restore(engine)
    assert sorted(p.name for p in engine["tier"].iterdir()) == ["kept.data", "other.data"]
    cold = result["requests"][0]
    assert cold["settle"]["removed_files"] == 1 and cold["settle"]["writes"]["bytes"] == 4096
    assert cold["steps_s"] == [0.2, 0.3]  # the steps before the first token


def test_only_a_disk_restore_drops_the_folder_from_the_page_cache(engine: dict[str, Any]) -> None:
    _restore(engine)
    assert engine["events"].count(("drop", 2)) == 2  # both files, before each disk restore


def test_a_restore_records_the_residency_of_each_of_its_prompts_files(
    engine: dict[str, Any],
) -> None:
    disk = [r for r in _restore(engine)["requests"] if r["kind"] == "disk"]
    assert all(r["hit_files"]["files"] == 1 and r["hit_files"]["bytes"] == 4096 for r in disk)
    assert all(r["l2_quiet"] and r["prefix_reset"] and "io_read_bytes" in r for r in disk)


def test_the_offloading_connectors_reset_is_its_cpu_tiers_clear(engine: dict[str, Any]) -> None:
    result = _restore(engine, connector="offloading")
    disk = [r for r in result["requests"] if r["kind"] == "disk"]
    assert engine["llm"].resets[-1] is True and all(r["l1_cleared"] for r in disk)


def test_a_store_engine_records_each_prompts_own_files(engine: dict[str, Any]) -> None:
    spec = {**engine["spec"], "role": "store", "stored": [[1, 1, 1], [1, 1, 1, 1]]}
    result: dict[str, Any] = {}
    be.run(spec, result)
    files = [set(s["files"]) for s in result["stored"]]
    assert len(files[0]) == len(files[1]) == 1 and not files[0] & files[1]
    assert result["l2"]["files"] == 2 and all(s["tokens"] == [3, 4] for s in result["stored"])


def test_no_round_starts_that_would_end_past_the_deadline() -> None:
    budget = be.Budget(time.time() + 10.0)
    assert budget.fits()
    budget.took(time.time() - 9.0)  # a unit took 9 s
    assert not budget.fits() and budget.cut == 1


def test_without_a_deadline_every_unit_runs() -> None:
    budget = be.Budget(None)
    budget.took(time.time() - 1e6)
    assert budget.fits()


@pytest.mark.parametrize(
    ("read", "mode"),
    [
        (
            {
                "enforce_eager": False,
                "compilation_mode": "VLLM_COMPILE",
                "cudagraph_mode": "FULL_AND_PIECEWISE",
            },
            "graphs",
        ),
        ({"enforce_eager": True, "compilation_mode": "NONE", "cudagraph_mode": "NONE"}, "eager"),
        (
            {"enforce_eager": False, "compilation_mode": "VLLM_COMPILE", "cudagraph_mode": "NONE"},
            "mixed",
        ),
        (None, "mixed"),
    ],
)
def test_the_mode_is_named_from_what_the_engine_resolved(read: Any, mode: str) -> None:
    assert be.mode_of(read) == mode


def test_the_mode_is_read_from_the_engines_resolved_config() -> None:
    cfg = pytest.importorskip("vllm.config.compilation")
    cc = NS(
        mode=cfg.CompilationMode.VLLM_COMPILE,
        cudagraph_mode=cfg.CUDAGraphMode.PIECEWISE,
        max_cudagraph_capture_size=512,
    )
    vc = NS(compilation_config=cc, model_config=NS(enforce_eager=False, max_model_len=133184))
    read = be.engine_mode(NS(llm_engine=NS(vllm_config=vc)))
    assert read["compilation_mode"] == "VLLM_COMPILE" and read["cudagraph_mode"] == "PIECEWISE"
    assert be.mode_of(read) == "graphs" and read["max_model_len"] == 133184
