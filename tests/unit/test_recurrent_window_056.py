"""A one-block recurrent window by default, on the lmcache 0.5.6 base.

In vLLM's mamba_cache_mode "align" a Gated-DeltaNet/Mamba block holds the state after its
last token, and a restore resumes from the state at the hit boundary only. Pristine 0.5.6
keeps that state in the full-attention object unless the server runs with
--separate-object-groups, so a restore of n chunks reads n chunks' state. With the state in
object groups of its own, a chunk needs only its last state block to be real.

Server side: vLLM's own allocation (vllm_kv_alloc), the server's real CLI defaults, LMCache's
cache context and layout descriptors. Connector side: the real scheduler-side connector over
vLLM's KVCacheManager (vllm_sched_fakes).
"""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

from test_layout_fingerprint_056 import Server  # noqa: E402
from vllm_kv_alloc import FA_LAYERS, _Wrapper, build_registration, connector_view  # noqa: E402
from vllm_sched_fakes import (  # noqa: E402
    BLOCK,
    NULL_BLOCK_ID,
    FakeSchedulerAdapter,
    SchedDriver,
    make_connector,
    make_kv_cache_config,
)

pytestmark = pytest.mark.bases("0.5.6")

CHUNK = 4 * 16  # tokens; vllm_kv_alloc's blocks are 16 tokens


def server_config(*argv: str):
    """The MP server's configuration as its CLI parses ``argv``."""
    from lmcache.v1.multiprocess.config import add_mp_server_args, parse_args_to_mp_server_config

    args = add_mp_server_args(argparse.ArgumentParser()).parse_args(list(argv))
    return parse_args_to_mp_server_config(args)


def restore_bytes(num_hit_chunks: int, *argv: str) -> int:
    """Bytes a restore of ``num_hit_chunks`` reads from a server run with ``argv``: each
    object group's objects of the hit chunks in its window."""
    import torch

    from lmcache.utils import EngineType
    from lmcache.v1.multiprocess.modules.lmcache_driven_transfer import get_layout_desc
    from lmcache.v1.platform.cache_context import create_cache_context

    edited, infos, hints = connector_view(build_registration(16, 16, "LBNHC"))
    ctx = create_cache_context(
        [_Wrapper(t) for t in edited.values()],
        CHUNK,
        layout_hints=hints,
        engine_group_infos=infos,
        engine_type=EngineType.VLLM,
        separate_object_groups=server_config(*argv).separate_object_groups,
        full_sw_kv=False,
    )
    manager = ctx.kv_layer_groups_manager
    windows = manager.get_attn_desc().num_chunks_in_sw
    read = 0
    for gid in range(manager.num_object_groups):
        desc = get_layout_desc(ctx, CHUNK, object_group_id=gid)
        size = sum(
            torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
            for s, d in zip(desc.shapes, desc.dtypes, strict=True)
        )
        read += size * (num_hit_chunks if windows[gid] < 0 else min(windows[gid], num_hit_chunks))
    return read


# One chunk of full attention: 4 blocks of each FA layer, [2, 16, heads, head size] bf16.
FA_CHUNK_BYTES = len(FA_LAYERS) * 4 * 2 * 16 * 2 * 16 * 2


@pytest.mark.fix
def test_a_restore_reads_the_recurrent_state_of_the_last_hit_chunk_only():
    """Computed, not observed: the bytes are summed from the server's layout descriptions
    and each object group's window (restore_bytes), what the retrieve path reads per
    group; no restore runs. test_gdn_last_chunk counts a restore's disk reads on the 0.5.3
    base."""
    state = restore_bytes(1, "--no-separate-object-groups") - FA_CHUNK_BYTES
    read = restore_bytes(8)
    assert read == 8 * FA_CHUNK_BYTES + state, (
        f"a restore of 8 chunks reads {read} bytes: 8 chunks of full attention are "
        f"{8 * FA_CHUNK_BYTES}, the state of the last chunk {state}"
    )


