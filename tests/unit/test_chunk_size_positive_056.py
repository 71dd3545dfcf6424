"""lmcache 0.5.6 refuses a chunk size of 0 or below at once, never leaves it to a timeout.

Pristine 0.5.6 takes ``lmcache server --chunk-size 0`` (or -256): the argument parser,
MPServerConfig and both engine-side adapters accept it, since 0 and -256 pass every
"multiple of the block size" check; the server then fails its first KV cache
registration and the engine waits out its mq_timeout. The patched build refuses the size
in the parser, in MPServerConfig, and in the engine's scheduler and worker adapters when a
server (of another build) answers GET_CHUNK_SIZE with it.

Real classes: the ``lmcache server`` command's argument parser, MPServerConfig, LMCache's
LMCacheMPSchedulerAdapter and LMCacheMPWorkerAdapter over a request client that answers
the handshake as a server started with that size would.
"""

from __future__ import annotations

import argparse
import re
import time
from typing import Any

import pytest

pytestmark = pytest.mark.bases("0.5.6")

pytest.importorskip("lmcache")

from handshake_client import HandshakeClient, connect_to, one_gpu  # noqa: E402

README_ARGS = ["--l1-size-gb", "8", "--eviction-policy", "LRU"]
BAD_SIZES = [0, -256]
BLOCK = 16
PROMPT_S = 5.0  # "at once": far below any mq_timeout
REFUSAL = "chunk size is -?[0-9]+; it must be a positive integer"


def server_parser() -> argparse.ArgumentParser:
    from lmcache.cli.commands.server import ServerCommand

    parser = argparse.ArgumentParser(prog="lmcache")
    ServerCommand().register(parser.add_subparsers())
    return parser


def build_adapter(monkeypatch: pytest.MonkeyPatch, which: str, size: int) -> Exception | None:
    """Builds LMCache's real ``which`` adapter against a server of chunk size ``size``;
    returns what it raised (None: it was built). Asserts it decided at once."""
    import zmq

    from lmcache.integration.vllm import vllm_multi_process_adapter as vmpa

    connect_to(monkeypatch, HandshakeClient(size))
    strategy = one_gpu()
    ctx = zmq.Context()
    ctx.linger = 0
    url = "tcp://127.0.0.1:1"
    started = time.monotonic()
    built: Any = None
    try:
        if which == "worker":
            built = vmpa.LMCacheMPWorkerAdapter(
                url, ctx, "stub-model", BLOCK, strategy, mq_timeout=30.0
            )
        else:
            built = vmpa.LMCacheMPSchedulerAdapter(
                [url], ctx, "stub-model", BLOCK, strategy, mq_timeout=30.0
            )
    except Exception as error:  # noqa: BLE001 - what it raised is the result
        return error
    finally:
        assert time.monotonic() - started < PROMPT_S
        if built is not None and hasattr(built, "shutdown"):
            built.shutdown()
        ctx.destroy(linger=0)
    return None


@pytest.mark.fix
@pytest.mark.parametrize("size", BAD_SIZES)
def test_lmcache_server_refuses_a_chunk_size_below_one(
    size: int, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = server_parser()
    try:
        parser.parse_args(["server", "--chunk-size", str(size), *README_ARGS])
    except SystemExit as exit_:
        assert exit_.code == 2
    else:
        pytest.fail(f"lmcache server took --chunk-size {size}")
    assert "chunk size must be a positive integer" in capsys.readouterr().err


def test_lmcache_server_takes_a_positive_chunk_size() -> None:
    args = server_parser().parse_args(["server", "--chunk-size", "64", *README_ARGS])
    assert args.chunk_size == 64


@pytest.mark.fix
@pytest.mark.parametrize("size", BAD_SIZES)
def test_server_config_refuses_a_chunk_size_below_one(size: int) -> None:
    from lmcache.v1.multiprocess.config import MPServerConfig

    try:
        MPServerConfig(chunk_size=size)
    except ValueError as error:
        assert "chunk size must be a positive integer" in str(error)
    else:
        pytest.fail(f"MPServerConfig took chunk_size={size}")


@pytest.mark.fix
@pytest.mark.parametrize("which", ["scheduler", "worker"])
@pytest.mark.parametrize("size", BAD_SIZES)
def test_engine_refuses_a_server_chunk_size_below_one_at_once(
    monkeypatch: pytest.MonkeyPatch, which: str, size: int
) -> None:
    error = build_adapter(monkeypatch, which, size)
    assert isinstance(error, ValueError), f"the {which} adapter took chunk size {size}: {error!r}"
    assert re.search(REFUSAL, str(error)), str(error)


@pytest.mark.parametrize("which", ["scheduler", "worker"])
def test_engine_takes_a_server_chunk_size_that_is_a_multiple_of_the_block(
    monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    assert build_adapter(monkeypatch, which, 4 * BLOCK) is None
