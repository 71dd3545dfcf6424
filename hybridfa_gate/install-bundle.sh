#!/usr/bin/env bash
# Installs a bundle of `python -m hybridfa_gate.bundle` on the GPU machine, with no package index.
#   bash BUNDLE/install.sh finish BUNDLE     a whole bundle
#   bash PART/install.sh stage PART          each part of a cut bundle, in turn,
#   bash PART/install.sh finish              then this, once
# finish installs the wheels into $SITE (default /tmp/site) in one pip call (namespace packages
# break when two calls write one target) and the pristine lmcache into $PRISTINE (default
# /tmp/lmc-pristine); it links into $SITE/nvidia, where torch looks for its CUDA libraries, the
# files of the interpreter's own site-packages' nvidia/ that the bundle left out, and writes
# $SITE/env.sh.
# STAGE (default /tmp/hybridfa-bundle) is where parts are staged; PY the interpreter (python3).
set -euo pipefail
STAGE=${STAGE:-/tmp/hybridfa-bundle}
SITE=${SITE:-/tmp/site}
PRISTINE=${PRISTINE:-/tmp/lmc-pristine}
PY=${PY:-python3}
pipt() { local t=$1; shift; "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$t" "$@"; }

case "${1:-}" in
  stage)
    mkdir -p "$STAGE" && cp -r "${2:?stage PART}"/. "$STAGE"/
    echo "staged $2: $(find "$STAGE" -type f | wc -l) files in $STAGE" ;;
  finish)
    B=${2:-$STAGE}
    for first in "$B"/*/*.piece00; do
      [ -e "$first" ] || continue
      whole=${first%.piece00}
      cat "$whole".piece[0-9][0-9] > "$whole.tmp" && rm "$whole".piece[0-9][0-9] && mv "$whole.tmp" "$whole"
    done
    pipt "$SITE" "$B"/wheels/*.whl
    pipt "$PRISTINE" "$B"/pristine/*.whl
    own=$(PYTHONPATH= "$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # CUDA 13 wheels share folders (nvidia/cu13/lib): link file by file what the bundle lacks.
    if [ -d "$own/nvidia" ]; then
      (cd "$own/nvidia" && find . \( -type f -o -type l \) ! -path '*/__pycache__/*') | while read -r f; do
        f=${f#./}
        [ -e "$SITE/nvidia/$f" ] && continue
        mkdir -p "$(dirname "$SITE/nvidia/$f")" && ln -s "$own/nvidia/$f" "$SITE/nvidia/$f"
      done
    fi
    # FlashInfer's cuDNN frontend loads the first libcudnn it finds: the bundle's, where it has one.
    lib=""; [ -d "$SITE/nvidia/cudnn/lib" ] && lib="$SITE/nvidia/cudnn/lib:"
    echo "export PYTHONPATH=$SITE LD_LIBRARY_PATH=$lib\${LD_LIBRARY_PATH:-}" > "$SITE/env.sh"
    . "$SITE/env.sh"
    "$PY" -c 'import torch, vllm, flashinfer; print("installed: torch", torch.__version__, "vllm", vllm.__version__, "flashinfer", flashinfer.__version__, "cuda", torch.cuda.is_available())'
    echo "pristine lmcache in $PRISTINE; before each command: . $SITE/env.sh" ;;
  *) echo "usage: install.sh stage PART | finish [BUNDLE]" >&2; exit 2 ;;
esac
