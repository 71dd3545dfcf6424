"""One engine of the restore bench in a fresh process: ``python -m bench.bench_engine SPEC OUT``.

It is engine_proc's engine (``hybridfa_gate.engine_proc``: the spec's keys, the weights, the
block-table hook, the timed request, the restore timeline) with the bench's own sequence:

- ``warmup``: a prefill of each of ``warm_lengths`` (JIT, autotuning, compile caches).
- ``cold``: ``rounds`` timed cold prefills (no connector).
- ``store``: each of ``stored`` prompts, its tokens and KV hashes; then until the L2 folder is
  quiet (the OffloadingConnector's stores move only while the engine steps).
- ``restore``: a warm-up (a short cold, a restore of ``stored[0]``), then ``rounds`` rounds of
  ``kinds`` in turn: ``cold`` (a fresh prompt, whose stored files are removed once the folder is
  quiet: only what the arm restores stays on disk), ``disk`` and ``pagecache`` (restores of
  ``stored[round % len(stored)]``). Before each restore: vLLM's prefix cache reset (with the
  OffloadingConnector's CPU tier), the LMCache server's L1 cleared, the folder quiet, for
  ``disk`` the files dropped from the page cache; then the files' residency (mincore) and
  ``io_pid``'s read_bytes; after it, read_bytes again and the KV hashes.
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

from bench import floor
from hybridfa_gate import engine_proc as ep
from hybridfa_gate.prompts import prompt_key
from hybridfa_gate.worker import rpc_install_block_hook, rpc_kv_hashes


def _kv(llm: Any, tokens: list[int]) -> Any:
    return llm.collective_rpc(rpc_kv_hashes, args=(prompt_key(tokens), len(tokens)))


def _step_until_idle(llm: Any, seconds: float = 600.0) -> bool:
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    until = time.monotonic() + seconds
    while sched.has_requests() and time.monotonic() < until:
        llm.llm_engine.step()
    return not sched.has_requests()


class Session:
    """The engine and the L2 folder it stores to."""

    def __init__(self, spec: dict[str, Any], result: dict[str, Any]) -> None:
        self.spec, self.result = spec, result
        self.llm = ep._start(spec, result)
        self.llm.collective_rpc(rpc_install_block_hook)
        ep.TAP = ep.PrefillTap(self.llm.llm_engine.engine_core)
        self.greedy = ep._sampling(int(spec["new_tokens"]))
        self.tier = Path(spec["tier"]) if spec.get("tier") else None
        self.suffix = spec.get("suffix", ".data")
        self.offload = spec.get("connector") == "offloading"
        self.keep: set[str] = set()  # the stored prompts' files
        self.lookups: list[dict[str, Any]] = []
        ep._generate(self.llm, spec["warmup"], ep._sampling(2))

    def timed(self, tokens: list[int], steps: list | None = None) -> dict[str, Any]:
        return ep._generate_timed(self.llm, tokens, self.greedy, steps)[1]

    def quiet(self, min_files: int = 0, quiet_s: float = 2.0) -> dict[str, Any]:
        if self.offload:
            _step_until_idle(self.llm)
        if self.tier is None:
            return {"quiet": True, "files": {}}
        nbytes = float(self.spec.get("prompt_bytes", 0))
        return floor.wait_quiet(self.tier, self.suffix, min_files, quiet_s, 60 + 4 * nbytes / 1e9)

    def settle_cold(self, tokens: list[int]) -> dict[str, Any]:
        """After a cold: its stores done (at least a file per chunk before the last token),
        its files removed."""
        chunks = (len(tokens) - 1) // int(self.spec["block_tokens"])
        q = self.quiet(len(self.keep) + chunks)
        extra = [f for f in q["files"] if f not in self.keep]
        for f in extra:
            Path(f).unlink(missing_ok=True)
        return {"quiet": q["quiet"], "waited_s": q.get("waited_s"), "removed_files": len(extra)}

    def restore(self, tokens: list[int], kind: str) -> dict[str, Any]:
        ev: dict[str, Any] = {"kind": kind}
        if self.offload:  # its reset_cache asserts that no transfer job is in flight
            _step_until_idle(self.llm)
        ev["prefix_reset"] = bool(self.llm.reset_prefix_cache(reset_connector=self.offload))
        if url := self.spec.get("clear_url"):
            try:
                req = urllib.request.Request(url, data=b"", method="POST")
                with urllib.request.urlopen(req, timeout=30) as r:
                    ev["l1_cleared"] = r.status == 200
            except OSError as e:
                ev["l1_cleared"], ev["l1_clear_error"] = False, f"{type(e).__name__}: {e}"
        q = self.quiet()
        files = [Path(f) for f in q["files"]]
        if kind == "disk":
            floor.drop_cache(files)
        ev.update(l2_quiet=q["quiet"], **floor.residency(files))
        pid = self.spec.get("io_pid") or "self"
        steps: list[dict[str, float]] = []
        self.lookups.clear()
        io0, t0 = floor.read_bytes(pid), time.perf_counter()
        got = self.timed(tokens, steps)
        io1 = floor.read_bytes(pid)
        ev["io_read_bytes"] = io1 - io0 if io0 is not None and io1 is not None else None
        ev["timeline"] = ep.restore_timeline(t0, got["ttft_s"], self.lookups, steps)
        ev["fixed_s"] = floor.fixed_cost(ev["timeline"])
        ev["kv_hashes"] = _kv(self.llm, tokens)
        ev["tokens"] = got.pop("tokens", None)
        return {**got, **ev}


def span(got: dict[str, Any]) -> dict[str, Any]:
    """The request's wall-clock span (epochs) in place of its probes."""
    probe = got.pop("probe", None) or [{}, {}]
    return {**got, "span": [probe[0].get("epoch"), probe[1].get("epoch")]}


