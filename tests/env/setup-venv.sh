#!/usr/bin/env bash
# Create the CPU test environment: a venv with lmcache 0.5.3's dependencies (CPU torch),
# vLLM 0.26.0 (--no-deps; only its Python code is imported) and no lmcache at all.
# lmcache itself goes into --target folders that the test runner puts on PYTHONPATH, so
# one venv serves both arms (pristine and patched).
# Usage: tests/env/setup-venv.sh VENV_DIR
set -euo pipefail
VENV=${1:?usage: setup-venv.sh VENV_DIR}
HERE=$(cd "$(dirname "$0")" && pwd)
STAMP="$VENV/.hybridfa-env-$(cat "$HERE/requirements-cpu.txt" "$0" | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ]; then echo "test env up to date: $VENV"; exit 0; fi
rm -rf "$VENV"
python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade "pip>=24"
"$PY" -m pip install -q -r "$HERE/requirements-cpu.txt"
"$PY" -m pip install -q --no-deps vllm==0.26.0 xgrammar
"$PY" -m pip install -q ruff
"$PY" -c "import torch, vllm.v1.kv_cache_interface; print('test env ready: torch', torch.__version__)"
touch "$STAMP"
