#!/usr/bin/env bash
# Print a folder holding vLLM VERSION's Python code (its wheel without compiled
# extensions), to put first on PYTHONPATH over the test venv's vLLM 0.26.0.
# Usage: tests/env/vllm-overlay.sh PYTHON VERSION
set -euo pipefail
PY=${1:?usage: vllm-overlay.sh PYTHON VERSION}; V=${2:?usage: vllm-overlay.sh PYTHON VERSION}
CACHE=${LMCACHE_HYBRIDFA_CACHE:-$HOME/.cache/lmcache-hybridfa}
DIR=$CACHE/vllm-overlay-$V
if [ ! -f "$DIR/.done" ]; then
  rm -rf "$DIR" "$DIR.whl" && mkdir -p "$DIR" "$DIR.whl"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$DIR.whl" "vllm==$V" >&2
  "$PY" -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
z.extractall(sys.argv[2], [n for n in z.namelist() if not n.endswith(".so")])' "$DIR.whl"/vllm-*.whl "$DIR"
  rm -rf "$DIR.whl"
  touch "$DIR/.done"
fi
# Pure-Python modules that later vLLMs import at module level and the venv (made for
# vLLM 0.26.0) lacks go into the overlay folder too, at the version vLLM pins:
# compressed-tensors (and its loguru) is imported by 0.33's and 0.34's model inspection.
EXTRAS="partial-json-parser compressed-tensors,loguru"  # PACKAGE[,ITS DEPENDENCIES]
if [ "$(cat "$DIR/.extras-done" 2>/dev/null)" != "$EXTRAS" ]; then
  for ITEM in $EXTRAS; do
    IFS=, read -r PKG DEPS <<< "$ITEM"
    SPEC=$(sed -n "s/^Requires-Dist: \($PKG\b[^;]*\).*/\1/Ip" "$DIR"/vllm-*.dist-info/METADATA | head -1)
    if [ -n "$SPEC" ] && ! "$PY" -c "import ${PKG//-/_}" 2>/dev/null; then
      # shellcheck disable=SC2086  # DEPS: a list
      "$PY" -m pip install -q --no-deps --no-compile --target "$DIR" "$SPEC" ${DEPS//,/ } >&2
    fi
  done
  echo "$EXTRAS" > "$DIR/.extras-done"
fi
echo "$DIR"
