"""Store under one configuration, restart, load under another: equal bytes or a miss.

Every knob that changes what a hybrid model's stored bytes mean (MTP's conv-state
length, the conv-state layout, the SSM dtype, NHD/HND, FlashInfer's kernel pages or
FlashAttention's whole blocks, the chunk size, the fp8 format and k/v scales of the KV
cache, the model's revision and quantization, the layout format) must make the objects
written under the other setting a miss. Every row stores a prompt through a whole
LMCache server on CPU over an fs L2 folder (restore_server), stops it, and looks the
prompt up through a new server on the same folder with the other setting. A row with the
same setting on both sides must restore every byte, and so must the object-group split,
which changes no stored byte of a model without sliding-window layers.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.v1.kv_cache_interface")
pytest.importorskip("lmcache.v1.distributed.l2_adapters.fs_l2_adapter")

from hybrid_kv import GDNState, build_hybrid_kv  # noqa: E402
from restore_server import (  # noqa: E402
    BASE,
    BLOCKS,
    NUM_BLOCKS,
    PAGE,
    N,
    hit_blocks,
    restored_blocks,
    store,
    store_ids,
    tokens,
)
from vllm_engine import Engine  # noqa: E402

E4M3, E5M2 = Engine(kv_cache_dtype="fp8_e4m3"), Engine(kv_cache_dtype="fp8_e5m2")


@pytest.mark.parametrize(
    "setup",
    [
        BASE,
        BASE.but(layout="HND"),
        BASE.but(page=N),
        BASE.but(chunk=2 * N),
        BASE.but(chunk=3 * N),
        BASE.but(separate=True),
        BASE.but(gdn=GDNState(spec_tokens=2)),
        BASE.but(engine=E4M3),
    ],
    ids=["NHD", "HND", "FlashAttention", "chunk=2N", "chunk=3N", "separate", "MTP-2", "fp8"],
)
def test_same_setting_restores_every_byte(real_servers, tmp_path, setup):
    assert restored_blocks(real_servers, tmp_path, setup, setup) == BLOCKS


# Rows that pristine 0.5.3 restores as a hit: the objects have the same key and size.
SAME_SIZE_ROWS = {
    "MTP-0-to-1": (BASE, BASE.but(gdn=GDNState(spec_tokens=1))),
    "MTP-1-to-0": (BASE.but(gdn=GDNState(spec_tokens=1)), BASE),
    "MTP-1-to-2": (BASE.but(gdn=GDNState(spec_tokens=1)), BASE.but(gdn=GDNState(spec_tokens=2))),
    "conv-DS-to-SD": (BASE, BASE.but(gdn=GDNState(dim_first=False))),
    "ssm-fp32-to-bf16": (BASE, BASE.but(gdn=GDNState(ssm_dtype=torch.bfloat16))),
    "NHD-to-HND": (BASE, BASE.but(layout="HND")),
    "FlashAttention-MTP-0-to-1": (
        BASE.but(page=N),
        BASE.but(page=N, gdn=GDNState(spec_tokens=1)),
    ),
    "FlashAttention-NHD-to-HND": (BASE.but(page=N), BASE.but(page=N, layout="HND")),
    # vLLM builds one spec and uint8 tensors for every fp8 format
    "fp8-e4m3-to-e5m2": (BASE.but(engine=E4M3), BASE.but(engine=E5M2)),
    "fp8-e5m2-to-fp8": (BASE.but(engine=E5M2), BASE.but(engine=Engine(kv_cache_dtype="fp8"))),
    "fp8-k-scale": (
        BASE.but(engine=E4M3),
        BASE.but(engine=Engine(kv_cache_dtype="fp8_e4m3", k_scale=0.5)),
    ),
    "FlashAttention-fp8-e4m3-to-e5m2": (
        BASE.but(page=N, engine=E4M3),
        BASE.but(page=N, engine=E5M2),
    ),
    # the model's identity: not in the KV cache spec at all
    "revision": (BASE.but(engine=Engine(revision="a")), BASE.but(engine=Engine(revision="b"))),
    "quantization": (BASE.but(engine=Engine()), BASE.but(engine=Engine(quantization="fp8"))),
}


@pytest.mark.fix
@pytest.mark.parametrize("a, b", list(SAME_SIZE_ROWS.values()), ids=list(SAME_SIZE_ROWS))
def test_layout_change_of_the_same_object_size_is_a_miss(real_servers, tmp_path, a, b):
    assert hit_blocks(real_servers, tmp_path, a, b) == 0, (
        "objects stored under one layout hit under another"
    )


OTHER_ROWS = {
    "FlashInfer-to-FlashAttention": (BASE, BASE.but(page=N)),
    "FlashAttention-to-FlashInfer": (BASE.but(page=N), BASE),
    "chunk-N-to-2N": (BASE, BASE.but(chunk=2 * N)),
    "chunk-2N-to-3N": (BASE.but(chunk=2 * N), BASE.but(chunk=3 * N)),
    "split-on-MTP-0-to-1": (
        BASE.but(separate=True),
        BASE.but(separate=True, gdn=GDNState(spec_tokens=1)),
    ),
}


@pytest.mark.parametrize("a, b", list(OTHER_ROWS.values()), ids=list(OTHER_ROWS))
def test_other_layout_change_is_a_miss(real_servers, tmp_path, a, b):
    assert restored_blocks(real_servers, tmp_path, a, b) == 0


@pytest.mark.parametrize("chunk", [2 * N, 3 * N], ids=["chunk=2N", "chunk=3N"])
def test_a_chunk_whose_earlier_mamba_slots_are_null_restores_its_last_state(
    real_servers, tmp_path, chunk
):
    """The one-block window stores a chunk when each recurrent group's last block is real,
    whatever its earlier slots hold. No ``fix`` test: pristine, and the series without
    that window, restore this chunk's last state too; pristine fails it only through the
    FA page bug that test_multipage_fa pins."""
    setup = BASE.but(chunk=chunk)
    stored = store_ids(chunk, nulled=True)
    assert restored_blocks(real_servers, tmp_path, setup, setup, stored) == BLOCKS


@pytest.mark.parametrize(
    "a, b",
    [(BASE, BASE.but(separate=True)), (BASE.but(separate=True), BASE)],
    ids=["split-off-to-on", "split-on-to-off"],
)
def test_the_split_option_keeps_a_hybrid_model_s_layout(real_servers, tmp_path, a, b):
    """Recurrent state has a window of one block by default, so for a model without
    sliding-window layers --separate-object-groups changes no stored byte."""
    assert restored_blocks(real_servers, tmp_path, a, b) == BLOCKS


def test_other_layout_format_is_a_miss(real_servers, tmp_path, monkeypatch):
    from lmcache.integration.vllm import kv_cache_groups
    from lmcache.v1.distributed import layout_namespace

    with monkeypatch.context() as old:
        old.setattr(kv_cache_groups, "LAYOUT_FORMAT", layout_namespace.LAYOUT_FORMAT + 1)
        old.setattr(layout_namespace, "LAYOUT_FORMAT", layout_namespace.LAYOUT_FORMAT + 1)
        store(real_servers, tmp_path / "l2", BASE)
    kv = build_hybrid_kv(N, PAGE, "NHD", NUM_BLOCKS, seed=1)
    server = real_servers(kv, N, tmp_path / "l2", False)
    assert server.lookup("restore", tokens()[:-1]) == 0


@pytest.mark.feature
def test_a_rebuild_that_changes_no_stored_byte_keeps_the_hits(real_servers, tmp_path, monkeypatch):
    from lmcache import _hybridfa

    l2 = tmp_path / "l2"
    src = store(real_servers, l2, BASE)
    monkeypatch.setattr(_hybridfa, "REVISION", str(int(_hybridfa.REVISION) + 1))
    monkeypatch.setattr(_hybridfa, "SERIES_SHA256", "0" * 64)
    kv = build_hybrid_kv(N, PAGE, "NHD", NUM_BLOCKS, seed=1)
    server = real_servers(kv, N, l2, False)
    assert server.lookup("restore", tokens()[:-1]) == BLOCKS, (
        "an upgrade that changes no stored byte emptied the disk tier"
    )
    del src


@pytest.mark.fix
def test_a_flash_attention_hybrid_is_keyed_in_a_layout_namespace(real_servers, tmp_path):
    kv = build_hybrid_kv(N, N, "NHD", NUM_BLOCKS)
    server = real_servers(kv, N, tmp_path / "l2", False)
    (key, *_) = server.object_keys(tokens(), 1)[0]
    assert "~hfa-" in key.model_name, (
        "a hybrid model on FlashAttention keeps pristine keys, so objects that pristine "
        "stored with stale block ids keep hitting after the upgrade"
    )


def test_world_size_enters_the_fingerprint():
    from lmcache.v1.distributed.layout_namespace import layout_fingerprint
    from lmcache.v1.multiprocess.group_view import EngineGroupInfo

    infos = [EngineGroupInfo(engine_group_id=0, layer_indices=(0,), recurrent_state=True)]
    one, two = (layout_fingerprint([], {}, (), infos, world_size=w) for w in (1, 2))
    assert one is not None and one != two
