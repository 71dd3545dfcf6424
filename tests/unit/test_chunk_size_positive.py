"""A chunk size of 0 or below is refused at once, never left to a timeout.

Pristine 0.5.3 takes ``--chunk-size 0`` (or -256): 0 and -256 pass every "multiple of the
block size" check of server and engine alike, the server's KV cache registration then dies
with ZeroDivisionError or "negative dimension", the server sends no reply, and the engine
waits out its mq_timeout (300 s by default) and blames an unreachable server.

Real classes: the ``lmcache server`` command's argument parser, MPServerConfig, and LMCache's
real worker adapter against LMCache's real message-queue server (mq_server.ControlServer)
answering GET_CHUNK_SIZE as a server started with that size would.
"""

from __future__ import annotations

import argparse
import time

import pytest
import zmq
from mq_server import ControlServer, free_url

README_ARGS = ["--l1-size-gb", "8", "--eviction-policy", "LRU"]
BAD_SIZES = [0, -256]
PROMPT_S = 5.0  # "at once": far below any mq_timeout


def server_parser() -> argparse.ArgumentParser:
    from lmcache.cli.commands.server import ServerCommand

    parser = argparse.ArgumentParser(prog="lmcache")
    ServerCommand().register(parser.add_subparsers())
    return parser


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


@pytest.mark.fix
@pytest.mark.parametrize("size", BAD_SIZES)
def test_server_config_refuses_a_chunk_size_below_one(size: int) -> None:
    from lmcache.v1.multiprocess.config import MPServerConfig

    with pytest.raises(ValueError, match="chunk size must be a positive integer"):
        MPServerConfig(chunk_size=size)


@pytest.mark.fix
@pytest.mark.parametrize("size", BAD_SIZES)
def test_engine_refuses_a_server_chunk_size_below_one_at_once(size: int) -> None:
    from lmcache.integration.vllm.vllm_multi_process_adapter import (
        LMCacheMPWorkerAdapter,
        ParallelStrategy,
    )

    url = free_url()
    ctx = zmq.Context()
    ctx.linger = 0
    server = ControlServer(url, ctx, size)
    strategy = ParallelStrategy(
        mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1, n_servers=1
    )
    worker = None
    started = time.monotonic()
    try:
        with pytest.raises(ValueError, match="chunk size is -?[0-9]+; it must be a positive"):
            worker = LMCacheMPWorkerAdapter(url, ctx, "stub-model", 16, strategy, mq_timeout=30.0)
        assert time.monotonic() - started < PROMPT_S
    finally:
        if worker is not None:
            worker.shutdown()
        server.server.close()
        ctx.destroy(linger=0)
