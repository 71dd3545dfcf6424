# SPDX-License-Identifier: Apache-2.0
"""The ``resp`` L2 adapter's Redis/Valkey client.

It serves ``NativeConnectorL2Adapter`` through the interface of LMCache's C++ clients
(``event_fd``, ``submit_batch_*``, ``drain_completions``, ``close``), over RESP2 with
one connection per worker thread, and differs from LMCache's C++ ``LMCacheRedisClient``
where that one could stop serving:

- it parses every reply: a key gone since its lookup (evicted, expired, flushed:
  ``$-1``), a value of another size, an error reply (``-OOM ...``) is a miss or a failed
  store of that key, and the connection stays in step. The C++ client read the reply of
  a GET as the expected size header, so it waited forever for the bytes a ``$-1`` lacks,
  and after as many such keys as it had workers every later L2 request of the server
  waited too;
- a reply that does not come within ``timeout_s`` (a Redis that stopped answering) fails
  its key and drops the connection instead of blocking the worker;
- a worker reconnects after a failure (a Redis restart), where the C++ client connected
  each worker once, at start, and never again;
- each value is the object's bytes followed by their tag (``tier_secret``: keyed by the
  L2 tier's secret, over the Redis key and the bytes), checked on load: whoever can
  write to Redis cannot change what is restored. A value whose tag does not verify
  (forged, written under another secret or by a build without tags, another key's value)
  is a miss, logged;
- it speaks TLS when given an ``ssl.SSLContext``.

Payloads travel without a copy: a SET sends the object's buffer, a GET receives into it.
"""

from __future__ import annotations

import hmac
import queue
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any

from lmcache.logging import init_logger
from lmcache.v1.distributed.l2_adapters.tier_secret import TAG_LEN, object_tag
from lmcache.v1.platform import create_event_notifier

logger = init_logger(__name__)

Completion = tuple[int, bool, str, "list[bool] | None"]

_MAX_LINE = 1 << 20
_RECV_LINE = 4096
_MAX_REJECTED = 4096  # rejected keys remembered, to log each once and not store it back


class RespError(Exception):
    """An error reply of the server (``-ERR ...``); the connection stays usable."""


class ProtocolError(OSError):
    """A reply that is not what the command returns; the connection is dropped."""


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def _command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(_bulk(a) for a in args)


