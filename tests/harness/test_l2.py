"""The gate's L2 tiers (hybridfa_gate.l2): adapter JSON, folder and resp inventories, and the
redis-server process, the resp parts against a real redis-server."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hybridfa_gate import l2 as l2_tiers
from hybridfa_gate.l2 import RedisServer, RespError


def test_adapter_json_of_each_tier(tmp_path: Path) -> None:
    assert l2_tiers.adapter_json("fs", folder=tmp_path) == {
        "type": "fs",
        "base_path": str(tmp_path),
    }
    assert l2_tiers.adapter_json("fs_native", folder=tmp_path)["type"] == "fs_native"
    resp = l2_tiers.adapter_json("resp", port=6390)
    assert resp == {"type": "resp", "host": "127.0.0.1", "port": 6390}
    json.dumps(resp)


@pytest.mark.parametrize(
    "kind, args",
    [("fs", {}), ("resp", {}), ("s3", {"port": 1})],
    ids=["fs-without-folder", "resp-without-port", "unknown"],
)
def test_adapter_json_refuses_what_it_cannot_build(kind, args) -> None:
    with pytest.raises(ValueError):
        l2_tiers.adapter_json(kind, **args)


@pytest.mark.parametrize("kind", l2_tiers.ADAPTERS)
def test_adapter_json_is_what_the_server_s_l2_adapter_option_parses(kind, tmp_path) -> None:
    config = pytest.importorskip("lmcache.v1.distributed.l2_adapters.config")
    parser = config.add_l2_adapters_args(argparse.ArgumentParser())
    spec = l2_tiers.adapter_json(kind, folder=tmp_path, port=6390)
    args = parser.parse_args(["--l2-adapter", json.dumps(spec)])
    (adapter,) = config.parse_args_to_l2_adapters_config(args).adapters
    assert config.get_type_name_for_config(adapter) == kind
    if kind == "resp":
        assert (adapter.host, adapter.port) == ("127.0.0.1", 6390)
    else:
        assert adapter.base_path == str(tmp_path)


def test_parse_object_key() -> None:
    key = "m~hfa-0123@01000100@1@" + "ab" * 32
    assert l2_tiers.parse_object_key(key) == {
        "model": "m~hfa-0123",
        "world_size": 1,
        "rank": 0,
        "object_group": 1,
        "chunk_hash": "ab" * 32,
    }
    assert l2_tiers.parse_object_key("not-an-object") is None
    assert l2_tiers.parse_object_key("m@zz@1@ab") is None


def test_inventory_counts_objects_and_value_bytes(redis: RedisServer) -> None:
    with redis.client() as client:
        for og, size in ((0, 1000), (0, 1000), (1, 300)):
            key = f"m@01000100@{og}@{size:04x}{og}{client.command('DBSIZE')}"
            assert client.command("SET", key, b"x" * size) == "OK"
        client.command("SET", "unrelated", b"y" * 50)
    inv = redis.inventory(with_keys=True)
    assert (inv["objects"], inv["bytes"], inv["dbsize"]) == (3, 2300, 4)
    assert inv["per_object_group"] == {
        "0": {"objects": 2, "bytes": 2000},
        "1": {"objects": 1, "bytes": 300},
    }
    assert inv["per_rank"] == {"0": {"objects": 3, "bytes": 2300}}
    assert sorted(inv["keys"].values()) == [300, 1000, 1000]


def test_resp_client_decodes_replies_and_errors(redis: RedisServer) -> None:
    with redis.client() as client:
        assert client.command("PING") == "PONG"
        assert client.command("GET", "missing") is None
        assert client.command("SET", "k", b"\r\n\x00") == "OK"
        assert client.command("GET", "k") == b"\r\n\x00"
        assert client.command("EXISTS", "k", "missing") == 1
        with pytest.raises(RespError):
            client.command("NOSUCHCOMMAND")


def test_the_server_keeps_nothing_on_disk_and_restarts_empty(redis: RedisServer) -> None:
    with redis.client() as client:
        client.command("SET", "k", "v")
        assert client.command("CONFIG", "GET", "save") == [b"save", b""]
        assert client.command("CONFIG", "GET", "appendonly") == [b"appendonly", b"no"]
    redis.stop()
    assert not redis.ping()
    redis.start()
    assert redis.inventory()["dbsize"] == 0
    assert not list(redis.workdir.glob("*.rdb"))


def test_kill_ends_the_process(redis: RedisServer) -> None:
    redis.kill()
    assert not redis.ping()


@pytest.mark.redis_maxmemory("2mb")
def test_maxmemory_evicts_least_recently_used(redis: RedisServer) -> None:
    with redis.client() as client:
        assert client.command("CONFIG", "GET", "maxmemory-policy")[1] == b"allkeys-lru"
        for i in range(40):
            client.command("SET", f"m@01000100@0@{i:064x}", b"z" * 100_000)
    assert redis.inventory()["objects"] < 40


def test_without_a_binary_the_server_is_not_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_SERVER", "/nonexistent/redis-server")
    assert l2_tiers.redis_server_binary() is None
    with pytest.raises(FileNotFoundError):
        RedisServer()


def test_l2_filename_and_inventory(tmp_path: Path) -> None:
    meta = l2_tiers.parse_file_name("m@0x02010201@0@abcd.data")
    assert meta == {"world_size": 2, "rank": 1, "object_group": 0, "chunk_hash": "abcd"}
    assert l2_tiers.parse_file_name("m@0x00000000@1@ab@salt.data")["object_group"] == 1
    assert l2_tiers.parse_file_name("x.tmp") is None
    (tmp_path / "m@0x02000200@0@aa.data").write_bytes(b"1" * 10)
    (tmp_path / "m@0x02010201@0@aa.data").write_bytes(b"1" * 7)
    (tmp_path / "m@0x02010201@1@bb.data").write_bytes(b"1" * 7)
    (tmp_path / "junk.tmp").write_bytes(b"1")
    inv = l2_tiers.folder_inventory(tmp_path)
    assert inv["objects"] == 3 and inv["bytes"] == 24
    assert inv["per_rank"] == {"0": {"objects": 1, "bytes": 10}, "1": {"objects": 2, "bytes": 14}}
    assert inv["per_object_group"] == {
        "0": {"objects": 2, "bytes": 17},
        "1": {"objects": 1, "bytes": 7},
    }


def test_tier_inventory_reads_a_folder_or_a_redis_url(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "m@0x1000000@0x0@abcd.data").write_bytes(b"\0" * 10)
    assert l2_tiers.tier_inventory(tmp_path)["objects"] == 1
    seen = []
    monkeypatch.setattr(
        l2_tiers, "resp_inventory", lambda port, host: seen.append((host, port)) or {}
    )
    l2_tiers.tier_inventory(l2_tiers.redis_url(6390))
    assert seen == [("127.0.0.1", 6390)]
