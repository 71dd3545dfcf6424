"""A rolling upgrade mixes builds: the cache then fails closed on both sides.

A pristine 0.5.3 client stores a hybrid model's KV wrongly (one kernel page of r per
full-attention block, stale recurrent blocks), and a pristine server keys and stores a
patched client's layout as pristine does. So a patched server stores nothing for a
client that registers several KV cache groups without the hybrid-FA declaration, and a
patched client of such a layout stores and loads nothing through a server that does not
advertise its layout format. Either way the engine keeps serving without the cache.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_cache_interface")
pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_l2_adapter")

from hybrid_kv import build_hybrid_kv  # noqa: E402
from restore_server import BASE, BLOCKS, restart_and_restore, store  # noqa: E402
from vllm_sched_fakes import (  # noqa: E402
    BLOCK,
    SchedDriver,
    make_connector,
    make_kv_cache_config,
)

N, PAGE, CHUNKS, NUM_BLOCKS = 80, 16, 3, 32


def store_ids() -> list[list[int]]:
    return [[1 + g * CHUNKS + i for i in range(CHUNKS)] for g in range(4)]


@pytest.mark.fix
def test_a_pristine_client_of_a_hybrid_model_never_restores_wrong_bytes(real_servers, tmp_path):
    client = BASE.but(pristine_client=True)
    src = store(real_servers, tmp_path / "l2", client)
    blocks, wrong = restart_and_restore(real_servers, tmp_path / "l2", client, src)
    assert not wrong, f"a pristine client restored wrong bytes: {wrong[0]}"
    assert blocks in (0, BLOCKS)


@pytest.mark.feature
def test_a_pristine_client_of_a_hybrid_model_stores_nothing(real_servers, tmp_path):
    kv = build_hybrid_kv(N, PAGE, "NHD", NUM_BLOCKS)
    server = real_servers(kv, N, tmp_path / "l2", False, pristine_client=True)
    tokens = list(range(1000, 1000 + CHUNKS * N + 1))
    assert not server.store("store", tokens, store_ids())
    assert server.lookup("again", tokens[:-1]) == 0


def test_a_pristine_client_of_a_dense_model_keeps_pristine_behaviour(real_servers, tmp_path):
    from hybrid_kv import build_fa_only_kv

    kv = build_fa_only_kv(16, "NHD", num_blocks=NUM_BLOCKS)
    server = real_servers(kv, 16, tmp_path / "l2", False, pristine_client=True)
    tokens = list(range(1000, 1000 + CHUNKS * 16 + 1))
    assert server.store("store", tokens, [[1, 2, 3]])
    assert server.lookup("again", tokens[:-1]) == CHUNKS


def _stores(driver: SchedDriver) -> list[object]:
    """Prefill a 4-block prompt one block a step; the store ops of every step."""
    driver.add_request("r", list(range(1, 1 + 4 * BLOCK)))
    return [op for _ in range(4) for op in driver.step({"r": BLOCK}).stores]


def _hybrid_driver(monkeypatch: pytest.MonkeyPatch, server_layout_format: int) -> SchedDriver:
    config = make_kv_cache_config(num_spec_blocks=0)
    connector = make_connector(config, BLOCK, monkeypatch, server_layout_format)
    return SchedDriver(config, connector)


@pytest.mark.fix
def test_a_hybrid_engine_stores_nothing_through_a_pristine_server(monkeypatch):
    driver = _hybrid_driver(monkeypatch, server_layout_format=0)
    assert _stores(driver) == [], "a hybrid layout was stored through a pristine server"


@pytest.mark.fix
def test_a_hybrid_engine_loads_nothing_through_a_pristine_server(monkeypatch):
    driver = _hybrid_driver(monkeypatch, server_layout_format=0)
    driver.connector.scheduler_adapter.hits["r"] = 3 * BLOCK
    req = driver.add_request("r", list(range(1, 1 + 4 * BLOCK + 1)))
    assert driver.connector.get_num_new_matched_tokens(req, 0) == (0, False)


def test_a_hybrid_engine_uses_a_server_of_its_layout_format(monkeypatch):
    from vllm_sched_fakes import this_build_layout_format

    driver = _hybrid_driver(monkeypatch, this_build_layout_format())
    assert len(_stores(driver)) == 4, "not every block was stored through a server of this build"


@pytest.mark.feature
def test_the_server_advertises_its_layout_format():
    from lmcache.v1.distributed.layout_namespace import (
        LAYOUT_FORMAT,
        server_layout_format,
        server_marker,
    )

    assert server_layout_format(["transfer_query", server_marker()]) == LAYOUT_FORMAT
    assert server_layout_format(["transfer_query"]) == 0


@pytest.mark.feature
def test_the_server_says_it_stores_a_chunk_without_its_recurrent_state():
    from lmcache.v1.distributed.layout_namespace import FA_ONLY_CHUNKS_MARKER
    from lmcache.v1.multiprocess.modules.management import ManagementModule

    module = ManagementModule(ctx=None, experimental_transfer=["transfer_query"])
    assert FA_ONLY_CHUNKS_MARKER in module.get_experimental()
