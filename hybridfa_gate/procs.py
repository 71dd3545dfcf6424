"""Processes of a gate run: LMCache servers and vLLM engines, each in its own process group,
their environment, their logs, and their cleanup.

An engine is ``python -m hybridfa_gate.engine_proc SPEC OUT`` (one engine per process, so a
restore reads what another process stored). Every child runs in its work folder: the checkout
root is never its first import path, so a materialized ``lmcache/`` there never shadows the
build under test, which goes first on PYTHONPATH (or, installed with pip into a site folder,
is found there).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import site
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridfa_gate import l2 as l2_tiers
from hybridfa_gate.l2 import STORE_FAILED

# The folder holding the hybridfa_gate package: on every child's PYTHONPATH, after the rest.
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
ENGINE_MODULE = "hybridfa_gate.engine_proc"
# Seconds an engine may take, start to exit, unless a run says otherwise (--engine-timeout).
ENGINE_TIMEOUT_S = 420.0
SERVER_BOOT = (
    "import sys; from lmcache.cli.main import main; sys.argv[0] = 'lmcache'; sys.exit(main())"
)
# The patched server's registration errors: a hybrid layout on a server with an unverified
# persistent L2 tier (worded "publishes" before revision 16), or on a CUDA server without
# LMCache's compiled copy kernels.
REFUSAL = re.compile(
    r"(?:loads|publishes) objects without an integrity check"
    r"|its copies would run on LMCache's Python fallback"
)
# An L2 adapter found an object that failed its check (short, damaged, forged, written
# under another tier secret): a miss.
L2_DISCARD = re.compile(
    r"is not an (?:authentic|intact) \d+-byte object|Incomplete (?:O_DIRECT )?read for"
)

free_port = l2_tiers.free_port


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _found_in_site(lmcache_dir: Path, pythonpath: Sequence[str]) -> bool:
    """Whether a child finds ``lmcache_dir``'s lmcache without it on PYTHONPATH: it is one of
    this interpreter's site folders (a wheel installed with pip) and no PYTHONPATH folder holds
    another lmcache. Put first, a site folder would shadow what PYTHONPATH brings in place of
    its packages (a newer torch and vLLM staged beside the image's)."""
    sites = {Path(p).resolve() for p in (*site.getsitepackages(), site.getusersitepackages())}
    if lmcache_dir not in sites:
        return False
    return not any((Path(p) / "lmcache").is_dir() for p in pythonpath)


def compile_cache_env(folder: Path) -> dict[str, str]:
    """One folder for every compiled artifact an engine keeps, so that it can be carried to
    another machine of the same GPU model and software: vLLM's cache (its torch.compile cache
    keeps inductor's and Triton's files under it), inductor and Triton outside vLLM's compiled
    graph (the GDN kernels, their autotuning), FlashInfer's JIT."""
    folder = Path(folder).resolve()
    return {
        "VLLM_CACHE_ROOT": str(folder / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"),
        "TRITON_CACHE_DIR": str(folder / "triton"),
        "FLASHINFER_WORKSPACE_BASE": str(folder / "flashinfer"),
    }


def child_env(lmcache_dir: Path | None, layout: str | None) -> dict[str, str]:
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if lmcache_dir is not None and not _found_in_site(Path(lmcache_dir).resolve(), parts):
        d = str(Path(lmcache_dir).resolve())
        parts = [d] + [p for p in parts if Path(p).resolve() != Path(d)]
    if not any(Path(p).resolve() == PACKAGE_ROOT for p in parts):
        parts.append(str(PACKAGE_ROOT))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["PYTHONUNBUFFERED"] = "1"
    # In-process engine core: collective_rpc reaches the worker without msgpack and the
    # worker-side hooks see the same objects; callables are still allowed for TP > 1.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    # No VLLM_USE_V2_MODEL_RUNNER: the engines run the model runner vLLM picks, as users'
    # do (V1 for hybrid models on vLLM 0.26-0.28, V2 from 0.29; 0.34 has V2 only and refuses
    # the variable set to 0); the worker-side hooks read either, and each engine's result
    # names it ("model_runner").
    # Every Qwen3.5 engine re-ran Triton's autotuning of the GDN kernels (its cases took
    # 340 s against 135-195 s for OlmoHybrid's, 2026-11-29): keep the results on disk.
    env.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    if layout is not None:
        env["VLLM_KV_CACHE_LAYOUT"] = layout
    return env


# Process groups we started and have not reaped: killed on SIGTERM or SIGINT, since
# start_new_session keeps them out of our own group.
LIVE_GROUPS: set[int] = set()


def spawn(
    cmd: list[str], log: Any, env: dict[str, str], cwd: Path | None = None
) -> subprocess.Popen[Any]:
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
    )
    LIVE_GROUPS.add(proc.pid)
    return proc


def install_cleanup_handler() -> None:
    """On SIGTERM/SIGINT kill every engine and server group still running, then exit 124."""

    def handler(signum: int, _frame: Any) -> None:
        for pgid in list(LIVE_GROUPS):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        os._exit(124)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL the process group we created with start_new_session=True (pgid == pid), also
    after the leader exited on its own: children it left (TP workers, a server's helpers)
    are still in that group. Call right after the wait, never later."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    LIVE_GROUPS.discard(proc.pid)


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


class ServerError(RuntimeError):
    pass


def extra_server_args() -> list[str]:
    """More `lmcache server` options for every server, from $HYBRIDFA_SERVER_ARGS
    (e.g. a build's opt-in feature); recorded in each report's environment."""
    return shlex.split(os.environ.get("HYBRIDFA_SERVER_ARGS", ""))


def server_args(port: int, chunk: int, adapter: dict[str, Any], l1_size_gb: float = 4) -> list[str]:
    """`lmcache server` options of a gate server (the same for lmcache 0.5.3 and 0.5.6)."""
    args = ["--chunk-size", str(chunk), "--l1-size-gb", f"{l1_size_gb:g}"]
    args += ["--eviction-policy", "LRU", "--port", str(port)]
    return [*args, "--http-port", str(free_port()), "--l2-adapter", json.dumps(adapter)]


def start_server(
    py: str,
    env: dict[str, str],
    port: int,
    chunk: int,
    l2: Path | dict[str, Any],
    log: Path,
    timeout: float = 180.0,
    l1_size_gb: float = 4,
    extra_args: Sequence[str] = (),
) -> subprocess.Popen[Any]:
    """Start an LMCache server and wait until it serves `port`. Its HTTP port is picked free
    just before the start; a concurrent case may bind it first, and the server then shuts down
    after it announced itself: such a start is tried again with another HTTP port."""
    adapter = l2_tiers.adapter_json("fs", l2) if isinstance(l2, Path) else l2
    for attempt in (1, 2, 3):
        cmd = [py, "-c", SERVER_BOOT, "server", *server_args(port, chunk, adapter, l1_size_gb)]
        cmd += [*extra_args, *extra_server_args()]
        with open(log, "w") as fh:
            proc = spawn(cmd, fh, env, cwd=log.parent)
        try:
            return _wait_ready(proc, port, log, timeout)
        except ServerError:
            if attempt == 3 or not lost_http_port(log):
                raise
            log.rename(log.with_suffix(f".port-race{attempt}.log"))
    raise AssertionError("unreachable")


def _wait_ready(
    proc: subprocess.Popen[Any], port: int, log: Path, timeout: float
) -> subprocess.Popen[Any]:
    ready = re.compile(r"running|started|listening|ready", re.I)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None or lost_http_port(log):
            kill_group(proc)
            raise ServerError(f"LMCache server exited rc={proc.returncode}:\n{tail(log)}")
        if port_open(port) and ready.search(log.read_text(errors="replace")):
            time.sleep(1.0)
            if proc.poll() is None and not lost_http_port(log):
                return proc
            continue
        time.sleep(0.5)
    kill_group(proc)
    raise ServerError(f"LMCache server not ready after {timeout:.0f}s:\n{tail(log)}")


def lost_http_port(log: Path) -> bool:
    """A server whose HTTP port was bound by another process between our pick and its bind."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return "error while attempting to bind" in text and "address already in use" in text


def lost_port_race(log: Path) -> bool:
    """A TP engine whose rendezvous port was taken between vLLM's probe and its bind (by a
    concurrent case): it failed before serving anything, so starting it again is safe."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return "EADDRINUSE" in text and "WorkerProc failed to start" in text


def engine_command(py: str, spec_path: Path, out_path: Path) -> list[str]:
    return [py, "-m", ENGINE_MODULE, str(spec_path), str(out_path)]


def run_engine(
    py: str, env: dict[str, str], spec: dict[str, Any], workdir: Path, role: str, timeout: float
) -> dict[str, Any]:
    spec_path, out_path = workdir / f"{role}.spec.json", workdir / f"{role}.json"
    log = workdir / f"{role}.log"
    spec_path.write_text(json.dumps(spec))
    t0 = time.monotonic()
    for attempt in (1, 2):
        out_path.unlink(missing_ok=True)
        with open(log, "w") as fh:
            proc = spawn(engine_command(py, spec_path, out_path), fh, env, cwd=workdir)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout)
            kill_group(proc)  # a hung engine, or the leftovers (TP workers) of one that exited
        res: dict[str, Any] = {"ok": False}
        with contextlib.suppress(OSError, ValueError):
            res = json.loads(out_path.read_text())
        if res.get("ok") or attempt == 2 or not lost_port_race(log):
            break
        log.rename(workdir / f"{role}.port-race.log")
    if not res.get("ok"):
        res.setdefault("error", f"rc={proc.returncode}; log tail:\n{tail(log)}")
    res.update(attempts=attempt, process_s=round(time.monotonic() - t0, 2), rc=proc.returncode)
    res["log_facts"] = engine_log_facts(log.read_text(errors="replace") if log.exists() else "")
    # A case or a run takes minutes, its report comes at its end: say where it is.
    state = "ok" if res.get("ok") else "failed"
    print(f"{workdir.name}: {role} engine {state} after {res['process_s']} s", flush=True)
    return res


_LOG_FACTS = {
    "attention_block_size": re.compile(r"Setting attention block size to (\d+)"),
    "group_edits": re.compile(r"KV cache group edits applied: (.*)"),
    "lmcache_retrieved": re.compile(r"Retrieved (\d+) tokens"),
    "lmcache_compressed_group": re.compile(r"(compressed \(tokens_per_block=.*)"),
}


def engine_log_facts(text: str) -> dict[str, Any]:
    facts = {key: found[-1] for key, rx in _LOG_FACTS.items() if (found := rx.findall(text))}
    return {**facts, "tracebacks": text.count("Traceback (most recent call last)")}


def server_log_facts(text: str) -> dict[str, Any]:
    pre = re.findall(r"Prefetch request completed[^\n]*", text)
    return {
        "prefetch": pre[-1] if pre else None,
        "errors": len(re.findall(r"\bERROR\b|Traceback", text)),
        "store_failures": text.count(STORE_FAILED),
        "refusals": len(REFUSAL.findall(text)),
        "l2_discards": len(L2_DISCARD.findall(text)),
    }
