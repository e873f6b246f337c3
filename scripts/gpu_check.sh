#!/usr/bin/env bash
# Runs on the lent GPU machine (docs/gpu.md): unpack the bundle built here by
# `make gpu-bundle` (.gpu/, carried), then run the plugin's repair pass on the
# GPU against the CPU (no host sync allowed in it), and compare the plugin's
# FlashInfer calls (the anchors' paged prefill and the chunk-scoped prefill of
# the composed backend) with the torch reference, timed against a dense causal
# prefill. Each step prints its time. Results go to $OUT (or ./gpu-check-out).
#   run: bash scripts/gpu_check.sh [--quick]      carry: [".gpu"]
set -euo pipefail
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
SITE=/tmp/relaxkv-gpu-site
test -d .gpu || { echo "gpu_check: .gpu/ is missing; run 'make gpu-bundle' and carry .gpu" >&2; exit 2; }
T0=$(date +%s)
step() { echo "gpu_check: $1 done at +$(( $(date +%s) - T0 )) s"; }
rm -rf "$SITE" && mkdir -p "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .gpu/apache_tvm_ffi-*.whl
# Python's lzma, not tar's: the lent image may lack the xz program.
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" .gpu/flashinfer-*-prefill.tar.xz "$SITE"
step "bundle unpacked"
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
export MAX_JOBS=$(nproc) FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
nvidia-smi -L | tee "$OUT/device.txt"
python3 -c "import torch, flashinfer; print('torch', torch.__version__, '| flashinfer', flashinfer.__version__)" | tee -a "$OUT/device.txt"
python3 -m relaxkv_sglang.gpu.check --out "$OUT/gpu_check.json" "$@" 2>&1 | tee "$OUT/gpu_check.log"
step "check"
