"""One case end to end (run.run_case) with fake LMCache servers and engines: what each engine
is started with, what happens between the store and the restore, and the verdict."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from judge_fakes import engine, hashes

from hybridfa_gate import forge, report, run
from hybridfa_gate.cases import Case, select_cases
from hybridfa_gate.specs import RunConfig


class _Proc:
    pid = -1


class Fakes:
    """Servers and engines of one case: each engine's spec and what its fake computes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, case: Case, restored: int) -> None:
        self.case, self.restored = case, restored
        self.specs: dict[str, dict[str, Any]] = {}
        self.servers: list[tuple[int, tuple[str, ...]]] = []
        monkeypatch.setattr(run, "start_server", self.start_server)
        monkeypatch.setattr(run, "run_engine", self.run_engine)
        monkeypatch.setattr(run, "kill_group", lambda proc: None)
        monkeypatch.setattr(run, "wait_l2_stable", lambda *a, **k: {"objects": 1, "stable": True})

    def start_server(self, py, env, port, chunk, adapter, log, extra_args=()) -> _Proc:
        assert chunk == self.case.chunk and json.dumps(adapter)
        log.write_text("Stored tokens\n")
        self.servers.append((port, tuple(extra_args)))
        return _Proc()

    def run_engine(self, py, env, spec, wd, role, timeout) -> dict[str, Any]:
        json.dumps(spec)  # what engine_proc reads must serialise
        self.specs[role] = spec
        case, n = self.case, self.case.geometry.block_size
        geo = {"block_size": n, "kernel_page": case.geometry.kernel_page, "ratio": 1}
        full = case.prompt_tokens // n
        kv = [hashes({"0": "a"}, {str(j): "x" for j in range(full)}, n=n)]
        lps = [{"5": -1.0}]
        if role == "store":
            out = engine([5], lps, 2.0, kv=kv)
            if spec.get("l2_snapshot"):  # the measured prompt's objects, then another prompt's
                l2 = Path(spec["l2"])
                for c in range(case.prompt_tokens // case.chunk):
                    payload = bytes([c + 1]) * case.fa_object_bytes
                    name = f"m~hfa-ab@0x01000000@1@{c:04x}.data"
                    (l2 / name).write_bytes(payload + forge.unkeyed_trailer(payload, name))
                out["l2_snapshot"] = forge.snapshot(l2)
                name = "m~hfa-ab@0x01000000@1@ffff.data"
                payload = bytes([99]) * case.fa_object_bytes
                (l2 / name).write_bytes(payload + forge.unkeyed_trailer(payload, name))
        elif role == "cold":
            out = engine([5], lps, 2.0)
        else:
            out = engine([5], lps, 0.5, cached=self.restored, kv=kv)
        if "second" in spec:
            b = {**engine([9], lps, 1.0, cached=0, kv=kv), "lora": "B"}
            out["second"] = b
        eager = spec.get("enforce_eager", True)
        out["compilation"] = {"cudagraph_mode": "NONE" if eager else "FULL_AND_PIECEWISE"}
        return {**out, "geometry": geo, "observed_layout": case.layout}


@pytest.fixture
def rc(tmp_path: Path) -> RunConfig:
    return RunConfig(arm="patched", lmcache_dir=tmp_path / "lmc", out=tmp_path, work=tmp_path / "w")


def test_a_plain_case_stores_then_restores_and_passes(rc: RunConfig, monkeypatch) -> None:
    case = Case("olmo-r5", "NHD", 1, False)
    fakes = Fakes(monkeypatch, case, case.promisable_hit)
    rec = run.run_case(case, rc, run.ColdRuns())
    assert rec["eval"]["pass"], rec["eval"]
    assert list(fakes.specs) == ["cold", "store", "restore"]
    assert [args for _, args in fakes.servers] == [(), ()]
    assert "l2_snapshot" not in rec["engines"]["store"]


def test_a_seed_case_starts_both_servers_with_separate_object_groups(
    rc: RunConfig, monkeypatch
) -> None:
    (case,) = select_cases("qwen35-r25-NHD-c1N-offset-sog")
    fakes = Fakes(monkeypatch, case, case.promisable_hit)
    run.run_case(case, rc, run.ColdRuns())
    assert [args for _, args in fakes.servers] == [("--separate-object-groups",)] * 2


def test_a_forged_case_rewrites_one_object_of_the_prompt_before_the_restore(
    rc: RunConfig, monkeypatch
) -> None:
    (case,) = select_cases("qwen35-r5-NHD-c2N-offset-forged")
    fakes = Fakes(monkeypatch, case, case.chunk * 13)  # a miss from the forged chunk on
    rec = run.run_case(case, rc, run.ColdRuns())
    forged = rec["forged_object"]
    count = case.prompt_tokens // case.chunk
    assert (forged["rank"], forged["of"]) == (count // 2, count)
    assert forged["payload_from"] == "m~hfa-ab@0x01000000@1@ffff.data"
    assert rec["eval"]["mode"] == "forged" and rec["eval"]["pass"], rec["eval"]
    assert "l2_snapshot" not in rec["engines"]["store"]  # kept in the case folder only
    assert fakes.specs["store"]["l2_snapshot"]["min_objects"] == count


def test_a_forged_case_restarts_once_more_and_restores_again(rc: RunConfig, monkeypatch) -> None:
    (case,) = select_cases("qwen35-r5-NHD-c2N-offset-forged")
    fakes = Fakes(monkeypatch, case, case.chunk * 13)
    rec = run.run_case(case, rc, run.ColdRuns())
    assert list(fakes.specs) == ["cold", "store", "restore", "restart"]
    assert len(fakes.servers) == 3 and "server3" in rec
    assert fakes.specs["restart"]["prompt"] == fakes.specs["store"]["prompt"]
    assert "timed_pairs" not in fakes.specs["restart"]
    # the first restore keeps its KV until what it recomputed is stored
    assert fakes.specs["restore"]["l2"] == str(rc.work / "patched" / case.case_id / "l2")
    assert rec["forged_after_restore"] == {"kept": True}  # nothing rewrote the forged file
    assert rec["eval"]["restart"]["forged_kept"] and rec["eval"]["pass"], rec["eval"]
    assert "restart" in rec["engines"]


def test_a_forged_case_whose_store_listed_nothing_is_an_error(rc: RunConfig, monkeypatch) -> None:
    (case,) = select_cases("qwen35-r5-NHD-c2N-offset-forged")
    fakes = Fakes(monkeypatch, case, 0)
    fakes_run = fakes.run_engine

    def no_snapshot(py, env, spec, wd, role, timeout):
        out = fakes_run(
            py, env, {k: v for k, v in spec.items() if k != "l2_snapshot"}, wd, role, timeout
        )
        return out

    monkeypatch.setattr(run, "run_engine", no_snapshot)
    rec = run.run_case(case, rc, run.ColdRuns())
    assert not rec["eval"]["pass"] and "could not be forged" in rec["eval"]["errors"][-1]


def test_a_lora_case_writes_both_adapters_and_hands_them_to_every_engine(
    rc: RunConfig, monkeypatch
) -> None:
    (case,) = select_cases("qwen35-r5-NHD-c1N-offset-lora-other")
    fakes = Fakes(monkeypatch, case, case.promisable_hit)
    rec = run.run_case(case, rc, run.ColdRuns())
    for role in ("cold", "store", "restore"):
        adapters = fakes.specs[role]["lora"]["adapters"]
        assert set(adapters) == {"A", "B"}
        assert all((Path(p) / "adapter_model.safetensors").is_file() for p in adapters.values())
    assert rec["lora"] == "other" and rec["eval"]["lora_b"]["c"], rec["eval"]
    assert rec["eval"]["pass"], rec["eval"]


def test_a_dtype_change_case_records_both_dtypes(rc: RunConfig, monkeypatch) -> None:
    (case,) = select_cases("qwen35-r5-NHD-c1N-offset-fp8e4m3-to-fp8e5m2")
    fakes = Fakes(monkeypatch, case, 0)
    rec = run.run_case(case, rc, run.ColdRuns())
    assert rec["kv_cache_dtype"] == "fp8_e4m3 -> fp8_e5m2"
    assert fakes.specs["store"]["kv_cache_dtype"] == "fp8_e4m3"
    assert fakes.specs["restore"]["kv_cache_dtype"] == "fp8_e5m2"
    assert rec["eval"]["pass"] and rec["eval"]["mode"] == "miss", rec["eval"]


def test_a_graphs_case_reports_the_cuda_graph_mode_each_engine_ran(
    rc: RunConfig, monkeypatch
) -> None:
    (case,) = select_cases("olmo-r5-NHD-c1N-offset-graphs")
    Fakes(monkeypatch, case, case.promisable_hit)
    rec = run.run_case(case, rc, run.ColdRuns())
    assert rec["eval"]["pass"], rec["eval"]
    assert rec["enforce_eager"] is False
    assert rec["cudagraph_mode"] == dict.fromkeys(
        ("cold", "store", "restore"), "FULL_AND_PIECEWISE"
    )
    assert report.table_row("patched", rec)[7] == "FULL_AND_PIECEWISE"
