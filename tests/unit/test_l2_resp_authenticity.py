"""Whoever can write to the resp tier's Redis cannot change what a server restores, and
the adapter reaches Redis with a password, an ACL user or TLS from its config (both bases).

Each value is the object's bytes and a tag keyed by the L2 tier's secret (over the Redis
key and the bytes); a value whose tag does not verify is a miss. Pristine 0.5.3 and 0.5.6
store the bytes alone and restore whatever a key holds, if its size is right; 0.5.6 carries
AUTH but has no TLS.

LMCache's real resp adapter on a real redis-server (fixture ``redis``).
"""

from __future__ import annotations

import random
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache.v1.distributed.l2_adapters.resp_l2_adapter")

from fs_l2_driver import Buf  # noqa: E402
from log_recorder import Recorder  # noqa: E402

from hybridfa_gate import l2 as l2_tiers  # noqa: E402
from hybridfa_gate.l2 import RedisServer  # noqa: E402

pytestmark = pytest.mark.bases("0.5.3", "0.5.6")

SIZE = 16 << 10


def open_adapter(port: int, **config: Any) -> Any:
    """The resp adapter on 127.0.0.1:port; ``config``: more of its config keys, which
    pristine's config ignores."""
    from lmcache.v1.distributed.l2_adapters.resp_l2_adapter import (
        RESPL2AdapterConfig,
        _create_resp_l2_adapter,
    )

    spec = {"host": "127.0.0.1", "port": port, "num_workers": 2, **config}
    return _create_resp_l2_adapter(RESPL2AdapterConfig.from_dict(spec))


@pytest.fixture
def adapter(redis: RedisServer) -> Iterator[Any]:
    adp = open_adapter(redis.port)
    try:
        yield adp
    finally:
        adp.close()


def key(i: int = 1) -> Any:
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk_hash=bytes([i]) * 32, model_name="m", kv_rank=0)


def redis_key(k: Any) -> str:
    from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
        _object_key_to_string,
    )

    return _object_key_to_string(k)


PAYLOAD = random.Random(1).randbytes(SIZE)


def wait(poll: Any, what: str) -> Any:
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if (result := poll()) is not None:
            return result
        time.sleep(0.01)
    pytest.fail(f"{what} did not complete within 5s")


def store(adapter: Any, keys: list[Any], payload: bytes = PAYLOAD) -> None:
    bufs = [Buf(payload) for _ in keys]  # alive until the task completes
    task = adapter.submit_store_task(keys, [b.obj for b in bufs])
    assert wait(lambda: adapter.pop_completed_store_tasks().get(task), "a store").is_successful()


def load(adapter: Any, k: Any) -> tuple[bool, bytes]:
    buf = Buf(bytes(SIZE))
    task = adapter.submit_load_task([k], [buf.obj])
    bitmap = wait(lambda: adapter.query_load_result(task), "a load")
    return bitmap.test(0), buf.data


# ---------------------------------------------------------------------------------------
# Forged values are a miss


@pytest.mark.fix
def test_a_value_overwritten_with_other_bytes_of_its_size_is_a_miss(adapter, redis):
    store(adapter, [key()])
    with redis.client() as client:
        size = client.command("STRLEN", redis_key(key()))
        forged = random.Random(2).randbytes(size)
        assert client.command("SET", redis_key(key()), forged) == "OK"
    hit, _ = load(adapter, key())
    assert not hit, "a value forged in Redis was restored"


@pytest.mark.fix
def test_another_keys_value_copied_under_a_key_is_a_miss(adapter, redis):
    store(adapter, [key(2)], random.Random(2).randbytes(SIZE))
    with redis.client() as client:
        value = client.command("GET", redis_key(key(2)))
        assert client.command("SET", redis_key(key(1)), value) == "OK"
    hit, _ = load(adapter, key(1))
    assert not hit, "another key's value was restored"


@pytest.mark.fix
def test_a_value_written_under_another_secret_is_a_miss_and_logged(redis, tmp_path, monkeypatch):
    other = open_adapter(redis.port, secret_file=str(tmp_path / "other.key"))
    try:
        store(other, [key()])
    finally:
        other.close()
    recorder = Recorder()
    try:
        from lmcache.v1.distributed.l2_adapters import resp_client
    except ImportError:  # pristine: no such module, nothing to record
        pass
    else:
        monkeypatch.setattr(resp_client, "logger", recorder)
    ours = open_adapter(redis.port, secret_file=str(tmp_path / "ours.key"))
    try:
        hit, _ = load(ours, key())
    finally:
        ours.close()
    assert not hit, "a value written under another secret was restored"
    assert any(redis_key(key()) in w and "another secret" in w for w in recorder.warnings), (
        recorder.warnings
    )


