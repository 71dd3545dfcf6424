"""The fs L2 adapter warns of a hybrid model's objects of other layouts; a purge removes them.

A layout namespace (``<model>~hfa-<fingerprint>``) never reads objects written under
another fingerprint or none: after an upgrade they take space until eviction reaches them.
On the first lookup of a namespaced model the adapter warns once per foreign layout,
naming the purge command, which removes only the stale objects.

Real FSL2Adapter on tmp_path; keys named by the real layout namespace registry.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest

pytestmark = [pytest.mark.bases("0.5.6"), pytest.mark.feature]

pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_layout_purge")

from fs_l2_driver import arm_env, lookup, open_adapter, store  # noqa: E402

MODEL = "hybrid"
FINGERPRINT = "0123456789abcdef"
HASHES = [bytes([i]) * 16 for i in range(1, 4)]
PAYLOAD = bytes(range(256)) * 64


def keys(model_name: str, hashes: list[bytes]) -> list[Any]:
    from lmcache.v1.distributed.api import ObjectKey

    return [ObjectKey(chunk_hash=h, model_name=model_name, kv_rank=0) for h in hashes]


@pytest.fixture
def live_name() -> Any:
    """MODEL's object-key name once the server registered its hybrid layout."""
    from lmcache.v1.distributed.layout_namespace import (
        namespaced_model_name,
        set_layout_namespace,
    )

    set_layout_namespace(MODEL, 1, FINGERPRINT)
    try:
        yield namespaced_model_name(MODEL, 1)
    finally:
        set_layout_namespace(MODEL, 1, None)


class _Recorder:
    """Stands in for the fs adapter module's logger; keeps the warnings."""

    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warning(self, msg: str, *args: object) -> None:
        self.warnings.append(msg % args if args else msg)

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def test_one_warning_per_foreign_layout(adapter, live_name, monkeypatch):
    from lmcache.v1.distributed.l2_adapters import fs_l2_adapter

    store(adapter, keys(MODEL, HASHES), [PAYLOAD] * len(HASHES))  # pristine 0.5.6's names
    recorder = _Recorder()
    monkeypatch.setattr(fs_l2_adapter, "logger", recorder)

    for _ in range(3):
        assert lookup(adapter, keys(live_name, HASHES), {}) == [False] * len(HASHES)
    deadline = time.monotonic() + 5.0
    while not recorder.warnings and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # a second warning, if any, would come from the same scan

    foreign = [w for w in recorder.warnings if "another KV layout" in w]
    assert len(foreign) == 1, f"expected one foreign-layout warning, got {recorder.warnings}"
    assert f"{len(HASHES)} objects of model {MODEL}" in foreign[0]
    assert f"--keep {FINGERPRINT} --delete --include-unnamespaced" in foreign[0]


def test_purge_command_removes_only_the_stale_objects(tmp_path, live_name):
    base = tmp_path / "l2"
    adp = open_adapter(base)
    try:
        store(adp, keys(MODEL, HASHES), [PAYLOAD] * len(HASHES))
        store(adp, keys(f"{MODEL}~hfa-fedcba9876543210", HASHES), [PAYLOAD] * len(HASHES))
        store(adp, keys(live_name, HASHES[:1]), [PAYLOAD])
    finally:
        adp.close()
    an_hour_ago = time.time() - 3600  # not a layout a live server may be writing
    for path in base.glob("*.data"):
        os.utime(path, (an_hour_ago, an_hour_ago))

    cmd = [sys.executable, "-m", "lmcache.v1.distributed.l2_adapters.fs_layout_purge"]
    args = [str(base), "--model", MODEL, "--keep", FINGERPRINT, "--include-unnamespaced"]
    run: dict[str, Any] = {"capture_output": True, "text": True, "env": arm_env(), "cwd": tmp_path}
    dry = subprocess.run(cmd + args, **run)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert len(list(base.glob("*.data"))) == 2 * len(HASHES) + 1, "a dry run removed files"

    real = subprocess.run(cmd + args + ["--delete"], **run)
    assert real.returncode == 0, real.stderr[-2000:]
    (left,) = base.glob("*.data")
    assert left.name.startswith(f"{live_name}@")
    assert left.stat().st_size == len(PAYLOAD) + 40, "the live object lost its trailer"
