"""Any cache_salt vLLM accepts is served, and none is written in clear (0.5.6 base).

vLLM accepts any non-empty cache_salt. LMCache 0.5.6's ``IPCCacheServerKey`` still
refuses one holding '/', '@', '\\', NUL or more than 128 characters with a ValueError,
raised in the connector's lookup inside vLLM's Scheduler.schedule(): the engine core
died for every tenant. And the salt was written in clear into every L2 object's name.
The connector sends a digest of the salt instead.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.bases("0.5.6")

pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_l2_adapter")

from request_keys_056 import CHUNKS, KeyedEngine  # noqa: E402

TENANT = "tenant-7f3"
SALTS = {
    "plain": TENANT,
    "slash": f"{TENANT}/a",
    "at": f"{TENANT}@b",
    "backslash": f"{TENANT}\\c",
    "nul": f"{TENANT}\x00d",
    "long": TENANT + "x" * 200,
}


@pytest.fixture
def engine(monkeypatch) -> KeyedEngine:
    return KeyedEngine(monkeypatch)


def salted_hit(engine: KeyedEngine, salt: str) -> int:
    """Store a prompt under ``salt``, then look it up again under it."""
    try:
        engine.store(engine.request("a", cache_salt=salt))
        return engine.hit(engine.request("b", cache_salt=salt))
    except ValueError as e:
        pytest.fail(f"cache_salt {salt!r} raised inside vLLM's scheduler: {e}")


@pytest.mark.fix
@pytest.mark.parametrize("salt", list(SALTS.values()), ids=list(SALTS))
def test_any_salt_is_served_and_never_written_in_clear(engine, salt):
    assert salted_hit(engine, salt) == CHUNKS
    names = engine.lookups.l2_names
    assert names and not any(TENANT in n for n in names), (
        f"the cache_salt is written in clear in L2 object names: {names}"
    )


def test_a_salted_prompt_misses_for_another_salt_and_for_none(engine):
    assert salted_hit(engine, TENANT) == CHUNKS
    assert engine.hit(engine.request("other", cache_salt=f"{TENANT}!")) == 0
    assert engine.hit(engine.request("none")) == 0


def test_an_unsalted_prompt_keeps_pristine_keys(engine):
    engine.store(engine.request("a"))
    assert engine.hit(engine.request("b")) == CHUNKS
    assert all(n.count("@") == 3 for n in engine.lookups.l2_names)


@pytest.mark.feature
def test_a_salt_that_is_not_valid_utf8_is_served(engine):
    """JSON may carry a lone surrogate, which Python cannot encode as UTF-8."""
    assert salted_hit(engine, "\ud800" + TENANT) == CHUNKS
