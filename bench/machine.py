"""What a bench piece ran on and with: the machine (GPU, driver, CPUs, host and boot ids), the
software (versions, this wheel's revision), the code that measured, and the identity pieces
must share to be merged: one revision, one software set, one GPU model; what the
compile-cache folder holds."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.fs_l2_read import machine as fs_machine

CHECKOUT = Path(__file__).resolve().parent.parent
# The versions whose change makes pieces incomparable (versions from run.collect_environment).
SOFTWARE_KEYS = ("vllm", "torch", "cuda", "flashinfer", "lmcache_dist", "triton")
_MARKER_FIELDS = ("VERSION", "REVISION", "SERIES_SHA256", "TREE_SHA256")


def _hashed(path: str) -> str | None:
    """A short sha256 of a file's stripped text (an id that names no machine)."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:16] if text else None


def gpus() -> list[dict[str, str]] | str:
    query = "--query-gpu=name,driver_version,memory.total,compute_cap"
    try:
        cp = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi failed: {e}"
    keys = ("name", "driver", "memory", "compute_cap")
    return [
        dict(zip(keys, (f.strip() for f in line.split(",")), strict=False))
        for line in cp.stdout.splitlines()
        if line.strip()
    ]


def host(folder: Path) -> dict[str, Any]:
    """CPUs, memory, kernel, the L2 folder's filesystem; host and boot ids (hashed)."""
    facts = fs_machine(folder)
    facts["cpus_usable"] = len(os.sched_getaffinity(0))
    facts["host_id"] = _hashed("/etc/machine-id") or _hashed("/var/lib/dbus/machine-id")
    facts["boot_id"] = _hashed("/proc/sys/kernel/random/boot_id")
    return facts


def wheel_revision(lmcache_dir: Path) -> dict[str, str]:
    """This wheel's marker constants (``lmcache/_hybridfa.py``), read without importing it."""
    try:
        text = (Path(lmcache_dir) / "lmcache" / "_hybridfa.py").read_text()
    except OSError:
        return {}
    out = {}
    for field in _MARKER_FIELDS:
        if m := re.search(rf'^{field} = "([^"]*)"', text, re.M):
            out[field.lower()] = m.group(1)
    return out


def dist_version(folder: Path | None, name: str) -> str | None:
    """The version of distribution ``name`` installed in ``folder`` (pip --target)."""
    if folder is None:
        return None
    for dist in metadata.distributions(path=[str(folder)]):
        if dist.metadata["Name"] == name:
            return dist.version
    return None


def code_digest(root: Path = CHECKOUT) -> str:
    """sha256 of the bench's and the gate's Python files: the code that measured."""
    h = hashlib.sha256()
    for path in sorted([*root.glob("bench/*.py"), *root.glob("hybridfa_gate/*.py")]):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def software(versions: dict[str, Any]) -> dict[str, Any]:
    out = {k: versions.get(k) for k in SOFTWARE_KEYS if k != "triton"}
    try:
        out["triton"] = metadata.version("triton")
    except metadata.PackageNotFoundError:
        out["triton"] = None
    return out


def first_gpu(run: dict[str, Any]) -> dict[str, str]:
    """The run's first GPU; empty where ``nvidia-smi`` failed or listed none."""
    found = run.get("gpus")
    return found[0] if isinstance(found, list) and found else {}


def identity(run: dict[str, Any]) -> dict[str, Any]:
    """What pieces must share to be merged: the GPU model, this wheel's revision (and tree),
    the software set."""
    model = first_gpu(run).get("name")
    rev = run.get("revision") or {}
    return {
        "gpu_model": model,
        "revision": [rev.get("version"), rev.get("tree_sha256")],
        "software": run.get("software") or {},
    }


def identity_key(ident: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]


def folder_summary(folder: Path) -> dict[str, int]:
    """Files and bytes under ``folder`` (the compile cache before and after a piece)."""
    out = {"files": 0, "bytes": 0}
    for p in Path(folder).rglob("*"):
        try:
            if p.is_file():
                out["files"] += 1
                out["bytes"] += p.stat().st_size
        except OSError:  # removed meanwhile
            continue
    return out
