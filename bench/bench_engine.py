"""One engine of the restore bench in a fresh process: ``python -m bench.bench_engine SPEC OUT``.

It is engine_proc's engine (``hybridfa_gate.engine_proc``: the spec's keys, the weights, the
block-table hook, the timed request, the restore timeline) with the bench's own sequence. Every
role reads back how the engine runs (``engine_mode``: torch.compile and CUDA graphs or eager)
and starts no timed unit (a prompt, a round) that would end past the spec's ``deadline``.

- ``warmup``: a prefill of each of ``warm_prompts`` (JIT, autotuning, compile caches).
- ``cold``: the baseline, no connector: a warm-up prefill, then each of ``cold_prompts``.
- ``store``: each of ``stored`` prompts, its tokens and KV hashes, then the L2 files it wrote
  once the folder is quiet (the OffloadingConnector's stores move only while the engine steps).
- ``restore``: a warm-up (a short cold, a restore of ``stored[0]``), then ``rounds`` rounds of
  ``kinds`` in turn: ``cold`` (a fresh prompt with the connector storing, its connector calls
  timed; once the folder is quiet its files are removed: only what the arm restores stays on
  disk), ``disk`` and ``pagecache`` (restores of ``stored[round % len(stored)]``), ``fixed``
  (the same prompt again, its hit in vLLM's own prefix cache: what the engine spends when no
  byte has to be read, the floor's fixed cost). Before each restore: vLLM's prefix cache reset
  (with the OffloadingConnector's CPU tier), the LMCache server's L1 cleared, the folder quiet,
  for ``disk`` every file dropped from the page cache; then the residency of each of the
  prompt's files (mincore) and ``io_pid``'s read_bytes; after it, read_bytes again and the KV
  hashes.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

from bench import floor, miss_path
from hybridfa_gate import engine_proc as ep
from hybridfa_gate.prompts import prompt_key
from hybridfa_gate.worker import rpc_install_block_hook, rpc_kv_hashes

DEADLINE_MARGIN_S = 10.0


def _kv(llm: Any, tokens: list[int]) -> Any:
    return llm.collective_rpc(rpc_kv_hashes, args=(prompt_key(tokens), len(tokens)))


def _step_until_idle(llm: Any, seconds: float = 600.0) -> bool:
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    until = time.monotonic() + seconds
    while sched.has_requests() and time.monotonic() < until:
        llm.llm_engine.step()
    return not sched.has_requests()


def engine_mode(llm: Any) -> dict[str, Any]:
    """How the engine runs, read back from its resolved config (vLLM may override what was
    asked: enforce_eager turns compilation and CUDA graphs off, a connector may lower the
    CUDA-graph mode)."""
    vc = llm.llm_engine.vllm_config
    cc = vc.compilation_config
    return {
        "enforce_eager": bool(vc.model_config.enforce_eager),
        "compilation_mode": getattr(cc.mode, "name", str(cc.mode)),
        "cudagraph_mode": getattr(cc.cudagraph_mode, "name", str(cc.cudagraph_mode)),
        "max_cudagraph_capture_size": getattr(cc, "max_cudagraph_capture_size", None),
        "max_model_len": vc.model_config.max_model_len,
    }


def mode_of(read: dict[str, Any] | None) -> str:
    """``graphs`` (compiled, CUDA graphs), ``eager`` (neither) or ``mixed``, of ``engine_mode``."""
    read = read or {}
    compiled = read.get("compilation_mode") not in (None, "NONE")
    graphs = read.get("cudagraph_mode") not in (None, "NONE")
    if not read.get("enforce_eager") and compiled and graphs:
        return "graphs"
    if read.get("enforce_eager") and not compiled and not graphs:
        return "eager"
    return "mixed"


class Budget:
    """Starts a unit only when the longest one so far still ends before ``deadline``."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline, self.longest, self.cut = deadline, 0.0, 0

    def fits(self) -> bool:
        if self.deadline is None or time.time() + 1.2 * self.longest < self.deadline:
            return True
        self.cut += 1
        return False

    def took(self, t0: float) -> None:
        self.longest = max(self.longest, time.time() - t0)


