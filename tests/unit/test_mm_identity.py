"""Two different images never share a cache key (LMCache#3301, #4086).

LMCache 0.5.3's MP connector keys a multimodal prompt with every placeholder token
replaced by 16 bits of the item's hash, so two images of the same size at the same
position after the same text collide with probability 1/65536, and LMCache then
serves the other image's KV. The real request tracker of the connector builds the key
tokens here; the server's real TokenHasher hashes them.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

import lmcache.integration.vllm.lmcache_mp_connector as mpc  # noqa: E402

TEXT = list(range(100, 164))
IMAGE_AT, IMAGE_LEN = 16, 32
# Hex identifiers whose low 16 bits are equal: 0.5.3 maps both to 0x0001.
COLLIDING = ("aaaa0001", "bbbb0001")


def request(identifier: str | None) -> Any:
    features = []
    if identifier is not None:
        position = SimpleNamespace(offset=IMAGE_AT, length=IMAGE_LEN)
        features = [SimpleNamespace(identifier=identifier, mm_position=position)]
    return SimpleNamespace(
        request_id=f"req-{identifier}",
        cache_salt=None,
        prompt_token_ids=list(TEXT),
        all_token_ids=list(TEXT),
        mm_features=features,
    )


def key_tokens(identifier: str | None) -> list[int]:
    return mpc.LMCacheMPRequestTracker(request(identifier)).get_token_ids()


def chunk_hashes(tokens: list[int]) -> list[bytes]:
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    return TokenHasher(chunk_size=16).compute_chunk_hashes(tokens)


@pytest.mark.fix
def test_two_images_with_colliding_16_bit_hashes_get_different_keys():
    a, b = (key_tokens(i) for i in COLLIDING)
    assert a[IMAGE_AT : IMAGE_AT + IMAGE_LEN] != b[IMAGE_AT : IMAGE_AT + IMAGE_LEN], (
        "two different images produced the same key tokens"
    )
    assert chunk_hashes(a)[1:] != chunk_hashes(b)[1:]


def test_the_image_keys_differ_at_every_placeholder_position():
    a, b = (key_tokens(i) for i in COLLIDING)
    span = range(IMAGE_AT, IMAGE_AT + IMAGE_LEN)
    assert all(a[i] != b[i] for i in span)


def test_the_same_image_gets_the_same_key():
    assert key_tokens(COLLIDING[0]) == key_tokens(COLLIDING[0])


def test_text_only_keys_are_unchanged():
    assert key_tokens(None) == TEXT


def test_the_text_around_an_image_keeps_its_token_ids():
    tokens = key_tokens(COLLIDING[0])
    assert tokens[:IMAGE_AT] == TEXT[:IMAGE_AT]
    assert tokens[IMAGE_AT + IMAGE_LEN :] == TEXT[IMAGE_AT + IMAGE_LEN :]
    assert len(chunk_hashes(tokens)) == len(TEXT) // 16
