"""A multimodal item's identifier never stops the engine.

vLLM takes a user's ``multi_modal_uuids`` as the item's identifier, any string, a lone
surrogate from JSON too. LMCache 0.5.3 hashes it as UTF-8 while vLLM's scheduler
creates the request's tracker: a UnicodeEncodeError there stopped the engine core.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

import lmcache.integration.vllm.lmcache_mp_connector as mpc  # noqa: E402

TEXT = list(range(100, 164))
IMAGE_AT, IMAGE_LEN = 16, 32


def request(identifier: str) -> SimpleNamespace:
    position = SimpleNamespace(offset=IMAGE_AT, length=IMAGE_LEN)
    return SimpleNamespace(
        request_id="req",
        cache_salt=None,
        prompt_token_ids=list(TEXT),
        all_token_ids=list(TEXT),
        mm_features=[SimpleNamespace(identifier=identifier, mm_position=position)],
    )


@pytest.mark.fix
def test_an_identifier_that_is_not_valid_utf8_is_keyed():
    try:
        tokens = mpc.LMCacheMPRequestTracker(request("img-\ud800")).get_token_ids()
    except UnicodeError as e:
        pytest.fail(f"a multimodal identifier raised inside vLLM's scheduler: {e}")
    other = mpc.LMCacheMPRequestTracker(request("img-\ud801")).get_token_ids()
    assert tokens[IMAGE_AT : IMAGE_AT + IMAGE_LEN] != other[IMAGE_AT : IMAGE_AT + IMAGE_LEN]