def run(spec: dict[str, Any], result: dict[str, Any]) -> Any:
    s = Session(spec, result)
    role = spec["role"]
    if role == "warmup":
        result["warm"] = [s.timed(t) for t in spec["warm_prompts"]]
    elif role == "cold":
        s.timed(spec["warm_prompts"][0])
        result["requests"] = [span({"kind": "cold", **s.timed(t)}) for t in spec["cold_prompts"]]
    elif role == "store":
        result["stored"] = []
        for tokens in spec["stored"]:
            out, got = ep._generate_timed(s.llm, tokens, s.greedy)
            got.update(tokens=list(out.outputs[0].token_ids), kv_hashes=_kv(s.llm, tokens))
            result["stored"].append(got)
        chunks = sum((len(t) - 1) // int(spec["block_tokens"]) for t in spec["stored"])
        q = s.quiet(chunks, quiet_s=3.0)
        result["l2"] = {"quiet": q["quiet"], "files": len(q["files"]), "waited_s": q["waited_s"]}
        result["l2"]["bytes"] = sum(size for size, _ in q["files"].values())
    elif role == "restore":
        s.keep = set(s.quiet()["files"])
        if hook := ep._time_lookups(s.llm, s.lookups):
            result["lookups_timed"] = hook
        s.timed(spec["warm_prompts"][0])
        s.settle_cold(spec["warm_prompts"][0])
        result["warm_restore"] = span(s.restore(spec["stored"][0], "warm"))
        result["requests"] = []
        colds = iter(spec["cold_prompts"])
        for i in range(int(spec["rounds"])):
            k = i % len(spec["stored"])
            for kind in spec["kinds"]:
                if kind == "cold":
                    tokens = next(colds)
                    got = {"kind": "cold", "round": i, **s.timed(tokens)}
                    got["settle"] = s.settle_cold(tokens)
                else:
                    got = {"round": i, "stored_index": k, **s.restore(spec["stored"][k], kind)}
                result["requests"].append(span(got))
    else:
        raise ValueError(f"unknown bench role {role!r}")
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
