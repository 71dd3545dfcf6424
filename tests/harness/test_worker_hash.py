"""The KV digest of hybridfa_gate.worker (``digest_rows``, ``digest``, ``hash_blocks``), on CPU."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from hybridfa_gate import worker

torch = pytest.importorskip("torch")


def _rows(seed: int, rows: int = 3, nbytes: int = 4096) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, nbytes), generator=g, dtype=torch.int64).to(torch.uint8)


def test_a_row_digests_alike_alone_and_in_a_batch() -> None:
    rows = _rows(1)
    assert worker.digest_rows(rows) == [worker.digest_rows(r.unsqueeze(0))[0] for r in rows]


def test_changing_any_one_word_changes_the_digest() -> None:
    row = _rows(2, rows=1, nbytes=64)
    base = worker.digest_rows(row)[0]
    words = row.view(torch.int32)
    for i, delta in ((0, 1), (7, -(2**31)), (15, 2**31 - 1), (3, 2**16)):
        changed = words.clone()
        changed[0, i] = (changed[0, i].to(torch.int64) + delta).to(torch.int32)
        assert worker.digest_rows(changed.view(torch.uint8))[0] != base, (i, delta)


def test_a_length_that_is_not_a_multiple_of_four_bytes_is_digested() -> None:
    row = _rows(3, rows=1, nbytes=10)
    other = row.clone()
    other[0, 9] ^= 1
    assert worker.digest_rows(row) != worker.digest_rows(other)


def test_the_digest_is_the_same_after_the_weights_are_made_again() -> None:
    rows = _rows(4)
    first = worker.digest_rows(rows)
    worker._WEIGHTS.clear()
    assert worker.digest_rows(rows) == first


def _runner(n: int, blocks: list[list[int]]) -> NS:
    """A runner with one FA layer (8 blocks of n tokens, kernel page n // 2) and one GDN
    layer (conv bf16, ssm fp32)."""
    g = torch.Generator().manual_seed(5)
    fa = torch.randn(16, 2, n // 2, 8, generator=g).to(torch.bfloat16)
    gdn = [torch.randn(8, 3, 4, generator=g).to(torch.bfloat16), torch.randn(8, 2, 4, 4)]
    ctx = {"fa.0": NS(kv_cache=fa), "gdn.0": NS(kv_cache=gdn)}
    groups = [
        NS(kv_cache_spec=NS(block_size=n), layer_names=["fa.0"]),
        NS(kv_cache_spec=NS(block_size=n), layer_names=["gdn.0"]),
    ]
    return NS(
        compilation_config=NS(static_forward_context=ctx),
        kv_cache_config=NS(kv_cache_groups=groups),
    )


def test_blocks_hash_alike_whatever_the_batch_size(monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = [[3, 1, 6, 2, 5], [0, 4, 7, 1, 2]]
    mr = _runner(16, blocks)
    whole = worker.hash_blocks(mr, blocks, 4 * 16 + 5)
    monkeypatch.setattr(worker, "_BATCH_BYTES", 1)  # one block per batch
    assert worker.hash_blocks(mr, blocks, 4 * 16 + 5) == whole


def test_a_gdn_block_hashes_as_the_digest_of_its_states() -> None:
    """hash_blocks and rpc_kv_hashes' kept checkpoint copies (``digest``) must agree."""
    blocks = [[3, 1, 6, 2, 5], [0, 4, 7, 1, 2]]
    mr = _runner(16, blocks)
    got = worker.hash_blocks(mr, blocks, 4 * 16 + 5)["gdn"]["gdn.0"]
    states = mr.compilation_config.static_forward_context["gdn.0"].kv_cache
    assert got["1"] == worker.digest([s[4].clone() for s in states])
    assert sorted(got, key=int) == ["1", "2", "3"]  # full blocks, the null block skipped


def test_only_the_asked_blocks_are_hashed() -> None:
    blocks = [[3, 1, 6, 2, 5], [0, 4, 7, 1, 2]]
    mr = _runner(16, blocks)
    got = worker.hash_blocks(mr, blocks, 4 * 16 + 5, only={1, 4})
    assert sorted(got["fa"]["fa.0"]) == ["1", "4"] and sorted(got["gdn"]["gdn.0"]) == ["1"]
