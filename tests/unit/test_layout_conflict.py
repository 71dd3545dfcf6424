"""Two engines of one served model name on one LMCache server.

The server keys a model's objects by (model_name, world_size), so engines of one model
name with different layouts (MTP 0 and MTP 1 change the conv-state length, not the
object size) cannot be told apart by their keys: the one that registers second would
restore the first one's pages into its own geometry. While such instances are
registered the server stores nothing for the model and every lookup misses; engines of
one layout share their hits. Each test drives one whole CPU server (restore_server)
with a second engine instance registered beside the first.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("vllm.v1.kv_cache_interface")
pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_l2_adapter")

from hybrid_kv import GDNState, build_hybrid_kv  # noqa: E402
from restore_server import (  # noqa: E402
    BLOCKS,
    MODEL,
    NUM_BLOCKS,
    PAGE,
    N,
    RealServer,
    restore_ids,
    restore_through,
    store_ids,
    tokens,
)

MTP0, MTP1 = GDNState(), GDNState(spec_tokens=1)


def engine_kv(gdn: GDNState, seed: int) -> object:
    return build_hybrid_kv(N, PAGE, "NHD", NUM_BLOCKS, seed=seed, gdn=gdn)


def start(real_servers, tmp_path, gdn: GDNState = MTP0) -> RealServer:
    return real_servers(engine_kv(gdn, seed=0), N, tmp_path / "l2", False)


@pytest.mark.fix
@pytest.mark.parametrize("a_stores_first", [True, False], ids=["before-B", "after-B"])
def test_an_engine_of_another_layout_never_restores_the_pages_of_the_first(
    real_servers, tmp_path, a_stores_first
):
    a = start(real_servers, tmp_path, MTP0)
    if a_stores_first:
        a.store("a", tokens(), store_ids())
    b = a.add_engine(engine_kv(MTP1, seed=1), instance=2)
    if not a_stores_first:
        a.store("a", tokens(), store_ids())
    # A hit would copy MTP 0's pages into MTP 1's conv-state geometry: wrong state
    # even where every byte is copied.
    assert b.lookup("b", tokens()[:-1]) == 0, (
        "an engine of MTP 1 hit the objects an engine of MTP 0 stored under its model name"
    )


@pytest.mark.fix
def test_a_retrieve_of_an_engine_of_another_layout_reads_nothing(real_servers, tmp_path):
    """Not even objects that sit read-locked in L1 by the other engine's lookup."""
    a = start(real_servers, tmp_path, MTP0)
    a.store("a", tokens(), store_ids())
    assert a.lookup("r", tokens()[:-1]) == BLOCKS
    b = a.add_engine(engine_kv(MTP1, seed=1), instance=2)
    before = [t.clone() for t in b.kv.raw]
    b.retrieve("b", tokens(), 0, BLOCKS * N, restore_ids(BLOCKS))
    assert all(torch.equal(x, y) for x, y in zip(before, b.kv.raw, strict=True)), (
        "an engine of MTP 1 restored the objects an engine of MTP 0 stored"
    )


@pytest.mark.feature
def test_a_layout_conflict_stores_nothing_and_both_engines_miss(real_servers, tmp_path):
    a = start(real_servers, tmp_path, MTP0)
    b = a.add_engine(engine_kv(MTP1, seed=1), instance=2)
    assert not a.store("a", tokens(), store_ids())
    assert not b.store("b", tokens(2000), store_ids())
    assert a.lookup("a-again", tokens()[:-1]) == 0
    assert b.lookup("b-again", tokens(2000)[:-1]) == 0


@pytest.mark.feature
def test_a_layout_conflict_logs_one_error_naming_both_instances_and_the_remedy(
    real_servers, tmp_path
):
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as transfer

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    transfer.logger.addHandler(handler)
    try:
        a = start(real_servers, tmp_path, MTP0)
        fp_a = a.transfer._cache_contexts[1].layout_fingerprint  # noqa: SLF001
        b = a.add_engine(engine_kv(MTP1, seed=1), instance=2)
        fp_b = b.transfer._cache_contexts[2].layout_fingerprint  # noqa: SLF001
        a.add_engine(engine_kv(MTP1, seed=2), instance=3)
    finally:
        transfer.logger.removeHandler(handler)
    (error,) = [r.getMessage() for r in records if r.levelno >= logging.ERROR]
    assert fp_a and fp_b and fp_a != fp_b
    for part in (MODEL, "world size 1", "instances 1 and 2", fp_a, fp_b):
        assert part in error
    assert "own LMCache server" in error
    # --served-model-name changes no key: it is no remedy
    assert "different served model names" not in error


@pytest.mark.feature
def test_the_conflict_lasts_while_an_instance_of_either_layout_is_registered(
    real_servers, tmp_path
):
    a = start(real_servers, tmp_path, MTP0)
    b = a.add_engine(engine_kv(MTP1, seed=1), instance=2)
    a.unregister()
    assert not b.store("b", tokens(), store_ids())
    c = a.add_engine(engine_kv(MTP1, seed=2), instance=3)
    assert not c.store("c", tokens(), store_ids())
    assert c.lookup("c-again", tokens()[:-1]) == 0


@pytest.mark.feature
def test_a_layout_is_served_again_once_every_instance_of_the_model_left(real_servers, tmp_path):
    a = start(real_servers, tmp_path, MTP0)
    b = a.add_engine(engine_kv(MTP1, seed=1), instance=2)
    a.unregister()
    b.unregister()
    src = engine_kv(MTP1, seed=3)
    restarted = a.add_engine(src, instance=3)
    assert restarted.store("store", tokens(), store_ids())
    other = a.add_engine(engine_kv(MTP1, seed=4), instance=4)
    assert restore_through(other, src) == BLOCKS


@pytest.mark.feature
def test_objects_stored_before_the_conflict_hit_again_after_it(real_servers, tmp_path):
    a = start(real_servers, tmp_path, MTP0)
    assert a.store("store", tokens(), store_ids())
    b = a.add_engine(engine_kv(MTP1, seed=1), instance=2)
    assert restore_through(b, a.kv, request="during") == 0
    a.unregister()
    b.unregister()
    restarted = a.add_engine(engine_kv(MTP0, seed=2), instance=3)
    assert restore_through(restarted, a.kv, request="after") == BLOCKS


def test_two_instances_of_one_layout_share_their_hits(real_servers, tmp_path):
    a = start(real_servers, tmp_path, MTP1)
    b = a.add_engine(engine_kv(MTP1, seed=1), instance=2)
    assert a.store("store", tokens(), store_ids())
    assert restore_through(b, a.kv) == BLOCKS