class Session:
    """The engine and the L2 folder it stores to."""

    def __init__(self, spec: dict[str, Any], result: dict[str, Any]) -> None:
        self.spec, self.result = spec, result
        self.llm = ep.start_engine(spec, result)
        result["engine_mode"] = engine_mode(self.llm)
        self.llm.collective_rpc(rpc_install_block_hook)
        ep.TAP = ep.PrefillTap(self.llm.llm_engine.engine_core)
        self.greedy = ep.sampling(int(spec["new_tokens"]))
        self.tier = Path(spec["tier"]) if spec.get("tier") else None
        self.suffix = spec.get("suffix", ".data")
        self.offload = spec.get("connector") == "offloading"
        self.keep: set[str] = set()  # the stored prompts' files
        self.lookups: list[dict[str, Any]] = []
        self.calls = miss_path.CallTimer()
        deadline = spec.get("deadline")
        self.budget = Budget(None if deadline is None else deadline - DEADLINE_MARGIN_S)
        ep.generate(self.llm, spec["warmup"], ep.sampling(2))

    def timed(self, tokens: list[int], steps: list | None = None) -> dict[str, Any]:
        return ep.generate_timed(self.llm, tokens, self.greedy, steps)[1]

    def cold(self, tokens: list[int]) -> dict[str, Any]:
        """A timed cold prefill: its steps and, with a connector, its connector calls."""
        steps: list[dict[str, float]] = []
        self.calls.take()
        got = self.timed(tokens, steps)
        got["steps_s"] = miss_path.prefill_steps(steps, got["ttft_s"])
        if self.calls.totals:
            got["connector"] = self.calls.take()
        return {"kind": "cold", **got}

    def quiet(self, min_files: int = 0, quiet_s: float = 2.0) -> dict[str, Any]:
        if self.offload:
            _step_until_idle(self.llm)
        if self.tier is None:
            return {"quiet": True, "files": {}}
        nbytes = float(self.spec.get("prompt_bytes", 0))
        return floor.wait_quiet(self.tier, self.suffix, min_files, quiet_s, 60 + 4 * nbytes / 1e9)

    def chunks(self, tokens: list[int]) -> int:
        return (len(tokens) - 1) // int(self.spec["block_tokens"])

    def settle_cold(self, tokens: list[int], start_epoch: float | None = None) -> dict[str, Any]:
        """After a cold: its stores done (at least a file per chunk before the last token),
        when its files were written, its files removed."""
        q = self.quiet(len(self.keep) + self.chunks(tokens))
        extra = {f: v for f, v in q["files"].items() if f not in self.keep}
        for f in extra:
            Path(f).unlink(missing_ok=True)
        out = {"quiet": q["quiet"], "waited_s": q.get("waited_s"), "removed_files": len(extra)}
        return {**out, "writes": miss_path.write_window(extra, start_epoch)}

    def clear(self) -> dict[str, Any]:
        """vLLM's prefix cache reset and the connector's CPU copies cleared: the
        OffloadingConnector's CPU tier with the reset, the LMCache server's L1 over HTTP."""
        ev: dict[str, Any] = {}
        if self.offload:  # its reset_cache asserts that no transfer job is in flight
            _step_until_idle(self.llm)
        ev["prefix_reset"] = bool(self.llm.reset_prefix_cache(reset_connector=self.offload))
        if self.offload:
            ev["l1_cleared"] = ev["prefix_reset"]
        elif url := self.spec.get("clear_url"):
            try:
                req = urllib.request.Request(url, data=b"", method="POST")
                with urllib.request.urlopen(req, timeout=30) as r:
                    ev["l1_cleared"] = r.status == 200
            except OSError as e:
                ev["l1_cleared"], ev["l1_clear_error"] = False, f"{type(e).__name__}: {e}"
        else:
            ev["l1_cleared"] = None
        return ev

    def restore(self, index: int, kind: str) -> dict[str, Any]:
        tokens = self.spec["stored"][index]
        ev: dict[str, Any] = {"kind": kind, **self.clear()}
        q = self.quiet()
        if kind == "disk":
            floor.drop_cache([Path(f) for f in q["files"]])
        ev["l2_quiet"] = q["quiet"]
        ev["hit_files"] = floor.residency(Path(f) for f in self.spec["stored_files"][index])
        pid = self.spec.get("io_pid") or "self"
        steps: list[dict[str, float]] = []
        self.lookups.clear()
        io0, t0 = floor.read_bytes(pid), time.perf_counter()
        got = self.timed(tokens, steps)
        io1 = floor.read_bytes(pid)
        ev["io_read_bytes"] = io1 - io0 if io0 is not None and io1 is not None else None
        ev["timeline"] = ep.restore_timeline(t0, got["ttft_s"], self.lookups, steps)
        ev["kv_hashes"] = _kv(self.llm, tokens)
        ev["tokens"] = got.pop("tokens", None)
        return {**got, **ev}


