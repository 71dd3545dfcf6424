"""Marker module of the hybrid-FA patched LMCache build.

The wheel factory copies this file into the wheel as ``lmcache/_hybridfa.py`` with the
``@...@`` placeholders filled in. Each command reads the INSTALLED build, never a
``lmcache/`` tree in the current folder:

``python -m lmcache._hybridfa``            the build, whether the installed files still match
                                           the wheel's RECORD (exit 1 if not), and whether
                                           its compiled copy kernels load with this torch
``python -m lmcache._hybridfa kernels``    the kernels alone: exit 3 where they do not load
                                           with this environment's CUDA torch (a CUDA
                                           LMCache server then refuses every model)
``python -m lmcache._hybridfa block-size MODEL``  N, the attention block size vLLM picks for
                                           a hybrid model, from its config.json (no GPU)
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import math
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

BASE_VERSION = "@BASE_VERSION@"
REVISION = "@REVISION@"
VERSION = "@VERSION@"
SERIES_SHA256 = "@SERIES_SHA256@"
TREE_SHA256 = "@TREE_SHA256@"
PATCHES = tuple("@PATCHES@".split(",")) if "@PATCHES@" else ()
KERNELS = "@KERNELS@"  # what --kernels built them against; empty: the base wheel's own

MARKER = "lmcache/_hybridfa.py"
EXIT_OK, EXIT_BROKEN, EXIT_KERNELS = 0, 1, 3
KERNELS_NO, TORCH_NO = "  kernels load   !!!", "  torch          !!!"  # report lines


@dataclass(frozen=True)
class BaseKernels:
    """The compiled copy kernels of a pristine base wheel and what they need."""

    module: str  # the extension module
    entry: str  # a function the patched server calls in it
    torch: str  # the torch release the pristine wheel's module is built against
    vllm: str  # the vLLM releases that pin that torch
    build: str  # the factory command that serves those vLLMs


BASES: dict[str, BaseKernels] = {
    "0.5.3": BaseKernels(
        "lmcache.c_ops",
        "execute_object_group_transfer",
        "2.11",
        "vLLM 0.26",
        "python -m hybridfa_build install",
    ),
    "0.5.6": BaseKernels(
        "lmcache.cuda_ops",
        "execute_object_group_transfer",
        "2.13",
        "vLLM 0.29-0.32",
        "python -m hybridfa_build install --base 0.5.6",
    ),
}


def kernels_need(base: str = BASE_VERSION, built: str = KERNELS) -> str:
    """The torch that this build's compiled copy kernels load with, in words."""
    if built:
        return f"{built} (built by --kernels)"
    known = BASES.get(base)
    if known is None:
        return "the torch the pristine base wheel was built against"
    return f"torch {known.torch}.x (the pristine lmcache {base} wheel's, as {known.vllm} pins)"


def kernels_advice(base: str = BASE_VERSION) -> str:
    """What to do where the environment's torch is not the one the kernels need."""
    known = BASES.get(base)
    build = known.build if known is not None else "python -m hybridfa_build install"
    return (
        "install this wheel into the Python environment vLLM runs in (pip keeps vLLM's "
        f"torch there), or rebuild it there against that torch: {build} --kernels"
    )


def _record_mismatches(dist: metadata.Distribution) -> list[str]:
    problems: list[str] = []
    for entry in dist.files or ():
        if entry.hash is None or entry.hash.mode != "sha256":
            continue
        path = Path(str(entry.locate()))
        if not path.is_file():
            problems.append(f"missing: {entry}")
            continue
        digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest())
        if digest.rstrip(b"=").decode() != entry.hash.value:
            problems.append(f"modified: {entry}")
    return problems


# Imports the compiled module as LMCache does, with its package and once (0.5.6's package
# imports it on a CUDA machine; a second load of the same file fails), in a fresh interpreter
# whose first path entry is the install: argv is the module's name, the function it must
# bind, the folder holding lmcache/.
KERNEL_PROBE = """\
import importlib, json, os, sys
out = {"torch": None, "cuda": None, "error": None}
try:
    import torch
except Exception as exc:
    out["error"] = f"torch does not import: {type(exc).__name__}: {exc}"
else:
    out["torch"], out["cuda"] = torch.__version__, torch.version.cuda
    sys.path.insert(0, sys.argv[3])
    try:
        module = importlib.import_module(sys.argv[1])
        where = os.path.realpath(getattr(module, "__file__", None) or "?")
        if not where.startswith(os.path.join(os.path.realpath(sys.argv[3]), "")):
            raise ImportError(f"{sys.argv[1]} came from {where}, not from the install")
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    else:
        if not hasattr(module, sys.argv[2]):
            out["error"] = f"it binds no {sys.argv[2]}"
print(json.dumps(out))
"""


