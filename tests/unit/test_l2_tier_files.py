"""The fs tier's files: private to the server's user, and a secret file that a crashed or
misdirected start cannot turn into a bare error.

Cached KV reveals prompts. Pristine LMCache creates the fs folder 0755 and its objects
0644 (under the usual umask 022): every user of the host reads them. Here the folder is
0700 and each object 0600, and a folder others can read is named in a warning at start.
A secret file that is a dangling symbolic link raised a bare FileNotFoundError, and a
temporary file left by a crashed first start blocked every later first start that got
the same pid.

Real FSL2Adapter on tmp_path.
"""

from __future__ import annotations

import os
import random
import stat
from pathlib import Path

import pytest

pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_l2_adapter")

from fs_l2_driver import open_adapter, store  # noqa: E402
from log_recorder import Recorder  # noqa: E402

pytestmark = pytest.mark.bases("0.5.3", "0.5.6")


def key() -> object:
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk_hash=b"\x09" * 32, model_name="m", kv_rank=0)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.fix
def test_the_folder_and_its_objects_are_the_server_user_s_alone(tmp_path):
    old = os.umask(0o022)
    try:
        adapter = open_adapter(tmp_path / "l2")
        try:
            store(adapter, [key()], [random.Random(1).randbytes(4096)])
        finally:
            adapter.close()
    finally:
        os.umask(old)
    (obj,) = (tmp_path / "l2").glob("*.data")
    assert mode(tmp_path / "l2") == 0o700, f"the folder is {mode(tmp_path / 'l2'):04o}"
    assert mode(obj) == 0o600, f"an object is {mode(obj):04o}"


@pytest.mark.feature
def test_a_folder_others_can_read_is_named_at_start(tmp_path, monkeypatch):
    from lmcache.v1.distributed.l2_adapters import fs_l2_adapter

    folder = tmp_path / "l2"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    recorder = Recorder()
    monkeypatch.setattr(fs_l2_adapter, "logger", recorder)
    open_adapter(folder).close()
    assert any(str(folder) in w and "chmod 700" in w for w in recorder.warnings)


@pytest.mark.feature
def test_a_secret_file_that_is_a_dangling_link_refuses_the_start_naming_it(tmp_path):
    from lmcache.v1.distributed.l2_adapters.tier_secret import TierSecretError

    secret = tmp_path / "l2-tier.key"
    secret.symlink_to(tmp_path / "elsewhere" / "l2-tier.key")
    with pytest.raises(TierSecretError) as refused:
        open_adapter(tmp_path / "l2", secret_file=str(secret)).close()
    assert str(secret) in str(refused.value) and "symbolic link" in str(refused.value)


@pytest.mark.feature
def test_a_temporary_file_of_a_crashed_first_start_blocks_no_later_one(tmp_path):
    secret = tmp_path / "l2-tier.key"
    (tmp_path / f".{secret.name}.{os.getpid()}.tmp").write_text("left by a crash\n")
    open_adapter(tmp_path / "l2", secret_file=str(secret)).close()
    assert len(secret.read_text().strip()) == 64
