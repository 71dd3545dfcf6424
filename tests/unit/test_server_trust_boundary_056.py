"""What lmcache 0.5.6's ``lmcache server`` exposes, and to whom.

0.5.6 already serves its HTTP API on 127.0.0.1 unless ``--http-host`` says otherwise and
serves no ``/run_script`` (the tests below without a mark pin that, on either build). Its
request server binds ``--host localhost`` by default and lets whoever reaches it read and
write cached KV (it has no authentication, nor has the HTTP API). The patched server logs
a warning when either is bound to an address other hosts can reach; pristine 0.5.6 starts
silently.

Real classes: the ``lmcache server`` command (its parser and ``execute``, down to the
uvicorn server it would run), the MP server's FastAPI app, run_cache_server (stopped right
after its first steps), with the modules' loggers recorded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from log_recorder import Recorder

pytestmark = pytest.mark.bases("0.5.6")

pytest.importorskip("lmcache")


class Stop(Exception):
    """Raised by a stub to end run_cache_server after its first steps."""


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


def http_start(
    monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> tuple[tuple[str, int], Recorder]:
    """Where ``lmcache server ARGV`` would serve its HTTP API (the uvicorn server that
    ServerCommand.execute starts, stopped before it binds anything), and what the HTTP
    server module logged on the way."""
    import uvicorn

    from lmcache.cli.commands.server import ServerCommand
    from lmcache.v1.multiprocess import http_server

    bound: list[tuple[str, int]] = []

    def run(self: Any, *_: Any, **__: Any) -> None:
        bound.append((self.config.host, self.config.port))

    monkeypatch.setattr(uvicorn.Server, "run", run)
    recorder = Recorder()
    monkeypatch.setattr(http_server, "logger", recorder)
    ServerCommand().execute(parse(argv))
    (where,) = bound
    return where, recorder


def request_server_warnings(monkeypatch: pytest.MonkeyPatch, host: str) -> list[str]:
    """What run_cache_server logs before it sets anything up, for ``--host HOST``."""
    from lmcache.v1.multiprocess import server
    from lmcache.v1.multiprocess.config import MPServerConfig

    def stop(*_: Any, **__: Any) -> None:
        raise Stop

    recorder = Recorder()
    monkeypatch.setattr(server, "logger", recorder)
    monkeypatch.setattr(server, "set_isolated_ipc", stop)
    with pytest.raises(Stop):
        server.run_cache_server(MPServerConfig(host=host, port=5599), None, None)  # type: ignore[arg-type]
    return recorder.warnings


def test_the_readme_command_serves_its_http_api_on_loopback_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (host, port), recorder = http_start(monkeypatch, readme_args(tmp_path))
    assert (host, port) == ("127.0.0.1", 8080), f"HTTP API bound to {host}:{port}"
    assert not any("no authentication" in w for w in recorder.warnings), recorder.warnings


def test_the_http_api_runs_no_uploaded_script() -> None:
    from fastapi.testclient import TestClient

    from lmcache.v1.multiprocess.http_server import app

    script = b"app.state.uploaded_script_ran = True\nresult = 'ran'\n"
    TestClient(app).post("/run_script", files={"script": ("s.py", script)})
    assert not getattr(app.state, "uploaded_script_ran", False)


def test_the_readme_command_binds_its_request_server_on_loopback(tmp_path: Path) -> None:
    from lmcache.v1.multiprocess.config import parse_args_to_mp_server_config

    config = parse_args_to_mp_server_config(parse(readme_args(tmp_path)))
    assert config.host in ("localhost", "127.0.0.1"), config.host


@pytest.mark.feature
def test_an_http_api_opened_to_other_hosts_is_logged_as_unauthenticated(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    argv = readme_args(tmp_path, "--http-host", "0.0.0.0", "--http-port", "9000")
    where, recorder = http_start(monkeypatch, argv)
    assert where == ("0.0.0.0", 9000)
    assert any("0.0.0.0:9000" in w and "no authentication" in w for w in recorder.warnings), (
        recorder.warnings
    )


@pytest.mark.feature
def test_a_request_server_opened_to_other_hosts_is_logged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    warnings = request_server_warnings(monkeypatch, "0.0.0.0")
    assert any("0.0.0.0:5599" in w and "cached KV" in w for w in warnings), warnings


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "::1"])
def test_a_request_server_on_loopback_logs_no_exposure(
    monkeypatch: pytest.MonkeyPatch, host: str
) -> None:
    assert not any("cached KV" in w for w in request_server_warnings(monkeypatch, host))
