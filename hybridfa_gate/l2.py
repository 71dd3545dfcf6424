"""L2 tiers for the restart gate: adapter JSON, a redis-server process, an inventory.

Standard library only, so the gate imports it on a bare GPU node. ``adapter_json`` gives
the ``lmcache server --l2-adapter`` value of the ``fs``, ``fs_native`` and ``resp``
adapters; ``RedisServer`` runs a throwaway redis-server (no persistence) for a ``resp``
tier; ``tier_inventory`` counts the objects and bytes of a tier, an fs or fs_native folder
(``folder_inventory``) or a resp tier (``resp_inventory``, over a minimal RESP client);
``wait_l2_stable`` waits until a tier holds enough objects and stops changing.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

ADAPTERS = ("fs", "fs_native", "resp")
REDIS_HOST = "127.0.0.1"
# lmcache's native connectors key an object as
# <model>@<kv_rank 08x>@<object group hex>@<chunk hash hex>[@cache salt]
KEY_SEP = "@"
# What an LMCache server logs for each store that failed.
STORE_FAILED = "Cannot store keys due to exception"


def adapter_json(
    kind: str, folder: Path | None = None, port: int | None = None, host: str = REDIS_HOST
) -> dict[str, Any]:
    """The L2 adapter config for ``kind``: ``fs``/``fs_native`` on ``folder``, ``resp``
    on redis at ``host:port``."""
    if kind in ("fs", "fs_native"):
        if folder is None:
            raise ValueError(f"the {kind} adapter needs a folder")
        return {"type": kind, "base_path": str(folder)}
    if kind == "resp":
        if port is None:
            raise ValueError("the resp adapter needs a redis port")
        return {"type": "resp", "host": host, "port": int(port)}
    raise ValueError(f"unknown L2 adapter {kind!r}; one of {', '.join(ADAPTERS)}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((REDIS_HOST, 0))
        return int(s.getsockname()[1])


def redis_server_binary() -> str | None:
    """$REDIS_SERVER, else redis-server on PATH; None when neither exists."""
    explicit = os.environ.get("REDIS_SERVER")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return shutil.which("redis-server")


# ---------------------------------------------------------------------------------------
# A minimal RESP2 client


class RespError(Exception):
    """An error reply (``-ERR ...``) from the server."""


class RespClient:
    """One connection; ``command`` sends one command and returns its decoded reply."""

    def __init__(self, port: int, host: str = REDIS_HOST, timeout: float = 5.0) -> None:
        self._sock = socket.create_connection((host, port), timeout=timeout)
        self._reader = self._sock.makefile("rb")

    def command(self, *args: str | bytes | int) -> Any:
        parts = [b"*%d\r\n" % len(args)]
        for arg in args:
            raw = arg if isinstance(arg, bytes) else str(arg).encode()
            parts.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
        self._sock.sendall(b"".join(parts))
        return self._reply()

    def _reply(self) -> Any:
        line = self._reader.readline()
        if not line.endswith(b"\r\n"):
            raise ConnectionError("redis closed the connection")
        kind, body = line[:1], line[1:-2]
        if kind == b"+":
            return body.decode()
        if kind == b"-":
            raise RespError(body.decode())
        if kind == b":":
            return int(body)
        if kind == b"$":
            n = int(body)
            if n < 0:
                return None
            data = self._reader.read(n + 2)
            return data[:-2]
        if kind == b"*":
            n = int(body)
            return None if n < 0 else [self._reply() for _ in range(n)]
        raise ConnectionError(f"not a RESP reply: {line[:40]!r}")

    def close(self) -> None:
        self._reader.close()
        self._sock.close()

    def __enter__(self) -> RespClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_object_key(key: str) -> dict[str, Any] | None:
    """The fields of a stored object's key (a native connector's Redis key, an fs file's
    name without ``.data``), None for another key. kv_rank is the bitmap
    (ws<<24)|(rank<<16)|(local_ws<<8)|local."""
    parts = key.split(KEY_SEP)
    if len(parts) not in (4, 5):
        return None
    try:
        kv_rank = int(parts[1], 16)
        og = int(parts[2], 16)
    except ValueError:
        return None
    return {
        "model": parts[0],
        "world_size": kv_rank >> 24,
        "rank": (kv_rank >> 16) & 0xFF,
        "object_group": og,
        "chunk_hash": parts[3],
    }


def tally(inventory: dict[str, Any], meta: dict[str, Any], size: int) -> None:
    """Count one object of ``size`` bytes into an inventory's totals, per rank and per
    object group."""
    inventory["objects"] += 1
    inventory["bytes"] += size
    for table, field in (("per_rank", "rank"), ("per_object_group", "object_group")):
        slot = inventory[table].setdefault(str(meta[field]), {"objects": 0, "bytes": 0})
        slot["objects"] += 1
        slot["bytes"] += size


def empty_inventory() -> dict[str, Any]:
    return {"objects": 0, "bytes": 0, "per_rank": {}, "per_object_group": {}}


def resp_inventory(port: int, host: str = REDIS_HOST, with_keys: bool = False) -> dict[str, Any]:
    """Objects of a resp tier: their count and value bytes (STRLEN), per rank and object
    group, as ``folder_inventory`` reports an fs folder; ``with_keys`` adds ``keys``:
    {key: bytes}. Keys that are not lmcache objects are left out; ``dbsize`` counts all."""
    out = empty_inventory()
    keys: dict[str, int] = {}
    with RespClient(port, host) as client:
        out["dbsize"] = int(client.command("DBSIZE"))
        cursor = "0"
        while True:
            cursor_raw, batch = client.command("SCAN", cursor, "COUNT", 1000)
            for raw in batch:
                name = raw.decode(errors="replace")
                meta = parse_object_key(name)
                if meta is None:
                    continue
                try:
                    size = int(client.command("STRLEN", raw))
                except RespError:  # not a string value
                    continue
                if size == 0:  # expired or evicted since the SCAN
                    continue
                tally(out, meta, size)
                if with_keys:
                    keys[name] = size
            cursor = cursor_raw.decode()
            if cursor == "0":
                break
    if with_keys:
        out["keys"] = keys
    return out


def parse_file_name(name: str) -> dict[str, Any] | None:
    """``<model>@0x<kv_rank>@<og hex>@<chunk hash>[@salt].data`` (the fs and fs_native
    adapters' files): the key's fields but the model."""
    meta = parse_object_key(name[: -len(".data")]) if name.endswith(".data") else None
    return {k: v for k, v in meta.items() if k != "model"} if meta is not None else None


def folder_inventory(root: Path, with_files: bool = False) -> dict[str, Any]:
    """Objects (complete ``.data`` files) in an fs L2 folder; ``with_files`` adds
    ``files``: {path relative to root: size} (load.py compares these across restarts)."""
    out = empty_inventory()
    names: dict[str, int] = {}
    for p in Path(root).rglob("*"):
        try:
            meta = parse_file_name(p.name) if p.is_file() else None
            size = p.stat().st_size if meta is not None else 0
        except FileNotFoundError:  # renamed or removed by a live server meanwhile
            continue
        if meta is not None:
            tally(out, meta, size)
            names[str(p.relative_to(root))] = size
    return {**out, "files": names} if with_files else out


REDIS_URL = "redis://"


def redis_url(port: int, host: str = REDIS_HOST) -> str:
    """A resp tier as one string (engine specs are JSON): ``redis://host:port``."""
    return f"{REDIS_URL}{host}:{port}"


def tier_inventory(tier: str | Path) -> dict[str, Any]:
    """Objects of an L2 tier: an fs or fs_native folder, or ``redis_url``'s string."""
    text = str(tier)
    if text.startswith(REDIS_URL):
        host, port = text[len(REDIS_URL) :].rsplit(":", 1)
        return resp_inventory(int(port), host)
    return folder_inventory(Path(text))


def wait_l2_stable(
    tier: str | Path,
    min_objects: int,
    timeout: float = 90.0,
    quiet: float = 3.0,
    server_log: Path | None = None,
) -> dict[str, Any]:
    """Wait until the L2 tier (``l2.tier_inventory``) holds >= min_objects and stops changing
    for ``quiet`` s; give up early once it is quiet and ``server_log`` shows failed stores
    (pristine 0.5.3 under HND fails every store): the missing objects will never come."""
    deadline = time.monotonic() + timeout
    last, since = tier_inventory(tier), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        inv = tier_inventory(tier)
        if (inv["objects"], inv["bytes"]) != (last["objects"], last["bytes"]):
            last, since = inv, time.monotonic()
        elif time.monotonic() - since >= quiet:
            if inv["objects"] >= min_objects:
                return {**inv, "stable": True}
            log = (
                server_log.read_text(errors="replace") if server_log and server_log.exists() else ""
            )
            if failed := log.count(STORE_FAILED):
                return {**inv, "stable": False, "store_failures": failed}
    return {**last, "stable": False}


# ---------------------------------------------------------------------------------------
# A throwaway redis-server


class RedisServer:
    """A redis-server on 127.0.0.1:``port`` in its own folder, without persistence (no
    RDB snapshots, no AOF); ``maxmemory`` with ``allkeys-lru`` when given. ``stop`` ends
    it; ``kill`` SIGKILLs it; ``start`` again serves the same port, empty."""

    def __init__(
        self,
        binary: str | None = None,
        port: int | None = None,
        workdir: Path | None = None,
        maxmemory: str | None = None,
        maxmemory_policy: str = "allkeys-lru",
    ) -> None:
        found = binary or redis_server_binary()
        if found is None:
            raise FileNotFoundError("redis-server not found ($REDIS_SERVER or PATH)")
        self.binary = found
        self.port = port or free_port()
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="hybridfa-redis-"))
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.workdir / "redis.log"

    def argv(self) -> list[str]:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", REDIS_HOST,
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", str(self.log),
        ]  # fmt: skip
        if self.maxmemory is not None:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", self.maxmemory_policy]
        return args

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(  # noqa: S603 - our own argv
            self.argv(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited rc={self.proc.returncode}: {self._log_tail()}"
                )
            if self.ping():
                return self
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server did not answer on {self.port} in {timeout}s")

    def ping(self) -> bool:
        try:
            with RespClient(self.port, timeout=0.5) as client:
                return client.command("PING") == "PONG"
        except (OSError, ConnectionError):
            return False

    def client(self) -> RespClient:
        return RespClient(self.port)

    def inventory(self, with_keys: bool = False) -> dict[str, Any]:
        return resp_inventory(self.port, with_keys=with_keys)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (redis exits without saving when persistence is off), then wait."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self.proc = None

    def kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