class _Conn:
    """One RESP2 connection."""

    def __init__(
        self,
        host: str,
        port: int,
        timeout_s: float,
        username: str = "",
        password: str = "",
        tls: ssl.SSLContext | None = None,
    ) -> None:
        sock = socket.create_connection((host, port), timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            try:
                sock = tls.wrap_socket(sock, server_hostname=host)
            except BaseException:
                sock.close()
                raise
        self.sock = sock
        self._rbuf = bytearray()
        if password:
            user = [username.encode()] if username else []
            self.call(b"AUTH", *user, password.encode())

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def send(self, *parts: bytes | memoryview) -> None:
        for part in parts:
            self.sock.sendall(part)

    def read_line(self) -> bytes:
        while True:
            end = self._rbuf.find(b"\r\n")
            if end >= 0:
                line = bytes(self._rbuf[:end])
                del self._rbuf[: end + 2]
                return line
            if len(self._rbuf) > _MAX_LINE:
                raise ProtocolError("a reply line over 1 MiB")
            self._recv_more()

    def read_into(self, view: memoryview) -> None:
        have = min(len(self._rbuf), len(view))
        view[:have] = self._rbuf[:have]
        del self._rbuf[:have]
        while have < len(view):
            n = self.sock.recv_into(view[have:])
            if n == 0:
                raise ConnectionError("redis closed the connection")
            have += n

    def read_exact(self, n: int) -> bytes:
        while len(self._rbuf) < n:
            self._recv_more()
        data = bytes(self._rbuf[:n])
        del self._rbuf[:n]
        return data

    def skip(self, n: int) -> None:
        while n > 0:
            if not self._rbuf:
                self._recv_more()
            k = min(n, len(self._rbuf))
            del self._rbuf[:k]
            n -= k

    def _recv_more(self) -> None:
        chunk = self.sock.recv(_RECV_LINE)
        if not chunk:
            raise ConnectionError("redis closed the connection")
        self._rbuf += chunk

    def reply(self) -> Any:
        """One reply: str (simple string), int, bytes or None (bulk string)."""
        line = self.read_line()
        kind, body = line[:1], line[1:]
        if kind == b"+":
            return body.decode(errors="replace")
        if kind == b"-":
            raise RespError(body.decode(errors="replace"))
        if kind == b":":
            return int(body)
        if kind == b"$":
            n = int(body)
            if n < 0:
                return None
            data = self.read_exact(n + 2)
            return data[:-2]
        raise ProtocolError(f"unexpected reply {line[:40]!r}")

    def call(self, *args: bytes) -> Any:
        self.send(_command(*args))
        return self.reply()


class _Batch:
    def __init__(
        self, future_id: int, num_keys: int, num_tiles: int, per_key: bool
    ) -> None:
        self.future_id = future_id
        self.tiles_left = num_tiles
        self.results: list[bool] | None = [False] * num_keys if per_key else None
        self.ok = True
        self.error = ""


class _WorkerState:
    def __init__(self) -> None:
        self.conn: _Conn | None = None
        self.failing = (
            False  # a request failed since the last that succeeded: logged once
        )


class RespClient:
    """``NativeConnectorL2Adapter``'s native client, on Redis/Valkey at host:port."""

    def __init__(
        self,
        host: str,
        port: int,
        num_workers: int,
        username: str = "",
        password: str = "",
        timeout_s: float = 10.0,
        *,
        tag_key: bytes,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        if num_workers <= 0:
            raise ValueError("num_workers must be > 0")
        self._tag_key = tag_key
        self._tls = tls
        # Keys whose value failed its check, each with the tag its rejected bytes
        # would carry (None: a value of another size). Guarded by _lock.
        self._rejected: dict[str, bytes | None] = {}
        self._host = host
        self._port = port
        self._num_workers = num_workers
        self._username = username
        self._password = password
        self._timeout_s = timeout_s
        self._notifier = create_event_notifier()
        self._lock = threading.Lock()
        self._completions: list[Completion] = []
        self._next_future_id = 1
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._conns: set[_Conn] = set()
        self._closed = False
        self._workers = [
            threading.Thread(target=self._worker, name=f"resp-l2-{i}", daemon=True)
            for i in range(num_workers)
        ]
        for worker in self._workers:
            worker.start()

    # -- what the adapter calls ------------------------------------------------

    def check(self) -> None:
        """Connect (and authenticate) once and PING; raises what went wrong."""
        conn = self._connect()
        try:
            reply = conn.call(b"PING")
            if reply != "PONG":
                raise ProtocolError(f"PING answered {reply!r}")
        finally:
            conn.close()

    def event_fd(self) -> int:
        return self._notifier.fileno()

    def submit_batch_get(self, keys: list[str], memoryviews: list[Any]) -> int:
        return self._submit(self._get, keys, memoryviews, per_key=True)

    def submit_batch_set(self, keys: list[str], memoryviews: list[Any]) -> int:
        return self._submit(self._set, keys, memoryviews, per_key=False)

    def submit_batch_exists(self, keys: list[str]) -> int:
        return self._submit(self._exists, keys, None, per_key=True)

    def submit_batch_delete(self, keys: list[str]) -> int:
        return self._submit(self._delete, keys, None, per_key=True)

    def drain_completions(self) -> list[Completion]:
        self._notifier.consume()
        with self._lock:
            done, self._completions = self._completions, []
        return done

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        for _ in self._workers:
            self._requests.put(None)
        for conn in conns:  # a worker waiting on a reply returns now
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for worker in self._workers:
            worker.join(timeout=5)
        self._notifier.close()

    # -- submission and completion ---------------------------------------------

    def _submit(
        self,
        op: Callable[[_Conn, str, Any], bool],
        keys: list[str],
        views: list[Any] | None,
        per_key: bool,
    ) -> int:
        if not keys:
            raise RuntimeError("keys list is empty")
        if views is not None and len(views) != len(keys):
            raise RuntimeError("keys and memoryviews size mismatch")
        # One view of each buffer, in bytes: MemoryObj.byte_array is ctypes-backed
        # (format "<B"), which socket and hashing calls would not all take.
        bufs = [memoryview(v).cast("B") for v in views] if views is not None else None
        num_tiles = min(self._num_workers, len(keys))
        tile = -(-len(keys) // num_tiles)
        with self._lock:
            future_id = self._next_future_id
            self._next_future_id += 1
        batch = _Batch(future_id, len(keys), -(-len(keys) // tile), per_key)
        for start in range(0, len(keys), tile):
            end = min(start + tile, len(keys))
            part = bufs[start:end] if bufs is not None else None
            self._requests.put((op, batch, start, keys[start:end], part))
        return future_id

    def _finish(self, batch: _Batch, ok: bool, error: str) -> None:
        with self._lock:
            if not ok and batch.ok:
                batch.ok, batch.error = False, error
            batch.tiles_left -= 1
            if batch.tiles_left:
                return
            self._completions.append(
                (batch.future_id, batch.ok, batch.error, batch.results)
            )
        self._notifier.notify()

    # -- the workers -------------------------------------------------------------

    def _connect(self) -> _Conn:
        return _Conn(
            self._host,
            self._port,
            self._timeout_s,
            self._username,
            self._password,
            self._tls,
        )

    def _worker(self) -> None:
        state = _WorkerState()
        while (request := self._requests.get()) is not None:
            op, batch, start, keys, bufs = request
            ok, error = True, ""
            for i, key in enumerate(keys):
                try:
                    done = self._one(
                        state, op, key, bufs[i] if bufs is not None else None
                    )
                except (RespError, OSError, ValueError) as e:
                    done, ok, error = False, False, f"{key}: {e!r}"
                    if not isinstance(e, RespError):
                        # No reply in time, a closed or confused connection: the next
                        # key starts on a fresh one.
                        self._drop(state)
                    if not state.failing and not self._closed:
                        logger.warning(
                            "RESP L2 adapter: %s:%d: %r (on %s); requests fail "
                            "(a miss, no "
                            "store) until it serves again",
                            self._host,
                            self._port,
                            e,
                            key,
                        )
                    state.failing = True
                else:
                    if state.failing:
                        state.failing = False
                        logger.info(
                            "RESP L2 adapter: %s:%d serves again",
                            self._host,
                            self._port,
                        )
                if batch.results is not None:
                    batch.results[start + i] = done
                elif not done:
                    ok = False
            self._finish(batch, ok, error)
        self._drop(state)

    def _one(
        self,
        state: _WorkerState,
        op: Callable[[_Conn, str, Any], bool],
        key: str,
        buf: Any,
    ) -> bool:
        fresh = state.conn is None
        if state.conn is None:
            state.conn = self._connect_tracked()
        try:
            return op(state.conn, key, buf)
        except ConnectionError:
            if fresh:
                raise
        # A connection that served before was closed since (a Redis restart, its idle
        # timeout): once more, on a fresh one.
        self._drop(state)
        state.conn = self._connect_tracked()
        return op(state.conn, key, buf)

    def _connect_tracked(self) -> _Conn:
        if self._closed:
            raise ConnectionError("client closed")
        conn = self._connect()
        with self._lock:
            if self._closed:
                conn.close()
                raise ConnectionError("client closed")
            self._conns.add(conn)
        return conn

    def _drop(self, state: _WorkerState) -> None:
        if state.conn is not None:
            with self._lock:
                self._conns.discard(state.conn)
            state.conn.close()
            state.conn = None

    # -- one key -----------------------------------------------------------------

    def _get(self, conn: _Conn, key: str, buf: memoryview) -> bool:
        conn.send(_command(b"GET", key.encode()))
        line = conn.read_line()
        if line == b"$-1":  # gone since its lookup: evicted, expired, deleted
            logger.debug("RESP L2 adapter: %s is gone", key)
            return False
        if line[:1] == b"-":
            raise RespError(line[1:].decode(errors="replace"))
        if line[:1] != b"$":
            raise ProtocolError(f"GET answered {line[:40]!r}")
        size = int(line[1:])
        if size != len(buf) + TAG_LEN:
            conn.skip(size + 2)
            self._reject(key, len(buf), f"{size} bytes, not {len(buf)} and a tag", None)
            return False
        conn.read_into(buf)
        tail = conn.read_exact(TAG_LEN + 2)
        if tail[TAG_LEN:] != b"\r\n":
            raise ProtocolError("GET: no CRLF after the value")
        expected = object_tag(self._tag_key, key, buf)
        if not hmac.compare_digest(tail[:TAG_LEN], expected):
            why = "tag mismatch: forged, or written under another secret"
            self._reject(key, len(buf), why, expected)
            return False
        return True

    def _reject(self, key: str, size: int, why: str, tag: bytes | None) -> None:
        """A value that failed its check is a miss; the next store of its key
        replaces it with other bytes: *tag* is the one the rejected bytes would
        carry, which no store of this client may write."""
        with self._lock:
            known = key in self._rejected
            if not known and len(self._rejected) >= _MAX_REJECTED:
                self._rejected.clear()
            if tag is not None or not known:
                self._rejected[key] = tag
            if known:
                return
        logger.warning(
            "RESP L2 adapter: %s is not an authentic %d-byte object (%s); "
            "it is a miss. "
            "Servers that share this Redis need the same L2 tier secret.",
            key,
            size,
            why,
        )

    def _set(self, conn: _Conn, key: str, buf: memoryview) -> bool:
        tag = object_tag(self._tag_key, key, buf)
        with self._lock:
            rejected = self._rejected.get(key)
        if rejected is not None and hmac.compare_digest(rejected, tag):
            logger.error(
                "RESP L2 adapter: not storing %s: its bytes are the ones this server "
                "rejected on load",
                key,
            )
            return False
        conn.send(
            b"*3\r\n$3\r\nSET\r\n"
            + _bulk(key.encode())
            + b"$%d\r\n" % (len(buf) + TAG_LEN),
            buf,
            tag + b"\r\n",
        )
        reply = conn.reply()
        if reply != "OK":
            raise ProtocolError(f"SET answered {reply!r}")
        with self._lock:
            self._rejected.pop(key, None)
        return True

    def _exists(self, conn: _Conn, key: str, _buf: None) -> bool:
        return _count(conn.call(b"EXISTS", key.encode())) > 0

    def _delete(self, conn: _Conn, key: str, _buf: None) -> bool:
        return _count(conn.call(b"DEL", key.encode())) > 0


def _count(reply: Any) -> int:
    if not isinstance(reply, int):
        raise ProtocolError(f"expected an integer reply, got {reply!r}")
    return reply
