"""The gate's processes (hybridfa_gate.procs): environment, engines, servers' logs, L2 waits,
cleanup."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridfa_gate import l2 as l2_tiers
from hybridfa_gate import procs
from hybridfa_gate.options import add_run_args, use_compile_cache

REPO = Path(__file__).resolve().parents[2]


def test_engine_log_facts() -> None:
    text = (
        "Setting attention block size to 80 tokens\n"
        "KV cache group edits applied: {'mamba-page-view': 6}\nRetrieved 6000 tokens\n"
    )
    facts = procs.engine_log_facts(text)
    assert facts["attention_block_size"] == "80"
    assert facts["group_edits"] == "{'mamba-page-view': 6}"
    assert facts["lmcache_retrieved"] == "6000" and facts["tracebacks"] == 0


def test_child_env_puts_lmcache_first_and_the_gate_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", f"/tmp/site:{tmp_path}")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    env = procs.child_env(tmp_path, "HND")
    assert env["PYTHONPATH"].split(":") == [str(tmp_path.resolve()), "/tmp/site", str(REPO)]
    assert env["VLLM_KV_CACHE_LAYOUT"] == "HND"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in env  # the model runner vLLM picks
    assert env["TRITON_CACHE_AUTOTUNING"] == "1"


def test_an_installed_lmcache_leaves_pythonpath_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lmcache installed into a site folder is found there: put first, that folder would
    shadow a torch and vLLM that PYTHONPATH brings in place of the site folder's own."""
    sitedir = tmp_path / "site-packages"
    (sitedir / "lmcache").mkdir(parents=True)
    monkeypatch.setattr(procs.site, "getsitepackages", lambda: [str(sitedir)])
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    assert procs.child_env(sitedir, None)["PYTHONPATH"].split(":") == ["/tmp/site", str(REPO)]
    staged = tmp_path / "staged"
    (staged / "lmcache").mkdir(parents=True)
    monkeypatch.setenv("PYTHONPATH", str(staged))
    assert procs.child_env(sitedir, None)["PYTHONPATH"].split(":")[:2] == [
        str(sitedir.resolve()),
        str(staged),
    ]


def test_a_child_imports_the_build_under_test_not_the_checkouts_tree(tmp_path: Path) -> None:
    """A materialized lmcache/ in the checkout root never shadows ``lmcache_dir``: children run
    in their work folder, with the checkout last on PYTHONPATH."""
    build = tmp_path / "build"
    (build / "lmcache").mkdir(parents=True)
    (build / "lmcache" / "__init__.py").write_text("")
    env = procs.child_env(build, None)
    code = "import lmcache, hybridfa_gate; print(lmcache.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(build / "lmcache" / "__init__.py")


def test_every_compile_cache_lives_under_the_one_folder(tmp_path: Path) -> None:
    env = procs.compile_cache_env(tmp_path / "cache")
    assert set(env) == {
        "VLLM_CACHE_ROOT",
        "TORCHINDUCTOR_CACHE_DIR",
        "TRITON_CACHE_DIR",
        "FLASHINFER_WORKSPACE_BASE",
    }
    assert all(Path(v).parent == (tmp_path / "cache").resolve() for v in env.values())


def _unset_compile_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in procs.compile_cache_env(Path("/")):
        monkeypatch.setenv(key, "")  # restored (unset) after the test, as use_compile_cache sets it
        monkeypatch.delenv(key)


def _run_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_run_args(ap, work=Path("/tmp/w"), kv_cache_gib=None, arms=("patched",))
    return ap.parse_args(argv)


def test_compile_cache_option_reaches_every_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _unset_compile_caches(monkeypatch)
    use_compile_cache(_run_args(["--compile-cache", str(tmp_path / "cc")]))
    env = procs.child_env(None, "HND")
    assert env["TRITON_CACHE_DIR"] == str((tmp_path / "cc" / "triton").resolve())
    assert env["FLASHINFER_WORKSPACE_BASE"] == str((tmp_path / "cc" / "flashinfer").resolve())


