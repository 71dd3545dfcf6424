"""A real redis-server for the CPU tests of the ``resp`` L2 tier.

The process, the RESP client and the inventory are hybridfa_gate.l2's (the restart gate
uses the same code on a GPU node). ``redis`` is a fixture: a redis-server on
a free port in the test's temp folder, without persistence; a test marked
``redis_maxmemory("2mb")`` gets one that evicts (``allkeys-lru``). Without a
redis-server binary ($REDIS_SERVER or PATH) the tests that use it skip, saying so.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridfa_gate import l2 as l2_tiers
from hybridfa_gate.l2 import RedisServer, RespClient, RespError

__all__ = ["RedisServer", "RespClient", "RespError", "l2_tiers", "redis"]

NO_REDIS = (
    "redis-server not found ($REDIS_SERVER or PATH): the resp L2 tier is not tested; "
    "install it (Debian: apt-get install redis-server)"
)


@pytest.fixture
def redis(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisServer]:
    binary = l2_tiers.redis_server_binary()
    if binary is None:
        pytest.skip(NO_REDIS)
    marker = request.node.get_closest_marker("redis_maxmemory")
    server = RedisServer(
        binary, workdir=tmp_path / "redis", maxmemory=marker.args[0] if marker else None
    )
    server.start()
    try:
        yield server
    finally:
        server.close()