@dataclass(frozen=True)
class KernelCheck:
    """Whether the compiled copy kernels load with the torch of this environment."""

    torch: str | None  # torch.__version__, None: torch does not import
    cuda: str | None  # torch.version.cuda, None: a CPU build
    error: str | None  # why the kernels did not load; None: they load and bind

    @property
    def refuses(self) -> bool:
        """A CUDA LMCache server of this environment refuses every model."""
        return self.error is not None and (self.torch is None or self.cuda is not None)


def check_kernels(site: Path, base: str = BASE_VERSION) -> KernelCheck:
    """Import the build's compiled kernels in a fresh interpreter whose first path entry is
    ``site`` (the folder holding the installed ``lmcache``)."""
    known = BASES.get(base)
    if known is None:
        return KernelCheck(None, None, f"no compiled kernels are known for lmcache {base}")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", KERNEL_PROBE, known.module, known.entry, str(site)],
            cwd=site,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        found = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        return KernelCheck(None, None, f"the probe did not run: {exc}")
    error = found.get("error")
    if error and len(error) > 300:
        error = error[:300] + " ..."
    return KernelCheck(found.get("torch"), found.get("cuda"), error)


def _kernel_lines(check: KernelCheck) -> list[str]:
    known = BASES.get(BASE_VERSION)
    module = known.module if known is not None else "the kernels"
    lines = [f"  kernels need   {kernels_need()}"]
    if check.torch is None:
        lines.append(f"{TORCH_NO} {check.error}")
        lines.append(f"                 {kernels_advice()}")
        return lines
    build = f"CUDA {check.cuda}" if check.cuda else "a CPU build"
    lines.append(f"  torch          {check.torch} ({build})")
    if check.error is None:
        lines.append(f"  kernels load   yes: {module} loads and binds with torch {check.torch}")
    elif check.cuda is None:
        lines.append(
            f"  kernels load   no ({check.error}); torch {check.torch} is a CPU build, where "
            "LMCache copies without them: a CUDA server needs the torch above"
        )
    else:
        lines.append(f"{KERNELS_NO} NO with torch {check.torch}: {check.error}")
        lines.append(
            "                 a CUDA LMCache server of this environment refuses every model:"
        )
        lines.append(f"                 {kernels_advice()}")
    return lines


def report(check: KernelCheck | None = None) -> tuple[list[str], bool]:
    """Return the report lines and whether the install is intact (its RECORD); with
    ``check``, the lines say whether the compiled kernels load with this environment's torch."""
    here = Path(__file__).resolve().parent
    lines = [
        "lmcache hybrid-FA build: PATCHED",
        f"  version        {VERSION}",
        f"  base           lmcache {BASE_VERSION}",
        f"  revision       {REVISION}",
        f"  series sha256  {SERIES_SHA256}",
        f"  tree sha256    {TREE_SHA256}",
        f"  patches        {', '.join(PATCHES) or '(none)'}",
        f"  kernels        {f'built against {KERNELS}' if KERNELS else 'as in the base wheel'}",
        f"  module         {here}",
    ]
    try:
        lines.append(f"  vllm           {metadata.version('vllm')}")
    except metadata.PackageNotFoundError:
        lines.append("  vllm           not installed")
    intact = True
    try:
        dist: metadata.Distribution | None = metadata.distribution("lmcache")
    except metadata.PackageNotFoundError:
        dist = None
    if dist is None:
        intact = False
        lines.append("  RECORD         no lmcache distribution metadata found")
    elif dist.version != VERSION:
        intact = False
        lines.append(
            f"  RECORD         !!! installed lmcache metadata says {dist.version}, "
            f"this marker belongs to {VERSION}: another lmcache was installed over "
            "this build. Reinstall the hybrid-FA wheel."
        )
    elif problems := _record_mismatches(dist):
        intact = False
        lines.append(
            f"  RECORD         !!! {len(problems)} installed file(s) differ from the "
            "wheel: something overwrote this build. Reinstall the hybrid-FA wheel."
        )
        lines.extend(f"                 {p}" for p in problems[:20])
    else:
        lines.append(
            f"  RECORD         ok ({sum(1 for f in dist.files or () if f.hash)} hashed files match)"
        )
    if check is not None:
        lines.extend(_kernel_lines(check))
    return lines, intact