def test_without_the_option_each_library_keeps_its_own_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _unset_compile_caches(monkeypatch)
    use_compile_cache(_run_args([]))
    assert not set(procs.compile_cache_env(tmp_path)) & set(procs.child_env(None, None))


def test_extra_server_args_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDFA_SERVER_ARGS", "--separate-object-groups --x 'a b'")
    assert procs.extra_server_args() == ["--separate-object-groups", "--x", "a b"]
    monkeypatch.delenv("HYBRIDFA_SERVER_ARGS")
    assert procs.extra_server_args() == []


def test_sigterm_kills_the_engines_and_servers_the_gate_started() -> None:
    """`timeout` sends SIGTERM to the gate only; its children run in their own sessions, so
    without the handler they would outlive it and hold the GPU."""
    script = (
        "import time; from hybridfa_gate import procs; "
        "child = procs.spawn(['sleep', '60'], None, {'PATH': '/usr/bin:/bin'}); "
        "procs.install_cleanup_handler(); print(child.pid, flush=True); time.sleep(60)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env
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


def _one_l2_object(l2: Path) -> None:
    (l2 / "m@0x1000000@0x0@0001.data").parent.mkdir(parents=True, exist_ok=True)
    (l2 / "m@0x1000000@0x0@0001.data").write_bytes(b"\0" * 64)


def test_l2_wait_gives_up_when_the_server_failed_stores(tmp_path: Path) -> None:
    from hybridfa_gate import engine_proc

    l2, log = tmp_path / "l2", tmp_path / "server1.log"
    _one_l2_object(l2)
    log.write_text(f"[x] LMCache ERROR: {l2_tiers.STORE_FAILED} (transfer.py:1126)\n" * 2)
    t0 = time.monotonic()
    got = l2_tiers.wait_l2_stable(l2, 5, timeout=60.0, quiet=0.5, server_log=log)
    assert time.monotonic() - t0 < 10
    assert got["objects"] == 1 and not got["stable"] and got["store_failures"] == 2
    got = engine_proc._wait_l2(str(l2), 5, timeout=60.0, server_log=str(log))
    assert got["waited_s"] < 10 and not got["stable"] and got["store_failures"] == 2
    assert procs.server_log_facts(log.read_text())["store_failures"] == 2


def test_l2_wait_keeps_waiting_for_a_healthy_server(tmp_path: Path) -> None:
    l2, log = tmp_path / "l2", tmp_path / "server1.log"
    _one_l2_object(l2)
    log.write_text("[x] LMCache INFO: Stored 80 tokens in 0.001 seconds\n")
    got = l2_tiers.wait_l2_stable(l2, 5, timeout=2.0, quiet=0.5, server_log=log)
    assert not got["stable"] and "store_failures" not in got
    assert l2_tiers.wait_l2_stable(l2, 1, timeout=10.0, quiet=0.5, server_log=log)["stable"]


FAKE_ENGINE = """
import json, sys
from pathlib import Path
spec, out = Path(sys.argv[1]), Path(sys.argv[2])
tries = spec.with_suffix(".tries")
n = int(tries.read_text()) + 1 if tries.exists() else 1
tries.write_text(str(n))
if n <= int(json.loads(spec.read_text())["fail_times"]):
    print("WorkerProc failed to start. ... code: -98, name: EADDRINUSE, message: address in use")
    sys.exit(1)
out.write_text(json.dumps({"ok": True, "try": n}))
"""


def _fake_engine(monkeypatch: pytest.MonkeyPatch, path: Path, code: str) -> None:
    path.write_text(code)
    monkeypatch.setattr(
        procs, "engine_command", lambda py, spec, out: [py, str(path), str(spec), str(out)]
    )


@pytest.mark.parametrize("fail_times,ok,attempts", [(0, True, 1), (1, True, 2), (2, False, 2)])
def test_run_engine_starts_again_once_after_a_lost_port_race(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_times: int, ok: bool, attempts: int
) -> None:
    _fake_engine(monkeypatch, tmp_path / "fake_engine.py", FAKE_ENGINE)
    res = procs.run_engine(sys.executable, {}, {"fail_times": fail_times}, tmp_path, "store", 30)
    assert bool(res.get("ok")) is ok and res["attempts"] == attempts
    assert (tmp_path / "store.port-race.log").exists() is (fail_times > 0)


def test_each_engine_says_when_it_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_engine(monkeypatch, tmp_path / "fake_engine.py", FAKE_ENGINE)
    wd = tmp_path / "olmo-r5-NHD-c1N-offset"
    wd.mkdir()
    for role in ("cold", "store"):
        procs.run_engine(sys.executable, {}, {"fail_times": 0}, wd, role, 30)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" engine ")[0] for line in lines] == [
        f"olmo-r5-NHD-c1N-offset: {role}" for role in ("cold", "store")
    ]
    assert all(" engine ok after " in line for line in lines)


