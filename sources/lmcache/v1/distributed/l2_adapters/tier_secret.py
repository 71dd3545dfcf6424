# SPDX-License-Identifier: Apache-2.0
"""The L2 tier's secret.

Whoever can write an L2 tier (the fs adapter's folder, the Redis a ``resp`` adapter
talks to) could otherwise replace what a server restores. Every object the ``fs`` and
``resp`` adapters store therefore carries a tag: blake3 in keyed mode over the object's
name and bytes, under a key derived from a per-deployment secret. An object whose tag
does not verify (forged, damaged, written under another secret or by a build without
the tag) is a miss.

The secret is a file of 64 hex digits, owned by the server's user and readable by it
alone (mode 0600). Its path is the adapter config key ``secret_file``, by default
``$XDG_CONFIG_HOME/lmcache/l2-tier.key`` (``~/.config/lmcache/l2-tier.key``). A server
creates it on its first start when it does not exist, and refuses to start when it
exists but is not the server user's alone, or cannot be read. Servers sharing one tier
need the same secret: copy the file (mode 0600) to each of them before they start, or
point their ``secret_file`` at one copy.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path

import blake3
from lmcache.logging import init_logger

logger = init_logger(__name__)

TAG_LEN = 32
_SECRET_LEN = 32
_CONTEXT = "lmcache-hybridfa 2026-12 L2 object tag, adapter {}"

Buffer = bytearray | memoryview | bytes


class TierSecretError(RuntimeError):
    """The tier secret's file cannot be used; the message names the cause."""


def default_secret_file() -> Path:
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config_home) / "lmcache" / "l2-tier.key"


def load_or_create(path: str | Path | None = None) -> bytes:
    """The secret in *path* (default :func:`default_secret_file`), created there, mode
    0600, when no file exists."""
    path = Path(path) if path else default_secret_file()
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        if path.is_symlink():
            raise TierSecretError(
                f"L2 tier secret {path} is a symbolic link to {os.readlink(path)}, "
                "which "
                "does not exist: point it at the tier's secret file, or remove it to "
                "create a new secret"
            ) from None
        _create(path)
        st = path.stat()
    except OSError as e:
        raise TierSecretError(f"L2 tier secret {path}: cannot stat it ({e})") from e
    if not stat.S_ISREG(st.st_mode):
        raise TierSecretError(f"L2 tier secret {path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise TierSecretError(
            f"L2 tier secret {path} is owned by uid {st.st_uid}, not by this server's "
            f"user (uid {os.geteuid()}): chown it"
        )
    if st.st_mode & 0o077:
        raise TierSecretError(
            f"L2 tier secret {path} is accessible by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):04o}): chmod 600 it, and replace it on every "
            "server of the tier if others could have read it"
        )
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise TierSecretError(f"L2 tier secret {path}: cannot read it ({e})") from e
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) != _SECRET_LEN:
        raise TierSecretError(
            f"L2 tier secret {path} does not hold {2 * _SECRET_LEN} hex digits"
        )
    return secret


def _create(path: Path) -> None:
    """Write a new secret to *path*, complete or not at all: another server starting
    at the same time keeps whichever file appeared first."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # A name no earlier start can have left behind (mode 0600).
        fd, name = tempfile.mkstemp(
            prefix=f".{path.name}.", suffix=".tmp", dir=path.parent
        )
        tmp = Path(name)
        try:
            os.write(fd, (secrets.token_bytes(_SECRET_LEN).hex() + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return
        finally:
            tmp.unlink()
    except OSError as e:
        raise TierSecretError(f"L2 tier secret {path}: cannot create it ({e})") from e
    logger.warning(
        "Created the L2 tier secret %s. Every server that shares this L2 tier needs a "
        "copy of it (mode 0600): objects stored under another secret are a miss.",
        path,
    )


def adapter_key(secret: bytes, adapter: str) -> bytes:
    """The tag key of one adapter type, derived from the tier secret."""
    return blake3.blake3(secret, derive_key_context=_CONTEXT.format(adapter)).digest()


def object_tag(key: bytes, name: str, payload: Buffer) -> bytes:
    """The tag of *payload* stored under *name*."""
    encoded = name.encode()
    hasher = blake3.blake3(len(encoded).to_bytes(4, "little") + encoded, key=key)
    # MemoryObj.byte_array is a ctypes-backed view (format "<B"), which blake3
    # refuses; a byte cast of the same memory is accepted and copies nothing.
    hasher.update(memoryview(payload).cast("B"))
    return hasher.digest()
