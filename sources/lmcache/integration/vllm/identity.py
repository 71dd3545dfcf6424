# SPDX-License-Identifier: Apache-2.0
"""What a stored object's bytes were computed from, and for whom.

A key must name everything that changes what a stored byte means, or whose request
wrote it:

- the engine (:func:`engine_identity`): the model (path, revision, quantization, dtype,
  load format, hf_overrides and a digest of the weights behind the path) and the KV
  cache's quantization (the kv-cache dtype string, since vLLM stores fp8_e4m3 and
  fp8_e5m2 alike as uint8 tensors of one spec, and each attention layer's k/v scales).
  The worker declares its digest at registration, and the server's layout fingerprint
  covers it.
- the request (:func:`request_cache_salt`, :func:`prompt_embeds_key_tokens`): its
  cache_salt and LoRA adapter, and the embeddings of a prompt-embeds prompt, whose
  token ids are all 0.
"""

from __future__ import annotations

# Standard
from collections.abc import Iterable
from typing import Any
import functools
import json
import os

# Third Party
import blake3
import torch

# First Party
try:  # LMCache 0.5.6 keys a multimodal item by its whole identity itself
    from lmcache.integration.vllm.utils import mm_hash_to_token_values as identity_tokens
except ImportError:  # the 0.5.3 series adds the same
    from lmcache.integration.vllm.utils import mm_identity_tokens as identity_tokens

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_CONFIG_FILES = ("config.json", "adapter_config.json")
_WHOLE_FILE_BYTES = 4 << 20
_SAMPLE_BYTES = 16 << 10
_SAMPLES = 1024  # per directory, spread over its large files
_UNQUANTIZED_KV = ("auto", "float16", "bfloat16", "float32", "float", "half")
DIGEST_CHARS = 32


def _digest(text: str) -> str:
    return blake3.blake3(text.encode("utf-8", "surrogatepass")).hexdigest()[:DIGEST_CHARS]


