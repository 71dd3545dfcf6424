"""An L2 adapter never stores back the bytes it rejected on load.

A rejected object (forged, damaged, written under another secret) stays on the tier and
the next store of its key replaces it, so that a server's own objects win over foreign
ones. That store must not carry the rejected bytes themselves: whatever hands a rejected
load's buffer to the store path would otherwise write the forged payload again, sealed
with a valid tag, for every later server to restore. Both adapters remember the tag the
rejected bytes would carry and refuse to store them; other bytes replace the object.

Real fs adapter on tmp_path; real resp adapter (the series' Python client) on a real
redis-server. What counts on pristine: the forged object loaded (no tag is checked).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.bases("0.5.3", "0.5.6"), pytest.mark.fix]

pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_l2_adapter")

from fs_l2_driver import Buf, wait_for  # noqa: E402

from hybridfa_gate.l2 import RedisServer, RespClient  # noqa: E402

PAYLOAD = random.Random(1).randbytes(64 << 10)
FORGED = random.Random(2).randbytes(64 << 10)


def key() -> Any:
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk_hash=b"\x05" * 32, model_name="m", kv_rank=0)


def store(adapter: Any, payload: bytes) -> bool:
    """Store ``payload`` under key(); whether the adapter stored it."""
    buf = Buf(payload)  # alive until the task completes
    task = adapter.submit_store_task([key()], [buf.obj])
    result = wait_for(lambda: adapter.pop_completed_store_tasks().get(task), "a store")
    return bool(result.is_successful())


def load(adapter: Any) -> bytes | None:
    """key()'s object as loaded, None for a miss."""
    buf = Buf(bytes(len(PAYLOAD)))
    task = adapter.submit_load_task([key()], [buf.obj])
    bitmap = wait_for(lambda: adapter.query_load_result(task), "a load")
    return buf.data if bitmap.test(0) else None


def test_the_fs_adapter_does_not_store_back_the_bytes_it_rejected(adapter, tmp_path: Path):
    assert store(adapter, PAYLOAD)
    (path,) = (tmp_path / "l2").glob("*.data")
    forged = FORGED + b"\x00" * (path.stat().st_size - len(PAYLOAD))
    path.write_bytes(forged)
    assert load(adapter) is None, "a forged object was loaded"
    store(adapter, FORGED)
    assert path.read_bytes() == forged, "the rejected bytes were stored back, sealed anew"
    assert store(adapter, PAYLOAD)
    assert load(adapter) == PAYLOAD, "other bytes did not replace the rejected object"


@pytest.fixture
def resp_adapter(redis: RedisServer) -> Iterator[Any]:
    from lmcache.v1.distributed.l2_adapters.resp_l2_adapter import (
        RESPL2AdapterConfig,
        _create_resp_l2_adapter,
    )

    config = {"host": "127.0.0.1", "port": redis.port, "num_workers": 2}
    adp = _create_resp_l2_adapter(RESPL2AdapterConfig.from_dict(config))
    try:
        yield adp
    finally:
        adp.close()


def test_the_resp_client_does_not_store_back_the_bytes_it_rejected(resp_adapter, redis):
    assert store(resp_adapter, PAYLOAD)
    with RespClient(redis.port) as client:
        (name,) = client.command("KEYS", "*")
        size = len(client.command("GET", name))
        forged = FORGED + b"\x00" * (size - len(PAYLOAD))
        client.command("SET", name, forged)
    assert load(resp_adapter) is None, "a forged value was loaded"
    store(resp_adapter, FORGED)
    with RespClient(redis.port) as client:
        assert client.command("GET", name) == forged, "the rejected bytes were stored back"
    assert store(resp_adapter, PAYLOAD)
    assert load(resp_adapter) == PAYLOAD, "other bytes did not replace the rejected value"
