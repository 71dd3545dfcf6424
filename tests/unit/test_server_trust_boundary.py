"""What the README's ``lmcache server`` command exposes, and to whom.

Pristine 0.5.3 serves the MP server's HTTP API on 0.0.0.0:8080 without authentication: every
host that reaches the port can list every cached key with its salt, clear the cache, and
``POST /run_script`` Python that runs with the server's rights (its builtins whitelist does
not confine a script: the script gets the FastAPI ``app`` and, through it, the whole server).
The patched server binds the HTTP API to 127.0.0.1 unless ``--http-host`` says otherwise
and never mounts ``/run_script``. The message queue (through which a client reads and writes
cached KV) binds ``--host localhost`` by default, which ZMQ resolves to 127.0.0.1 on either build.

Real classes: the ``lmcache server`` command (its parser and ``execute``, down to the
uvicorn server it would run), the MP server's FastAPI app, LMCache's MessageQueueServer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import zmq


def readme_args(l2_dir: Path, *extra: str) -> list[str]:
    """The README's ``lmcache server`` command line (its fs folder under ``l2_dir``)."""
    adapter = json.dumps({"type": "fs", "base_path": str(l2_dir)})
    return [
        "server", "--chunk-size", "64", "--l1-size-gb", "8", "--eviction-policy", "LRU",
        "--l2-adapter", adapter, *extra,
    ]  # fmt: skip


def parse(argv: list[str]) -> argparse.Namespace:
    from lmcache.cli.commands.server import ServerCommand

    parser = argparse.ArgumentParser(prog="lmcache")
    ServerCommand().register(parser.add_subparsers())
    return parser.parse_args(argv)


def http_bind(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> tuple[str, int]:
    """Where ``lmcache server ARGV`` would serve its HTTP API: the uvicorn server that
    ServerCommand.execute starts, stopped before it binds anything."""
    import uvicorn

    from lmcache.cli.commands.server import ServerCommand

    bound: list[tuple[str, int]] = []

    def run(self: Any, *_: Any, **__: Any) -> None:
        bound.append((self.config.host, self.config.port))

    monkeypatch.setattr(uvicorn.Server, "run", run)
    ServerCommand().execute(parse(argv))
    (where,) = bound
    return where


@pytest.mark.fix
def test_the_readme_command_serves_its_http_api_on_loopback_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    host, port = http_bind(monkeypatch, readme_args(tmp_path))
    assert (host, port) == ("127.0.0.1", 8080), f"HTTP API bound to {host}:{port}"


def test_http_host_opens_the_api_deliberately(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    argv = readme_args(tmp_path, "--http-host", "0.0.0.0", "--http-port", "9000")
    assert http_bind(monkeypatch, argv) == ("0.0.0.0", 9000)


@pytest.mark.fix
def test_the_http_api_runs_no_uploaded_script() -> None:
    from fastapi.testclient import TestClient

    from lmcache.v1.multiprocess.http_server import app

    script = b"app.state.uploaded_script_ran = True\nresult = 'ran'\n"
    response = TestClient(app).post("/run_script", files={"script": ("s.py", script)})
    ran = getattr(app.state, "uploaded_script_ran", False)
    assert not ran, "POST /run_script ran the uploaded script in the server"
    assert response.status_code == 404
    assert "/run_script" not in {getattr(route, "path", "") for route in app.routes}


def test_the_readme_command_binds_its_message_queue_on_loopback_only(tmp_path: Path) -> None:
    from lmcache.v1.multiprocess.config import parse_args_to_mp_server_config
    from lmcache.v1.multiprocess.mq import MessageQueueServer

    config = parse_args_to_mp_server_config(parse(readme_args(tmp_path, "--port", "0")))
    ctx = zmq.Context()
    ctx.linger = 0
    # run_cache_server's bind URL; port 0 stands in for the default 5555 (the test may
    # share the machine with a server).
    server = MessageQueueServer(f"tcp://{config.host}:{config.port}", ctx)
    try:
        endpoint = server.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
    finally:
        server.close()
        ctx.destroy(linger=0)
    assert endpoint.startswith("tcp://127.0.0.1:"), endpoint
