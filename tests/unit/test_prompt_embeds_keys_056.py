"""A prompt-embeds request is keyed by its embeddings (0.5.6 base).

vLLM gives a prompt-embeds prompt token ids of 0, so LMCache 0.5.6 (as 0.5.3) keyed
every such prompt of one length alike and restored one prompt's KV into another. The
connector keys each chunk of the prompt by a digest of its embeddings (vLLM's own
prefix cache hashes them per block): prompts sharing whole chunks of embeddings share
those chunks.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.bases("0.5.6")

pytest.importorskip("vllm.v1.request")

from request_keys_056 import CHUNK, CHUNKS, PROMPT_TOKENS, KeyedEngine  # noqa: E402

HIDDEN = 8


def embeds(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(PROMPT_TOKENS, HIDDEN, generator=gen).to(torch.bfloat16)


@pytest.fixture
def engine(monkeypatch) -> KeyedEngine:
    return KeyedEngine(monkeypatch)


@pytest.mark.fix
def test_two_prompts_of_one_length_with_other_embeddings_share_nothing(engine):
    engine.store(engine.request("a", prompt_embeds=embeds(1)))
    assert engine.hit(engine.request("b", prompt_embeds=embeds(2))) == 0, (
        "one prompt's KV was restored for other prompt embeddings of the same length"
    )


@pytest.mark.fix
def test_embeddings_that_share_two_chunks_hit_those_two(engine):
    first = embeds(1)
    second = first.clone()
    second[2 * CHUNK :] = embeds(2)[2 * CHUNK :]
    engine.store(engine.request("a", prompt_embeds=first))
    assert engine.hit(engine.request("b", prompt_embeds=second)) == 2


def test_the_same_embeddings_hit(engine):
    engine.store(engine.request("a", prompt_embeds=embeds(1)))
    assert engine.hit(engine.request("b", prompt_embeds=embeds(1))) == CHUNKS
