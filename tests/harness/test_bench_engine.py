"""The bench's engine sequence (bench/bench_engine.py) with a fake vLLM engine: rounds of a cold
and restores, each cold's files removed, each restore after a prefix reset, an L1 clear and a
quiet folder, a disk restore's files dropped and their residency and read bytes recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import bench_engine as be


class FakeLLM:
    def __init__(self) -> None:
        self.resets: list[bool] = []

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        self.resets.append(reset_connector)
        return True


def test_a_restore_engine_runs_its_rounds_with_the_evidence_of_each_restore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier, llm, events = tmp_path / "tier", FakeLLM(), []
    tier.mkdir()
    (tier / "kept.data").write_bytes(b"k" * 4096)

    def timed(llm_: Any, tokens: list[int], params: Any, steps: Any = None, lora: Any = None):
        events.append(("request", len(tokens)))
        if tokens[0] == 7:  # a cold: the connector stores it
            (tier / f"cold-{len(events)}.data").write_bytes(b"c" * 4096)
        got = {"ttft_s": 0.5, "num_cached_tokens": 0, "external_cached_tokens": 0}
        return None, {**got, "probe": [{"epoch": 1.0}, {"epoch": 2.0}]}

    monkeypatch.setattr(be.ep, "_start", lambda spec, result: llm)
    monkeypatch.setattr(be.ep, "_generate", lambda *a: None)
    monkeypatch.setattr(be.ep, "_generate_timed", timed)
    monkeypatch.setattr(be.ep, "_time_lookups", lambda llm_, calls: True)
    monkeypatch.setattr(be.ep, "PrefillTap", lambda core: None)
    monkeypatch.setattr(be, "_kv", lambda llm_, tokens: [{"rank": 0}])
    monkeypatch.setattr(be.floor, "drop_cache", lambda files: events.append(("drop", len(files))))
    monkeypatch.setattr(be.urllib.request, "urlopen", lambda *a, **k: pytest.fail("no clear_url"))
    llm.collective_rpc = lambda *a, **k: None  # type: ignore[attr-defined]
    llm.llm_engine = type("E", (), {"engine_core": None})()  # type: ignore[attr-defined]
    spec = {
        "role": "restore",
        "new_tokens": 2,
        "warmup": [1, 2],
        "tier": str(tier),
        "block_tokens": 2,
        "warm_prompts": [[7, 7, 7]],
        "cold_prompts": [[7, 7, 7, 7, 7], [7, 7, 7, 7, 7]],
        "stored": [[1, 1, 1, 1, 1]],
        "rounds": 2,
        "kinds": ["cold", "disk", "pagecache"],
    }
    monkeypatch.setattr(
        be.floor,
        "wait_quiet",
        lambda folder, suffix, n=0, q=2.0, t=60.0: {
            "quiet": True,
            "waited_s": 0.0,
            "files": be.floor.snapshot(folder, suffix),
        },
    )
    result: dict[str, Any] = {}
    be.run(spec, result)
    kinds = [r["kind"] for r in result["requests"]]
    assert kinds == ["cold", "disk", "pagecache"] * 2 and llm.resets == [False] * 5
    assert [p.name for p in tier.iterdir()] == ["kept.data"]  # the colds' files removed
    disk = [r for r in result["requests"] if r["kind"] == "disk"]
    assert all(r["l2_quiet"] and r["bytes"] == 4096 and "io_read_bytes" in r for r in disk)
    assert events.count(("drop", 1)) == 2  # before each disk restore only
    assert all(r["span"] == [1.0, 2.0] and r["kv_hashes"] for r in disk)
