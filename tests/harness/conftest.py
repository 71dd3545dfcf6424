"""Fixtures of the harness tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridfa_gate.l2 import RedisServer, redis_server_binary


@pytest.fixture
def redis(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own (tests/unit/redis_server.py has the same fixture)."""
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("redis-server not found ($REDIS_SERVER or PATH)")
    marker = request.node.get_closest_marker("redis_maxmemory")
    server = RedisServer(
        binary, workdir=tmp_path / "redis", maxmemory=marker.args[0] if marker else None
    )
    server.start()
    try:
        yield server
    finally:
        server.close()
