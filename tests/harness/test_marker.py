"""The marker module shipped in the wheel (``python -m lmcache._hybridfa``), as its template
in hybridfa_build/marker.py: N from a model's config.json, the kernels check's verdicts, and
the check of the installed package when a ``lmcache/`` tree in the current folder shadows it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from bench.gpu_restore import QWEN35_9B
from hybridfa_build import marker
from hybridfa_gate.models import MODELS, ModelSpec, expected_geometry, model_config_dict

GATE_AND_BENCH: dict[str, ModelSpec] = {**MODELS, QWEN35_9B.name: QWEN35_9B}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("name", sorted(GATE_AND_BENCH))
def test_n_of_the_gate_and_bench_models_is_the_one_their_engines_reported(
    name: str, kv_cache_dtype: str
) -> None:
    # expected_geometry is what the gate's and the bench's engines reported on the GPU
    # (the judge compares each case's engine-reported N with it).
    m = GATE_AND_BENCH[name]
    b = marker.compute_block_size(model_config_dict(m), kv_cache_dtype=kv_cache_dtype)
    g = expected_geometry(m, kv_cache_dtype=kv_cache_dtype)
    assert (b.n, marker.kernel_page(b.n)) == (g.block_size, g.kernel_page)
    assert b.n // marker.kernel_page(b.n) == g.ratio
    assert b.state_bytes == marker.compute_block_size(model_config_dict(m)).state_bytes


def test_n_of_the_three_ratios_and_the_9b_bench_model() -> None:
    got = {
        name: marker.compute_block_size(model_config_dict(m)).n
        for name, m in GATE_AND_BENCH.items()
    }
    assert got["olmo-r5"] == 80 and got["qwen35-r17"] == 544 and got["qwen35-r25"] == 1600
    assert got[QWEN35_9B.name] == 528  # N = 528 over FlashInfer pages of 16 (bench report)


def test_mtp_lengthens_the_conv_state_and_tensor_parallelism_divides_both_pages() -> None:
    cfg = model_config_dict(MODELS["qwen35-r5"])
    one = marker.compute_block_size(cfg)
    mtp = marker.compute_block_size(cfg, num_speculative_tokens=2)
    assert mtp.conv_bytes - one.conv_bytes == (2 * 4 * 64 + 8 * 64) * 2 * 2  # bf16 conv
    assert mtp.ssm_bytes == one.ssm_bytes
    tp2 = marker.compute_block_size(cfg, tp=2)
    assert tp2.fa_bytes_per_token * 2 == one.fa_bytes_per_token
    assert tp2.state_bytes * 2 == one.state_bytes


def test_qwen35_takes_its_configs_state_dtype_and_a_flag_overrides_it() -> None:
    cfg = model_config_dict(MODELS["qwen35-r5"])
    assert marker.compute_block_size(cfg).ssm_dtype == "float32"
    b = marker.compute_block_size(cfg, mamba_ssm_cache_dtype="bfloat16")
    assert b.ssm_dtype == "bfloat16" and b.ssm_bytes * 2 == marker.compute_block_size(cfg).ssm_bytes
    olmo = marker.compute_block_size(model_config_dict(MODELS["olmo-r5"]))
    assert olmo.ssm_dtype == "bfloat16"  # vLLM applies no such field to OlmoHybrid


def test_vllm_0_33_and_later_align_qwen_gdn_blocks_to_flashinfers_gdn_prefill() -> None:
    b = marker.compute_block_size(model_config_dict(QWEN35_9B))
    assert (b.n, b.n_flashinfer_gdn) == (528, 576)
    olmo = marker.compute_block_size(model_config_dict(MODELS["olmo-r17"]))
    assert olmo.n_flashinfer_gdn is None  # OlmoHybrid's GDN layer exports no checkpoints
    old = "\n".join(marker.block_size_lines(b, "0.29.0", base="0.5.6"))
    new = "\n".join(marker.block_size_lines(b, "0.34.0", base="0.5.6"))
    assert "576" not in old and "vLLM 0.33 and later pick 576 (r = 9)" in new
    assert "at least N (528)" in new
    assert "from N to 2N - 1 (528-1055)" in "\n".join(
        marker.block_size_lines(b, "0.26.0", base="0.5.3")
    )


def test_flash_attn_pages_the_whole_block() -> None:
    b = marker.compute_block_size(model_config_dict(MODELS["qwen35-r17"]))
    assert marker.kernel_page(b.n, "FLASH_ATTN") == b.n
    lines = marker.block_size_lines(b, "0.26.0", "FLASH_ATTN")
    assert any(line.startswith("r              1 ") for line in lines)


def test_config_defaults_are_the_configuration_classes() -> None:
    """A config.json that leaves out the recurrent geometry gets what vLLM's config classes
    default to."""
    pytest.importorskip("transformers")
    from vllm.transformers_utils.configs.olmo_hybrid import OlmoHybridConfig

    bare = {"architectures": ["OlmoHybridForCausalLM"], "hidden_size": 512}
    bare.update(num_attention_heads=8, num_hidden_layers=8, torch_dtype="bfloat16")
    ours = marker._text_config(bare, "olmo_hybrid")
    theirs = OlmoHybridConfig(**{k: v for k, v in bare.items() if k != "architectures"})
    for key in ("num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads"):
        assert ours[key] == getattr(theirs, key), key
    for key in ("linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"):
        assert ours[key] == getattr(theirs, key), key
    qwen = pytest.importorskip("transformers.models.qwen3_5.configuration_qwen3_5")
    text = qwen.Qwen3_5TextConfig()
    defaults = marker.FAMILIES_DEFAULTS["qwen3_5"]
    assert {k: getattr(text, k) for k in defaults} == defaults


def test_page_sizes_agree_with_vllms_own_calculators() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    m = QWEN35_9B
    b = marker.compute_block_size(model_config_dict(m), tp=2, num_speculative_tokens=1)
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        2,
        m.linear_num_key_heads,
        m.linear_num_value_heads,
        m.linear_key_head_dim,
        m.linear_value_head_dim,
        m.conv_kernel,
        1,
    )
    mamba = MambaSpec(shapes=shapes, dtypes=(torch.bfloat16, torch.float32), block_size=-1)
    attn = FullAttentionSpec(
        block_size=1, num_kv_heads=m.num_kv_heads // 2, head_size=m.head_dim, dtype=torch.bfloat16
    )
    assert (b.state_bytes, b.fa_bytes_per_token) == (mamba.page_size_bytes, attn.page_size_bytes)


def test_what_the_calculator_cannot_size_is_an_error_naming_the_log() -> None:
    dense = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64}
    with pytest.raises(marker.BlockSizeError, match="not a hybrid this build serves"):
        marker.compute_block_size(dense)
    with pytest.raises(marker.BlockSizeError, match="nvfp4"):
        marker.compute_block_size(model_config_dict(MODELS["olmo-r5"]), kv_cache_dtype="nvfp4")


def test_block_size_command_reads_a_model_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(model_config_dict(MODELS["qwen35-r25"])))
    assert marker.main(["block-size", str(tmp_path), "--vllm", "0.26.0"]) == 0
    out = capsys.readouterr().out
    assert "N              1600 tokens" in out
    assert "r              25 (FlashInfer pages the block in kernel pages of 64 slots" in out
    assert marker.LOG_GREP in out
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert marker.main(["block-size", str(tmp_path / "config.json")]) == 2
    assert "Setting attention block size to" in capsys.readouterr().err
    assert marker.main(["block-size", str(tmp_path / "absent")]) == 2


def test_kernel_verdicts() -> None:
    cuda_fails = marker.KernelCheck("2.14.1+cu130", "13.0", "ImportError: undefined symbol")
    cpu_fails = marker.KernelCheck("2.13.0+cpu", None, "ImportError: libc10_cuda.so")
    loads = marker.KernelCheck("2.11.0+cu130", "13.0", None)
    no_torch = marker.KernelCheck(None, None, "torch does not import: ModuleNotFoundError")
    assert cuda_fails.refuses and no_torch.refuses
    assert not cpu_fails.refuses and not loads.refuses
    text = "\n".join(marker._kernel_lines(cuda_fails))
    assert "!!! NO with torch 2.14.1+cu130" in text and "refuses every model" in text
    assert "vLLM runs in" in text and "--kernels" in text
    assert "!!!" not in "\n".join(marker._kernel_lines(cpu_fails))
    assert "kernels load   yes" in "\n".join(marker._kernel_lines(loads))
    assert marker.kernels_refused(marker._kernel_lines(cuda_fails))
    assert marker.kernels_refused(marker._kernel_lines(no_torch))
    assert not marker.kernels_refused(marker._kernel_lines(cpu_fails))


def test_the_kernels_probe_loads_an_extension_its_package_already_imported(
    tmp_path: Path,
) -> None:
    """lmcache 0.5.6's package imports its compiled module on a CUDA machine, and a second
    load of the same extension fails (pybind11: a type "is already registered"): the probe
    imports the module as LMCache does, once. Here a Python module stands in for it."""
    pytest.importorskip("torch")
    package = tmp_path / "lmcache"
    package.mkdir()
    (package / "__init__.py").write_text("from lmcache import cuda_ops  # noqa: F401\n")
    (package / "cuda_ops.py").write_text(
        "import builtins\n"
        "if getattr(builtins, 'staging_copy_registered', False):\n"
        "    raise ImportError('generic_type: type \"StagingCopy\" is already registered!')\n"
        "builtins.staging_copy_registered = True\n"
        "def execute_object_group_transfer(): ...\n"
    )
    assert marker.check_kernels(tmp_path, "0.5.6").error is None
    (package / "__init__.py").write_text("")
    (package / "cuda_ops.py").write_text("")
    unbound = marker.check_kernels(tmp_path, "0.5.6").error
    assert unbound == "it binds no execute_object_group_transfer"


def test_the_kernels_probe_names_a_module_found_outside_the_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    (tmp_path / "empty").mkdir()
    other = tmp_path / "other" / "lmcache"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    (other / "cuda_ops.py").write_text("def execute_object_group_transfer(): ...\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "other"))
    error = marker.check_kernels(tmp_path / "empty", "0.5.6").error
    assert error is not None and "not from the install" in error


def test_an_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert marker.main(["verify"]) == 2
    assert "block-size MODEL" in capsys.readouterr().out


def test_what_the_kernels_need_per_base() -> None:
    assert marker.kernels_need("0.5.3", "") == (
        "torch 2.11.x (the pristine lmcache 0.5.3 wheel's, as vLLM 0.26 pins)"
    )
    assert "torch 2.13.x" in marker.kernels_need("0.5.6", "")
    assert marker.kernels_need("0.5.3", "torch 2.13.0+cu130 (CUDA 13.0)").endswith(
        "(built by --kernels)"
    )
    assert "install --base 0.5.6 --kernels" in marker.kernels_advice("0.5.6")


def _installed_hybridfa() -> Path:
    try:
        dist = metadata.distribution("lmcache")
    except metadata.PackageNotFoundError:
        pytest.skip("no lmcache installed")
    installed = Path(str(dist.locate_file(marker.MARKER)))
    if not installed.is_file():
        pytest.skip("the installed lmcache is not a hybrid-FA build")
    return installed


def _run_check(
    cwd: Path, env: dict[str, str] | None = None, args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lmcache._hybridfa", *args],
        cwd=cwd,
        env=env or dict(os.environ),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_the_check_reads_the_installed_build_not_a_tree_in_the_current_folder(
    tmp_path: Path,
) -> None:
    installed = _installed_hybridfa()
    tree = tmp_path / "lmcache"
    tree.mkdir()
    (tree / "__init__.py").write_text("")
    shutil.copy(installed, tree / "_hybridfa.py")  # as `wheel` materializes it
    proc = _run_check(tmp_path)
    assert f"(checking the installed lmcache at {installed.resolve().parent}" in proc.stdout
    assert f"module         {installed.resolve().parent}" in proc.stdout
    assert "RECORD         ok" in proc.stdout, proc.stdout + proc.stderr
    assert "kernels need   torch" in proc.stdout and "kernels load   " in proc.stdout
    kernels = _run_check(tmp_path, args=("kernels",))
    assert kernels.stdout.splitlines()[1].startswith("  kernels need   torch"), kernels.stdout
    assert "RECORD" not in kernels.stdout
    assert kernels.returncode == (marker.EXIT_KERNELS if "!!!" in kernels.stdout else 0)


def test_the_check_of_a_tree_without_an_install_says_so(tmp_path: Path) -> None:
    installed = _installed_hybridfa()
    tree = tmp_path / "lmcache"
    tree.mkdir()
    (tree / "__init__.py").write_text("")
    shutil.copy(installed, tree / "_hybridfa.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = [sys.executable, "-c", "import importlib.metadata as m; m.distribution('lmcache')"]
    if subprocess.run(probe, cwd=tmp_path, env=env, capture_output=True).returncode == 0:
        pytest.skip("this interpreter has an lmcache installed outside PYTHONPATH")
    proc = _run_check(tmp_path, env)
    assert proc.returncode == marker.EXIT_BROKEN
    assert "NOT INSTALLED" in proc.stdout and "is not an install" in proc.stdout