def test_run_engine_does_not_retry_other_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = "import sys; print('CUDA error: invalid argument'); sys.exit(1)\n"
    _fake_engine(monkeypatch, tmp_path / "fake_engine.py", fake)
    res = procs.run_engine(sys.executable, {}, {}, tmp_path, "store", 30)
    assert not res["ok"] and res["attempts"] == 1 and "invalid argument" in res["error"]


def test_the_engine_command_runs_the_packages_engine_module() -> None:
    cmd = procs.engine_command("python", Path("s.json"), Path("o.json"))
    assert cmd == ["python", "-m", "hybridfa_gate.engine_proc", "s.json", "o.json"]
    assert (REPO / "hybridfa_gate" / "engine_proc.py").is_file()


def test_server_log_facts_count_each_refusal_of_the_patched_server() -> None:
    log = "\n".join(
        [
            "ERROR: ... and this server's L2 tier includes fs_native, which loads objects "
            "without an integrity check (a torn, failed or replaced object is served as KV).",
            "ERROR: ... and LMCache's compiled CUDA copy kernels (lmcache.c_ops) did not load "
            "with torch 2.13.0: its copies would run on LMCache's Python fallback, which ...",
            "INFO: Stored 80 tokens in 0.001 seconds",
        ]
    )
    assert procs.server_log_facts(log)["refusals"] == 2


# A stand-in for `python -c SERVER_BOOT server ...`: it serves --port and announces itself; on
# its first start its HTTP port is taken, as when a concurrent case binds it first.
FAKE_SERVER = """#!{python}
import socket, sys, time
from pathlib import Path
args = sys.argv[sys.argv.index("server") + 1:]
port = int(args[args.index("--port") + 1])
starts = Path({starts!r})
starts.write_text(starts.read_text() + args[args.index("--http-port") + 1] + "\\n")
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port)); s.listen()
print("LMCache cache server is running...", flush=True)
if len(starts.read_text().split()) == 1:
    print("ERROR:    [Errno 98] error while attempting to bind on address "
          "('127.0.0.1', 1): address already in use", flush=True)
    time.sleep(2)
    sys.exit(0)
time.sleep(60)
"""


def test_a_server_that_lost_its_http_port_starts_again(tmp_path: Path) -> None:
    starts = tmp_path / "starts"
    starts.write_text("")
    py = tmp_path / "python"
    py.write_text(FAKE_SERVER.format(python=sys.executable, starts=str(starts)))
    py.chmod(0o755)
    port, log = procs.free_port(), tmp_path / "server1.log"
    proc = procs.start_server(str(py), dict(os.environ), port, 80, tmp_path / "l2", log)
    try:
        assert proc.poll() is None and procs.port_open(port)
        http_ports = starts.read_text().split()
        assert len(http_ports) == 2 and http_ports[0] != http_ports[1]
        assert (tmp_path / "server1.port-race1.log").exists()
    finally:
        procs.kill_group(proc)
