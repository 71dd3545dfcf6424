"""A multimodal item's identifier never stops the engine (0.5.6 base).

vLLM takes a user's ``multi_modal_uuids`` as the item's identifier, any string, a lone
surrogate from JSON too. LMCache 0.5.6 hashes it as strict UTF-8 while vLLM's scheduler
creates the request's tracker: a UnicodeEncodeError there stopped the engine core.
(0.5.6 already keys an item by its whole identifier, not 16 bits of it: pinned here.)
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.bases("0.5.6")

pytest.importorskip("vllm.multimodal.inputs")

from request_keys_056 import KeyedEngine  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402

TEXT = list(range(100, 164))
IMAGE_AT, IMAGE_LEN = 16, 32
IMAGE_TOKEN = 7


def key_tokens(engine: KeyedEngine, req_id: str, identifier: str) -> list[int]:
    """The token ids the real connector keys a prompt with one image by."""
    prompt = list(TEXT)
    prompt[IMAGE_AT : IMAGE_AT + IMAGE_LEN] = [IMAGE_TOKEN] * IMAGE_LEN
    feature = MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset=IMAGE_AT, length=IMAGE_LEN),
    )
    request = engine.request(req_id, prompt, mm_features=[feature])
    engine.connector.get_num_new_matched_tokens(request, 0)
    return engine.connector._get_request_tracker(req_id).get_token_ids()


@pytest.fixture
def engine(monkeypatch) -> KeyedEngine:
    return KeyedEngine(monkeypatch)


@pytest.mark.fix
def test_an_identifier_that_is_not_valid_utf8_is_keyed(engine):
    try:
        tokens = key_tokens(engine, "a", "img-\ud800")
    except UnicodeError as e:
        pytest.fail(f"a multimodal identifier raised inside vLLM's scheduler: {e}")
    other = key_tokens(engine, "b", "img-\ud801")
    image = slice(IMAGE_AT, IMAGE_AT + IMAGE_LEN)
    assert tokens[image] != other[image]
    assert tokens[:IMAGE_AT] == TEXT[:IMAGE_AT]


def test_two_images_whose_identifiers_share_16_bits_get_different_keys(engine):
    a, b = key_tokens(engine, "a", "aaaa0001"), key_tokens(engine, "b", "bbbb0001")
    image = slice(IMAGE_AT, IMAGE_AT + IMAGE_LEN)
    assert a[image] != b[image]
    assert a[IMAGE_AT + IMAGE_LEN :] == b[IMAGE_AT + IMAGE_LEN :]