def test_no_separate_object_groups_keeps_one_object_group():
    """Configured otherwise (--no-separate-object-groups): upstream's single object of
    full attention and state per chunk."""
    one = restore_bytes(1, "--no-separate-object-groups")
    assert one > FA_CHUNK_BYTES
    assert restore_bytes(8, "--no-separate-object-groups") == 8 * one


@pytest.mark.fix
def test_the_default_grouping_is_keyed_apart_from_one_object_group():
    """Objects of one grouping hold other bytes than the other's under one chunk hash."""
    names = []
    for argv in ((), ("--no-separate-object-groups",)):
        server = Server(separate_object_groups=server_config(*argv).separate_object_groups)
        try:
            server.register(1, build_registration(16, 16, "LBNHC"))
            names.append(server.model_name())
            server.unregister(1)
        finally:
            server.module.close()
    assert names[0] != names[1], f"both groupings keyed as {names[0]!r}"


def _stores(
    monkeypatch: pytest.MonkeyPatch, steps: list[int], adapter: FakeSchedulerAdapter | None = None
) -> tuple[list, list[list[int]]]:
    """Store ops of one 8-block prompt scheduled in ``steps`` (chunk = 2 blocks), and
    vLLM's final block table."""
    config = make_kv_cache_config(0)
    driver = SchedDriver(config, make_connector(config, 2 * BLOCK, monkeypatch, adapter=adapter))
    driver.add_request("r", list(range(8 * BLOCK)))
    ops = [op for n in steps for op in driver.step({"r": n}).stores]
    return ops, driver.vllm_table("r")


def _mamba_groups(table: list[list[int]]) -> list[int]:
    config = make_kv_cache_config(0)
    return [
        g
        for g, group in enumerate(config.kv_cache_groups)
        if type(group.kv_cache_spec).__name__ == "MambaSpec"
    ]


@pytest.mark.fix
def test_a_chunk_whose_last_state_block_is_null_is_never_stored(monkeypatch):
    """A four-block prefill step leaves state in its last block only: the chunk of the
    step's first two blocks has no state to store (a server without patch 0010's
    FA-only word; test_mtp_gap_chunk_056 covers one with it)."""
    ops, table = _stores(monkeypatch, [4 * BLOCK, 4 * BLOCK])
    stored = []
    for op in ops:
        for end in range(op.start + 2 * BLOCK, op.end + 1, 2 * BLOCK):
            stored.append(end - 2 * BLOCK)
            for g in _mamba_groups(table):
                last = op.block_ids[g][(end - op.start) // BLOCK - 1]
                assert last != NULL_BLOCK_ID, (
                    f"chunk {end - 2 * BLOCK}-{end} stored from the null state block"
                )
    assert stored, "the prompt stored no chunk: nothing was checked"


def test_a_chunk_whose_earlier_state_blocks_are_null_is_stored(monkeypatch):
    ops, _ = _stores(monkeypatch, [4 * BLOCK, 4 * BLOCK])
    stored = [t for op in ops for t in range(op.start, op.end, 2 * BLOCK)]
    assert stored == [2 * BLOCK, 6 * BLOCK], f"stored chunks start at {stored}"


def test_a_server_that_copies_every_state_block_keeps_the_strict_rule(monkeypatch):
    """A server run with --full-sw-kv copies every block of a chunk: it does not
    advertise the last-block rule, and a chunk with any null state block is not stored."""
    from types import SimpleNamespace

    from lmcache.v1.distributed.layout_namespace import RECURRENT_LAST_BLOCK_MARKER
    from lmcache.v1.multiprocess.modules.management import ManagementModule

    advertised = ManagementModule(SimpleNamespace(full_sw_kv=True)).get_experimental()
    assert RECURRENT_LAST_BLOCK_MARKER not in advertised
    adapter = FakeSchedulerAdapter(2 * BLOCK)
    adapter.experimental = set(advertised)
    ops, _ = _stores(monkeypatch, [4 * BLOCK, 4 * BLOCK], adapter)
    assert ops == []