def installed_marker() -> tuple[Path | None, str | None]:
    """The marker of the INSTALLED lmcache (found by its distribution metadata, which a
    ``lmcache/`` tree in the current folder lacks) and that distribution's version."""
    try:
        dist = metadata.distribution("lmcache")
    except metadata.PackageNotFoundError:
        return None, None
    return Path(str(dist.locate_file(MARKER))).resolve(), dist.version


def _check(argv: list[str]) -> int:
    here = Path(__file__).resolve()
    marker, version = installed_marker()
    if marker is None:
        print(
            f"lmcache hybrid-FA build: NOT INSTALLED for {sys.executable}\n"
            f"  no lmcache distribution is installed; {here.parent} is not an install "
            "(`python -m hybridfa_build wheel` materializes such a tree for reading)"
        )
        return EXIT_BROKEN
    if marker != here:
        if not marker.is_file():
            print(
                f"lmcache hybrid-FA build: NOT INSTALLED for {sys.executable}\n"
                f"  lmcache {version} at {marker.parent} is not a hybrid-FA build "
                "(pristine or another): install one with python -m hybridfa_build install"
            )
            return EXIT_BROKEN
        # This copy is not the installed package (a lmcache/ tree in the current folder
        # shadows it): run the installed marker from the folder that holds it.
        print(f"(checking the installed lmcache at {marker.parent}, not {here.parent})")
        sys.stdout.flush()
        code = "import runpy; runpy.run_module('lmcache._hybridfa', run_name='__main__')"
        proc = subprocess.run(
            [sys.executable, "-c", code, *argv], cwd=marker.parent.parent, check=False
        )
        return proc.returncode
    check = check_kernels(here.parent.parent)
    if argv[:1] == ["kernels"]:
        print("\n".join(_kernel_lines(check)))
        return EXIT_KERNELS if check.refuses else EXIT_OK
    lines, intact = report(check)
    print("\n".join(lines))
    return EXIT_OK if intact else EXIT_BROKEN


def kernels_refused(lines: list[str]) -> bool:
    """Whether report lines say the kernels do not load with this environment's torch."""
    return any(line.startswith((KERNELS_NO, TORCH_NO)) for line in lines)