def test_servers_with_one_secret_file_restore_each_others_values(redis, tmp_path):
    secret = str(tmp_path / "shared.key")
    first = open_adapter(redis.port, secret_file=secret)
    try:
        store(first, [key()])
    finally:
        first.close()
    second = open_adapter(redis.port, secret_file=secret)
    try:
        assert load(second, key()) == (True, PAYLOAD)
    finally:
        second.close()


@pytest.mark.feature
def test_a_secret_others_can_read_refuses_the_start(redis, tmp_path):
    from lmcache.v1.distributed.l2_adapters.tier_secret import TierSecretError

    secret = tmp_path / "l2-tier.key"
    secret.write_text("ab" * 32 + "\n")
    secret.chmod(0o644)
    with pytest.raises(TierSecretError, match="chmod 600"):
        open_adapter(redis.port, secret_file=str(secret))


# ---------------------------------------------------------------------------------------
# Redis AUTH from the adapter's config


@pytest.fixture
def redis_password(redis: RedisServer) -> Iterator[str]:
    with redis.client() as client:
        client.command("ACL", "SETUSER", "lmcache", "on", ">user-secret", "~*", "+@all")
        client.command("CONFIG", "SET", "requirepass", "default-secret")
    yield "default-secret"


@pytest.mark.parametrize(
    "credentials",
    [{"password": "default-secret"}, {"username": "lmcache", "password": "user-secret"}],
    ids=["password", "acl-user"],
)
def test_an_adapter_with_credentials_stores_and_loads(redis, redis_password, credentials):
    adp = open_adapter(redis.port, **credentials)
    try:
        store(adp, [key()])
        assert load(adp, key()) == (True, PAYLOAD)
    finally:
        adp.close()


@pytest.mark.feature
@pytest.mark.parametrize(
    "credentials, error",
    [({}, "NOAUTH"), ({"password": "wrong"}, "WRONGPASS")],
    ids=["none", "wrong"],
)
def test_an_adapter_without_valid_credentials_refuses_to_start(
    redis, redis_password, credentials, error
):
    with pytest.raises(RuntimeError, match=f"cannot connect to 127.0.0.1:{redis.port}.*{error}"):
        open_adapter(redis.port, **credentials)


# ---------------------------------------------------------------------------------------
# TLS from the adapter's config


class TLSRedis(RedisServer):
    """A redis-server that also serves TLS on ``tls_port`` (the plain port stays for the
    fixture's own checks)."""

    def __init__(self, workdir: Path, cert: Path, key: Path) -> None:
        super().__init__(workdir=workdir)
        self.tls_port = l2_tiers.free_port()
        self.cert, self.key = cert, key

    def argv(self) -> list[str]:
        return super().argv() + [
            "--tls-port", str(self.tls_port),
            "--tls-cert-file", str(self.cert),
            "--tls-key-file", str(self.key),
            "--tls-ca-cert-file", str(self.cert),
            "--tls-auth-clients", "no",
        ]  # fmt: skip


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[TLSRedis]:
    if l2_tiers.redis_server_binary() is None or shutil.which("openssl") is None:
        pytest.skip("needs redis-server and openssl")
    cert, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key_file), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    server = TLSRedis(tmp_path / "redis", cert, key_file)
    try:
        server.start()
    except RuntimeError as e:
        if "tls" in str(e).lower():
            pytest.skip(f"this redis-server has no TLS: {e}")
        raise
    try:
        yield server
    finally:
        server.close()


@pytest.mark.feature
def test_an_adapter_with_tls_stores_and_loads(tls_redis):
    adp = open_adapter(tls_redis.tls_port, tls=True, tls_ca_file=str(tls_redis.cert))
    try:
        store(adp, [key()])
        assert load(adp, key()) == (True, PAYLOAD)
    finally:
        adp.close()
    assert tls_redis.inventory()["objects"] == 1


@pytest.mark.feature
def test_an_adapter_that_does_not_trust_the_certificate_refuses_to_start(tls_redis):
    with pytest.raises(RuntimeError, match="CERTIFICATE_VERIFY_FAILED"):
        open_adapter(tls_redis.tls_port, tls=True)