def weights_digest(directory: str) -> str | None:
    """A digest of the weight and config files in ``directory``, the same on every
    node that holds the same files; None where none is readable.

    Small files are hashed whole. Of a large file its name, size and evenly spaced
    samples are hashed, not every byte: another checkpoint (another training run,
    fine-tune or quantization) differs nearly everywhere, so the samples tell it
    apart in milliseconds. An edit in place of a small part of the weights may go
    unnoticed; give such weights another path or revision.
    """
    try:
        names = sorted(
            n
            for n in os.listdir(directory)
            if n.endswith(_WEIGHT_SUFFIXES) or n in _CONFIG_FILES
        )
        files = []
        for name in names:
            st = os.stat(os.path.join(directory, name))
            files.append(
                (name, st.st_size, (st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
            )
        return _content_digest(directory, tuple(files)) if files else None
    except OSError:
        return None


@functools.lru_cache(maxsize=64)
def _content_digest(directory: str, files: tuple[tuple[str, int, Any], ...]) -> str:
    """Cached by each file's name, size and stat times: a file written again (its
    ctime changes) is read again. Only names, sizes and contents are hashed."""
    large = sum(1 for _, size, _ in files if size > _WHOLE_FILE_BYTES)
    samples = max(8, _SAMPLES // max(1, large))
    h = blake3.blake3()
    for name, size, _ in files:
        h.update(f"{name}\0{size}\0".encode())
        with open(os.path.join(directory, name), "rb") as f:
            if size <= _WHOLE_FILE_BYTES:
                h.update(f.read())
                continue
            for i in range(samples):
                f.seek(i * (size - _SAMPLE_BYTES) // (samples - 1))
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()[:DIGEST_CHARS]


def _model_weights_dir(model_config: Any, load_config: Any) -> str | None:
    """The local directory of the model's weights: the model path itself, or the
    Hugging Face cache snapshot vLLM downloaded for its revision."""
    for path in (
        getattr(model_config, "model", ""),
        getattr(model_config, "model_weights", ""),
    ):
        if isinstance(path, str) and path and os.path.isdir(path):
            return path
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(
            str(getattr(model_config, "model", "")),
            "config.json",
            cache_dir=getattr(load_config, "download_dir", None),
            revision=getattr(model_config, "revision", None),
        )
    except Exception:  # not a repository id, no hub client: no digest
        return None
    return os.path.dirname(found) if isinstance(found, str) else None


def _plain(value: Any) -> str:
    """A deterministic text for a config value (a callable by its name, never by an
    address, so that every TP rank declares the same)."""
    if callable(value) and not isinstance(value, type):
        return (
            f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
        )
    return json.dumps(value, sort_keys=True, default=str)


def _scale(layer: Any, name: str) -> str:
    value = getattr(layer, name, None)
    if not isinstance(value, torch.Tensor):
        return repr(value)
    data = value.detach().to("cpu", torch.float32).contiguous()
    return blake3.blake3(data.numpy().tobytes()).hexdigest()[:16]


def kv_scales_calculated(vllm_config: Any) -> bool:
    """Whether vLLM computes the k/v scales of a quantized KV cache from each
    engine's first batch (``--calculate-kv-scales``): after registration, and other
    in every engine, so no key can name them."""
    cache = getattr(vllm_config, "cache_config", None)
    return bool(getattr(cache, "calculate_kv_scales", False)) and (
        str(getattr(cache, "cache_dtype", "auto")) not in _UNQUANTIZED_KV
    )


def engine_identity(vllm_config: Any, layer_names: Iterable[str]) -> str:
    """What an engine's stored KV bytes are computed from, as text (logged at
    registration; its digest enters the server's layout fingerprint).

    Per attention layer its kv-cache dtype and, for a quantized one, its k/v
    scales as loaded when the KV caches are registered (``dynamic`` where vLLM
    computes them later; the scheduler then refuses the cache). Layers the
    connector cannot reach (no ``static_forward_context``) are named ``layers=
    unreachable``; the cache-wide dtype string is keyed all the same.
    """
    model = getattr(vllm_config, "model_config", None)
    load = getattr(vllm_config, "load_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    weights_dir = _model_weights_dir(model, load)
    lines = [
        f"model={_plain(getattr(model, 'model', None))}",
        f"revision={_plain(getattr(model, 'revision', None))}",
        f"code_revision={_plain(getattr(model, 'code_revision', None))}",
        f"quantization={_plain(getattr(model, 'quantization', None))}",
        f"dtype={getattr(model, 'dtype', None)}",
        f"hf_overrides={_plain(getattr(model, 'hf_overrides', None))}",
        f"load_format={_plain(str(getattr(load, 'load_format', '')))}",
        f"weights={(weights_dir and weights_digest(weights_dir)) or 'unreachable'}",
        f"kv_cache_dtype={getattr(cache, 'cache_dtype', None)}",
        f"calculate_kv_scales={bool(getattr(cache, 'calculate_kv_scales', False))}",
    ]
    context = getattr(
        getattr(vllm_config, "compilation_config", None), "static_forward_context", None
    )
    if not context:
        lines.append("layers=unreachable")
        return "\n".join(lines)
    for name in layer_names:
        layer = context.get(name)
        kv_dtype = getattr(layer, "kv_cache_dtype", None)
        if kv_dtype is None:
            continue  # not attention (e.g. a Mamba layer): its state is in state_layout
        line = f"{name}:kv_cache_dtype={kv_dtype}"
        if str(kv_dtype) not in _UNQUANTIZED_KV:
            scales = (
                "dynamic"
                if getattr(layer, "calculate_kv_scales", False)
                else f"{_scale(layer, '_k_scale')},{_scale(layer, '_v_scale')}"
            )
            line += f",scales={scales}"
        lines.append(line)
    return "\n".join(lines)


def engine_identity_digest(identity: str) -> str:
    return _digest(identity)


def lora_identity(lora_request: Any) -> str:
    """A LoRA adapter's identity: its name (what vLLM's prefix cache keys), its path
    and a digest of its files where the path is a local directory. Not its int id,
    which vLLM assigns in load order and which would make a restarted engine miss."""
    if lora_request is None:
        return ""
    path = str(getattr(lora_request, "lora_path", "") or "")
    weights = weights_digest(path) if os.path.isdir(path) else None
    name = getattr(lora_request, "lora_name", "")
    return f"lora={name!r},path={path!r},weights={weights or 'unreachable'}"


def request_cache_salt(cache_salt: str | None, lora_request: Any = None) -> str:
    """The cache_salt a request's keys carry: ``""`` for a request with neither a
    salt nor a LoRA adapter (pristine keys), otherwise a hex digest of both.

    The salt itself never leaves the engine, so any string vLLM accepts works
    (LMCache's keys refuse ``/``, ``@``, ``\\``, NUL and more than 128 characters,
    which raised inside vLLM's scheduler and stopped the engine), and no L2 object
    name shows it. A server's per-salt quota and usage therefore see the digest.
    """
    lora = lora_identity(lora_request)
    if not cache_salt and not lora:
        return ""
    return _digest(f"salt={cache_salt or ''!r}\0{lora}")


def prompt_embeds_key_tokens(
    token_ids: list[int], request: Any, span_tokens: int
) -> list[int]:
    """``token_ids`` with each prompt position keyed by the request's prompt
    embeddings, for a prompt-embeds request (vLLM gives it token ids of 0).

    The prompt is keyed per span of ``span_tokens`` (the chunk size): each span's
    positions get the multimodal identity token values of a digest of the span's
    embeddings (their dtype and width too), token ids and token/embedding mask, so
    prompts sharing a prefix of whole spans share those chunks, and two prompts of
    one length with other embeddings share none.
    """
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is None or len(embeds) == 0:
        return token_ids
    n = len(embeds)
    mask = getattr(request, "prompt_is_token_ids", None)
    raw = embeds.detach().cpu().contiguous().view(-1).view(torch.uint8)
    row_bytes = raw.numel() // n
    head = f"{embeds.dtype}{tuple(embeds.shape[1:])}".encode()
    out = list(token_ids)
    for start in range(0, n, span_tokens):
        end = min(start + span_tokens, n)
        h = blake3.blake3(head)
        h.update(raw[start * row_bytes : end * row_bytes].numpy())
        h.update(repr(token_ids[start:end]).encode())
        if mask is not None:
            h.update(bytes(bool(m) for m in mask[start:end]))
        out[start:end] = identity_tokens(h.hexdigest(), end - start)
    return out