# --- N, vLLM's attention block size of a hybrid model ---------------------------------
#
# vLLM (0.26-0.34, mamba_cache_mode="align") sizes a hybrid model's attention block so that N
# tokens of one full-attention layer's KV hold one recurrent-state page
# (``Platform._align_hybrid_block_size``):
#   N = a * ceil(state page / (a * FA bytes per token)),
# with a = the attention backend's smallest kernel block (16 for FlashInfer and FlashAttention
# on CUDA), and from vLLM 0.33, for Qwen's Gated-DeltaNet layers under FlashInfer's GDN
# prefill, a multiple of its checkpoint alignment (64). FlashInfer then pages the block in the
# largest of its kernel sizes (16, 32, 64) that divides N: r = N / page kernel pages per block;
# FlashAttention's page is the block (r = 1).

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
FP8_KV = ("fp8", "fp8_e4m3", "fp8_e5m2")
KERNEL_ALIGNMENT = 16
FLASHINFER_PAGES = (64, 32, 16)
GDN_FLASHINFER_ALIGNMENT = 64
# The Gated-DeltaNet hybrids this project serves: architecture prefix -> family
FAMILIES = {"Qwen3_5": "qwen3_5", "Qwen3Next": "qwen3_next", "OlmoHybrid": "olmo_hybrid"}
# Defaults of their configuration classes (transformers' Qwen3_5TextConfig and
# Qwen3NextConfig, vLLM's OlmoHybridConfig) for keys a config.json may leave out
_QWEN_GDN = {
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
FAMILIES_DEFAULTS: dict[str, dict[str, int]] = {
    "qwen3_5": {**_QWEN_GDN, "num_key_value_heads": 4},
    "qwen3_next": {**_QWEN_GDN, "num_key_value_heads": 2},
    "olmo_hybrid": {"linear_conv_kernel_dim": 4},
}


class BlockSizeError(ValueError):
    """The configuration is not one this calculator knows how vLLM sizes."""


@dataclass(frozen=True)
class BlockSize:
    """What vLLM derives for a hybrid model: N and the pages around it."""

    architecture: str
    family: str
    dtype: str
    tp: int
    fa_layers: int
    recurrent_layers: int
    fa_bytes_per_token: int  # one FA layer, this rank
    conv_bytes: int  # one recurrent layer's conv state, this rank
    ssm_bytes: int  # one recurrent layer's temporal state, this rank
    ssm_dtype: str
    n: int  # vLLM's attention block size
    n_flashinfer_gdn: int | None  # N where vLLM 0.33+ runs FlashInfer's GDN prefill

    @property
    def state_bytes(self) -> int:
        return self.conv_bytes + self.ssm_bytes


def kernel_page(n: int, backend: str = "FLASHINFER") -> int:
    """The kernel page vLLM's FlashInfer backend pages an N-token block in (Hopper);
    FlashAttention pages the whole block."""
    if backend != "FLASHINFER":
        return n
    for size in FLASHINFER_PAGES:
        if n % size == 0:
            return size
    raise BlockSizeError(f"no FlashInfer kernel page of {FLASHINFER_PAGES} divides {n}")


def load_config(model: str) -> dict[str, Any]:
    """A model's config.json: ``model`` is a folder holding it, the file itself, or a Hugging
    Face repository id (its config.json fetched with huggingface_hub, an lmcache dependency)."""
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        data = json.loads(path.read_text())
    elif path.exists() or model.startswith(("/", ".", "~")) or model.count("/") != 1:
        raise BlockSizeError(f"no config.json at {path}")
    else:
        try:
            from huggingface_hub import hf_hub_download

            data = json.loads(Path(hf_hub_download(model, "config.json")).read_text())
        except Exception as exc:  # noqa: BLE001 - any failure: name it and what to pass instead
            raise BlockSizeError(
                f"{model}: no such folder, and its config.json could not be fetched "
                f"({type(exc).__name__}: {exc}); pass the model's folder or config.json"
            ) from exc
    if not isinstance(data, dict):
        raise BlockSizeError(f"{model}: config.json is not an object")
    return data


def _dtype_name(value: Any) -> str | None:
    if not isinstance(value, str):
        return None
    name = value.removeprefix("torch.")
    return name if name in DTYPE_BYTES else None


def _text_config(config: dict[str, Any], family: str) -> dict[str, Any]:
    """vLLM's ``hf_text_config``, with the configuration class's defaults for what
    config.json leaves out."""
    text = config.get("text_config")
    text = dict(text) if isinstance(text, dict) else dict(config)
    for key, value in FAMILIES_DEFAULTS[family].items():
        text.setdefault(key, value)
    if family == "olmo_hybrid":  # OlmoHybridConfig derives what it is not given
        heads = text.get("num_attention_heads")
        for key in ("num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads"):
            if text.get(key) is None:
                text[key] = heads
        if text.get("linear_key_head_dim") is None and heads and text.get("hidden_size"):
            text["linear_key_head_dim"] = int(
                0.75 * text["hidden_size"] / text["linear_num_key_heads"]
            )
        if text.get("linear_value_head_dim") is None and text.get("linear_key_head_dim"):
            text["linear_value_head_dim"] = 2 * text["linear_key_head_dim"]
    return text


def _model_dtype(config: dict[str, Any], text: dict[str, Any], dtype: str) -> str:
    if dtype != "auto":
        name = _dtype_name(dtype)
        if name is None:
            raise BlockSizeError(f"--dtype {dtype}: not one of {', '.join(DTYPE_BYTES)}")
        return name
    found = _dtype_name(config.get("dtype") or config.get("torch_dtype"))
    found = found or _dtype_name(text.get("dtype") or text.get("torch_dtype"))
    # vLLM serves a float32 checkpoint in the platform's first dtype (bfloat16 on CUDA)
    return "bfloat16" if found in (None, "float32", "float") else found


def compute_block_size(
    config: dict[str, Any],
    tp: int = 1,
    kv_cache_dtype: str = "auto",
    dtype: str = "auto",
    mamba_cache_dtype: str = "auto",
    mamba_ssm_cache_dtype: str = "auto",
    num_speculative_tokens: int = 0,
) -> BlockSize:
    """N the way vLLM 0.26-0.34 compute it for a Gated-DeltaNet hybrid in align mode."""
    archs = config.get("architectures") or []
    arch = str(archs[0]) if archs else ""
    family = next((f for p, f in FAMILIES.items() if arch.startswith(p)), None)
    if family is None:
        raise BlockSizeError(
            f"architecture {arch or '(none)'}: not a hybrid this build serves "
            f"({', '.join(p + '*' for p in FAMILIES)})"
        )
    text = _text_config(config, family)

    def get(key: str) -> int:
        value = text.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise BlockSizeError(f"{arch}: config.json gives no {key}")
        return value

    layer_types = text.get("layer_types")
    if not isinstance(layer_types, list) or not layer_types:
        count = get("num_hidden_layers")
        layer_types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(count)]
    fa = sum(1 for t in layer_types if t == "full_attention")
    rec = sum(1 for t in layer_types if t == "linear_attention")
    if fa == 0 or rec == 0:
        raise BlockSizeError(f"{arch}: layer_types holds no full and linear attention layers")

    model_dtype = _model_dtype(config, text, dtype)
    if kv_cache_dtype == "auto":
        kv_bytes = DTYPE_BYTES[model_dtype]
    elif kv_cache_dtype in FP8_KV:
        kv_bytes = 1
    elif (name := _dtype_name(kv_cache_dtype)) is not None:
        kv_bytes = DTYPE_BYTES[name]
    else:
        raise BlockSizeError(
            f"--kv-cache-dtype {kv_cache_dtype}: this calculator knows auto, "
            f"{', '.join(FP8_KV)} and the float dtypes"
        )
    conv_dtype = model_dtype if mamba_cache_dtype == "auto" else _dtype_name(mamba_cache_dtype)
    if conv_dtype is None:
        raise BlockSizeError(f"--mamba-cache-dtype {mamba_cache_dtype}: not a float dtype")
    ssm_dtype: str | None = conv_dtype
    if mamba_ssm_cache_dtype != "auto":
        ssm_dtype = _dtype_name(mamba_ssm_cache_dtype)
    elif family == "qwen3_5" and text.get("mamba_ssm_dtype") is not None:
        ssm_dtype = _dtype_name(text.get("mamba_ssm_dtype"))  # vLLM's Qwen3.5 config applies it
    if ssm_dtype is None:
        raise BlockSizeError(f"{arch}: the recurrent state's dtype is not a float dtype")

    head = text.get("head_dim")
    if not isinstance(head, int) or head <= 0:
        head = get("hidden_size") // get("num_attention_heads")
    kv_heads = max(1, get("num_key_value_heads") // tp)
    fa_bytes = 2 * kv_heads * head * kv_bytes

    nk, nv = get("linear_num_key_heads"), get("linear_num_value_heads")
    dk, dv = get("linear_key_head_dim"), get("linear_value_head_dim")
    conv_dim = 2 * nk * dk + nv * dv
    if conv_dim % tp or nv % tp:
        raise BlockSizeError(f"{arch}: the recurrent heads do not divide over {tp} ranks")
    conv = (conv_dim // tp) * (get("linear_conv_kernel_dim") - 1 + num_speculative_tokens)
    conv_bytes = conv * DTYPE_BYTES[conv_dtype]
    ssm_bytes = (nv // tp) * dv * dk * DTYPE_BYTES[ssm_dtype]

    def aligned(a: int) -> int:
        return a * math.ceil((conv_bytes + ssm_bytes) / (a * fa_bytes))

    qwen_gdn = family in ("qwen3_5", "qwen3_next")
    return BlockSize(
        arch,
        family,
        model_dtype,
        tp,
        fa,
        rec,
        fa_bytes,
        conv_bytes,
        ssm_bytes,
        ssm_dtype,
        aligned(KERNEL_ALIGNMENT),
        aligned(math.lcm(KERNEL_ALIGNMENT, GDN_FLASHINFER_ALIGNMENT)) if qwen_gdn else None,
    )


LOG_GREP = "grep -m1 -o 'Setting attention block size to [0-9]* tokens' VLLM_LOG"


def _version_tuple(version: str | None) -> tuple[int, int] | None:
    try:
        major, minor = (version or "").split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def block_size_lines(
    b: BlockSize, vllm: str | None, backend: str = "FLASHINFER", base: str = BASE_VERSION
) -> list[str]:
    """The block-size report: N, r, and what to configure with them."""
    seen = _version_tuple(vllm)
    gdn_prefill = b.n_flashinfer_gdn is not None and (seen is None or seen >= (0, 33))
    page = kernel_page(b.n, backend)
    lines = [
        f"model          {b.architecture}, dtype {b.dtype}, tensor parallel size {b.tp}",
        f"attention      {b.fa_layers} full-attention layers: {b.fa_bytes_per_token} B of KV "
        "per token and layer on each rank",
        f"recurrent      {b.recurrent_layers} Gated-DeltaNet layers: a {b.state_bytes} B state "
        f"page ({b.conv_bytes} B conv, {b.ssm_bytes} B {b.ssm_dtype} temporal)",
        f"N              {b.n} tokens",
    ]
    if backend == "FLASHINFER":
        lines.append(
            f"r              {b.n // page} (FlashInfer pages the block in kernel pages of "
            f"{page} slots; r = N / page)"
        )
    else:
        lines.append("r              1 (FlashAttention: the page is the block)")
    if gdn_prefill and b.n_flashinfer_gdn is not None and b.n_flashinfer_gdn != b.n:
        n2 = b.n_flashinfer_gdn
        lines.append(
            f"               vLLM 0.33 and later pick {n2} (r = {n2 // kernel_page(n2, backend)}) "
            "where they run FlashInfer's GDN prefill, the default on Hopper, and "
            f"{b.n} with the Triton GDN prefill: vLLM's log says which"
        )
    batched = (
        f"at least N ({b.n})" if base == "0.5.6" else f"from N to 2N - 1 ({b.n}-{2 * b.n - 1})"
    )
    lines += [
        f"configure      lmcache server --chunk-size a multiple of N ({b.n}, {2 * b.n}, ...); "
        f"vLLM max_num_batched_tokens {batched}",
        f"confirm        {LOG_GREP}",
        f"               (vLLM {vllm or '0.26-0.34'} on CUDA, mamba_cache_mode=align; "
        "the log is the authority)",
    ]
    return lines


def _block_size(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lmcache._hybridfa block-size",
        description="N, vLLM's attention block size for a hybrid model, from its config.json "
        "(no GPU, no engine). Pass the options you give `vllm serve`.",
    )
    parser.add_argument("model", help="model folder, its config.json, or a Hugging Face id")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--mamba-cache-dtype", default="auto")
    parser.add_argument("--mamba-ssm-cache-dtype", default="auto")
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=0, help="MTP: speculative tokens"
    )
    parser.add_argument(
        "--attention-backend", default="FLASHINFER", choices=("FLASHINFER", "FLASH_ATTN")
    )
    parser.add_argument("--vllm", help="vLLM version (default: the installed one)")
    args = parser.parse_args(argv)
    vllm = args.vllm
    if vllm is None:
        try:
            vllm = metadata.version("vllm")
        except metadata.PackageNotFoundError:
            vllm = None
    try:
        b = compute_block_size(
            load_config(args.model),
            args.tensor_parallel_size,
            args.kv_cache_dtype,
            args.dtype,
            args.mamba_cache_dtype,
            args.mamba_ssm_cache_dtype,
            args.num_speculative_tokens,
        )
        lines = block_size_lines(b, vllm, args.attention_backend)
    except BlockSizeError as exc:
        print(f"error: {exc}\nread N off vLLM's log instead: {LOG_GREP}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["block-size"]:
        return _block_size(argv[1:])
    if argv[:1] in ([], ["kernels"]):
        return _check(argv)
    print(__doc__)
    return EXIT_OK if argv[0] in ("-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
