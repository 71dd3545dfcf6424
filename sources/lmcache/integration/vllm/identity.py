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
    from lmcache.integration.vllm.utils import (
        mm_hash_to_token_values as identity_tokens,
    )
except ImportError:  # the 0.5.3 series adds the same
    from lmcache.integration.vllm.utils import mm_identity_tokens as identity_tokens

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_CONFIG_FILES = ("config.json", "adapter_config.json")
_UNQUANTIZED_KV = ("auto", "float16", "bfloat16", "float32", "float", "half")
DIGEST_CHARS = 32


def _digest(text: str) -> str:
    return blake3.blake3(text.encode("utf-8", "surrogatepass")).hexdigest()[
        :DIGEST_CHARS
    ]


def weights_digest(directory: str) -> str | None:
    """A digest of every byte of the weight and config files in ``directory``, the
    same on every node that holds the same files; None where none is readable.

    Each file is hashed whole once per version of it on this node: its digest is
    kept in the user's cache (:func:`file_digest`) under its path, size, inode and
    modification and change times, so a file written again in any way is read
    again. Only names and contents enter the digest.
    """
    try:
        names = sorted(
            n
            for n in os.listdir(directory)
            if n.endswith(_WEIGHT_SUFFIXES) or n in _CONFIG_FILES
        )
        h = blake3.blake3()
        for name in names:
            h.update(f"{name}\0{file_digest(os.path.join(directory, name))}\0".encode())
    except OSError:
        return None
    return h.hexdigest()[:DIGEST_CHARS] if names else None


def _digest_cache() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache"
    )
    return os.path.join(base, "lmcache-hybridfa", "file-digests")


def file_digest(path: str) -> str:
    """blake3 of a file's bytes, kept in ``$XDG_CACHE_HOME/lmcache-hybridfa`` under
    what any write changes (size, inode, device, mtime_ns and ctime_ns, which no
    user can set back). Whoever can write that folder (the user) could plant a
    digest; where it is not writable the file is hashed every time."""
    path = os.path.realpath(path)
    st = os.stat(path)
    stamp = "\0".join(
        str(v)
        for v in (
            path,
            st.st_size,
            st.st_ino,
            st.st_dev,
            st.st_mtime_ns,
            st.st_ctime_ns,
        )
    )
    entry = os.path.join(
        _digest_cache(), blake3.blake3(stamp.encode()).hexdigest()[:32]
    )
    try:
        with open(entry, encoding="ascii") as f:
            cached = f.read()
        if len(cached) == 64:
            return cached
    except OSError:
        pass
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if st.st_size:
        h.update_mmap(path)
    digest = h.hexdigest()
    try:
        os.makedirs(os.path.dirname(entry), mode=0o700, exist_ok=True)
        tmp = f"{entry}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="ascii") as f:
            f.write(digest)
        os.replace(tmp, entry)
    except OSError:
        pass
    return digest


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


def lora_identity(lora_request: Any) -> str | None:
    """A LoRA adapter's identity: its name (what vLLM's prefix cache keys), its path
    and a digest of the files vLLM loads for it (:func:`lora_folder`). Not its int
    id, which vLLM assigns in load order and which would make a restarted engine
    miss. ``""`` for no adapter; None where its files cannot be read: such a
    request is neither looked up nor stored."""
    if lora_request is None:
        return ""
    path = str(getattr(lora_request, "lora_path", "") or "")
    name = getattr(lora_request, "lora_name", "")
    folder = lora_folder(path)
    weights = weights_digest(folder) if folder else None
    if weights is None:
        _log_unreadable_adapter(name, path, folder)
        return None
    return f"lora={name!r},path={path!r},weights={weights}"


def lora_folder(lora_path: str) -> str | None:
    """The local folder vLLM loads an adapter from, resolved as vLLM resolves it
    (``vllm.lora.utils.get_adapter_absolute_path``): an absolute path as it is, ``~``
    expanded, a relative path that exists, else a Hugging Face repository id, whose
    snapshot vLLM downloads. None where that is no readable folder."""
    if not lora_path:
        return None
    if (
        os.path.isabs(lora_path)
        or lora_path.startswith("~")
        or os.path.exists(lora_path)
    ):
        folder = os.path.abspath(os.path.expanduser(lora_path))
    else:
        folder = _hub_snapshot(lora_path)
    return folder if folder and os.path.isdir(folder) else None


@functools.lru_cache(maxsize=256)
def _hub_snapshot(repo_id: str) -> str | None:
    """The snapshot vLLM resolves for a hub adapter, resolved (downloaded) once per
    process by vLLM's own function, as its worker does when it first loads it."""
    try:
        from vllm.lora.utils import get_adapter_absolute_path

        return str(get_adapter_absolute_path(repo_id))
    except Exception:  # no vLLM, no such repository, no network and not cached
        return None


@functools.lru_cache(maxsize=256)
def _log_unreadable_adapter(name: str, path: str, folder: str | None) -> None:
    from lmcache.logging import init_logger

    init_logger(__name__).warning(
        "LoRA adapter %r (%s): %s; its requests are neither looked up nor stored in "
        "LMCache, since no key could tell its weights from another adapter's",
        name,
        path,
        f"no weight or config file readable in {folder}"
        if folder
        else "no local folder",
    )


def request_cache_salt(cache_salt: str | None, lora_request: Any = None) -> str | None:
    """The cache_salt a request's keys carry: ``""`` for a request with neither a
    salt nor a LoRA adapter (pristine keys), otherwise a hex digest of both; None
    for a request that cannot be keyed (its adapter's files are unreadable): it is
    neither looked up nor stored.

    The salt itself never leaves the engine, so any string vLLM accepts works
    (LMCache's keys refuse ``/``, ``@``, ``\\``, NUL and more than 128 characters,
    which raised inside vLLM's scheduler and stopped the engine), and no L2 object
    name shows it. A server's per-salt quota and usage therefore see the digest.
    """
    lora = lora_identity(lora_request)
    if lora is None:
        return None
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