def span(got: dict[str, Any]) -> dict[str, Any]:
    """The request's wall-clock span (epochs) in place of its probes."""
    probe = got.pop("probe", None) or [{}, {}]
    return {**got, "span": [probe[0].get("epoch"), probe[1].get("epoch")]}


def run_store(s: Session, spec: dict[str, Any], result: dict[str, Any]) -> None:
    """Each stored prompt, its tokens, KV hashes and the files it wrote."""
    result["stored"] = []
    for tokens in spec["stored"]:
        if not s.budget.fits():
            break
        t0 = time.time()
        out, got = ep.generate_timed(s.llm, tokens, s.greedy)
        got.update(tokens=list(out.outputs[0].token_ids), kv_hashes=_kv(s.llm, tokens))
        q = s.quiet(len(s.keep) + s.chunks(tokens), quiet_s=3.0)
        got["files"] = {f: size for f, (size, _) in q["files"].items() if f not in s.keep}
        got["quiet"] = q["quiet"]
        s.keep |= set(q["files"])
        result["stored"].append(span(got))
        s.budget.took(t0)
    q = s.quiet(len(s.keep), quiet_s=3.0)
    result["l2"] = {"quiet": q["quiet"], "files": len(q["files"]), "waited_s": q["waited_s"]}
    result["l2"]["bytes"] = sum(size for size, _ in q["files"].values())


def run_restore(s: Session, spec: dict[str, Any], result: dict[str, Any]) -> None:
    """The warm-up, then rounds of ``kinds`` while the budget lasts."""
    s.keep = set(s.quiet()["files"])
    if hook := ep.time_lookups(s.llm, s.lookups):
        result["lookups_timed"] = hook
    sched = ep.scheduler_connector(s.llm)
    result["timed_methods"] = s.calls.wrap(sched, "scheduler", miss_path.SCHEDULER_METHODS)
    worker = miss_path.worker_connector()
    result["timed_methods"] += s.calls.wrap(worker, "worker", miss_path.WORKER_METHODS)
    s.timed(spec["warm_prompts"][0])
    s.settle_cold(spec["warm_prompts"][0])
    result["warm_restore"] = span(s.restore(0, "warm"))
    result["requests"] = []
    colds = iter(spec["cold_prompts"])
    for i in range(int(spec["rounds"])):
        if not s.budget.fits():
            break
        t0, k = time.time(), i % len(spec["stored"])
        for kind in spec["kinds"]:
            if kind == "cold":
                tokens = next(colds)
                got = span({"round": i, **s.cold(tokens)})
                got["settle"] = s.settle_cold(tokens, got["span"][0])
            elif kind == "fixed":
                got = {"kind": "fixed", "round": i, "stored_index": k}
                got = span({**got, **s.timed(spec["stored"][k])})
            else:
                got = span({"round": i, "stored_index": k, **s.restore(k, kind)})
            result["requests"].append(got)
        s.budget.took(t0)


def run(spec: dict[str, Any], result: dict[str, Any]) -> Any:
    s = Session(spec, result)
    role = spec["role"]
    if role == "warmup":
        result["warm"] = []
        for tokens in spec["warm_prompts"]:
            if s.budget.fits():
                t0 = time.time()
                result["warm"].append(s.timed(tokens))
                s.budget.took(t0)
    elif role == "cold":
        s.timed(spec["warm_prompts"][0])
        result["requests"] = []
        for tokens in spec["cold_prompts"]:
            if s.budget.fits():
                t0 = time.time()
                result["requests"].append(span(s.cold(tokens)))
                s.budget.took(t0)
    elif role == "store":
        run_store(s, spec, result)
    elif role == "restore":
        run_restore(s, spec, result)
    else:
        raise ValueError(f"unknown bench role {role!r}")
    result["cut_by_deadline"] = s.budget.cut
    return s.llm


def main() -> None:
    spec_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    result: dict[str, Any] = {"role": spec["role"], "ok": False}
    try:
        llm = run(spec, result)
        result["ok"] = True
        out_path.write_text(json.dumps(result))
        threading.Timer(30.0, os._exit, args=(0,)).start()  # a hung teardown
        del llm
    except BaseException:  # noqa: BLE001 - the bench reads the traceback from OUT
        result.update(ok=False, error=traceback.format_exc()[-6000:])
        out_path.write_text(json.dumps(result))
        print(result["error"], file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
