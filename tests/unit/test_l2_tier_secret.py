"""The L2 tier's secret file: created on the first start, readable by its owner alone;
a server refuses to start, naming the cause, on one it cannot trust or read.

Real FSL2Adapter on tmp_path (the resp adapter reads the same file through the same
code: test_l2_resp_authenticity.py).
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_l2_adapter")

from fs_l2_driver import open_adapter  # noqa: E402

pytestmark = [pytest.mark.feature, pytest.mark.bases("0.5.3", "0.5.6")]


def start(tmp_path: Path, secret: Path) -> None:
    open_adapter(tmp_path / "l2", secret_file=str(secret)).close()


def refusal(tmp_path: Path, secret: Path) -> str:
    from lmcache.v1.distributed.l2_adapters.tier_secret import TierSecretError

    with pytest.raises(TierSecretError) as refused:
        start(tmp_path, secret)
    assert str(secret) in str(refused.value)
    return str(refused.value)


def test_the_first_start_creates_the_secret_readable_by_its_owner_only(tmp_path):
    secret = tmp_path / "keys" / "l2-tier.key"
    start(tmp_path, secret)
    mode = stat.S_IMODE(secret.stat().st_mode)
    assert mode == 0o600, f"created with mode {mode:04o}"
    assert len(bytes.fromhex(secret.read_text().strip())) == 32
    before = secret.read_text()
    start(tmp_path, secret)
    assert secret.read_text() == before, "a second start replaced the secret"


def test_by_default_the_secret_is_in_the_user_config_folder(tmp_path, tier_secret_home):
    open_adapter(tmp_path / "l2").close()
    secret = tier_secret_home / "lmcache" / "l2-tier.key"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    "mode", [0o640, 0o604, 0o620], ids=["group-read", "other-read", "group-write"]
)
def test_a_secret_others_can_access_refuses_the_start(mode, tmp_path):
    secret = tmp_path / "l2-tier.key"
    start(tmp_path, secret)
    secret.chmod(mode)
    assert "chmod 600" in refusal(tmp_path, secret)


def test_a_malformed_secret_refuses_the_start(tmp_path):
    secret = tmp_path / "l2-tier.key"
    secret.write_text("not a secret\n")
    secret.chmod(0o600)
    assert "64 hex digits" in refusal(tmp_path, secret)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give the file to another user")
def test_a_secret_of_another_user_refuses_the_start(tmp_path):
    secret = tmp_path / "l2-tier.key"
    start(tmp_path, secret)
    os.chown(secret, 65534, -1)
    assert "owned by uid 65534" in refusal(tmp_path, secret)


UNPRIVILEGED = 65534  # nobody


def in_child_as(uid: int, run: Callable[[], str]) -> str:
    """``run()`` in a forked child that has dropped to ``uid`` (its groups too): what it
    returned, or the exception it raised. The modules it needs are imported already."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            answer = run()
        except BaseException as e:  # reported to the parent
            answer = f"raised {type(e).__name__}: {e}"
        os.write(write, answer.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        answer = pipe.read()
    os.waitpid(pid, 0)
    return answer


def test_an_unreadable_secret_refuses_the_start():
    """Root reads a file of mode 0000: under root the start runs in a child that drops to
    an unprivileged uid, owner of the folder and the file (in the system's temp folder,
    which any uid can walk). Any other user runs it directly."""
    as_root = os.geteuid() == 0
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        secret = folder / "l2-tier.key"
        start(folder, secret)
        secret.chmod(0)
        if as_root:
            for path in [folder, *folder.rglob("*")]:
                os.chown(path, UNPRIVILEGED, UNPRIVILEGED)
            answer = in_child_as(UNPRIVILEGED, lambda: refusal(folder, secret))
        else:
            answer = refusal(folder, secret)
    assert "cannot read" in answer, answer


def test_a_secret_that_cannot_be_created_refuses_the_start(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert "cannot create" in refusal(tmp_path, blocker / "l2-tier.key")
