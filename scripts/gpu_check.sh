#!/usr/bin/env bash
# The GPU check in one command (docs/gpu.md). On the lent GPU machine, with the device tool:
#   run  command: bash scripts/gpu_check.sh --quick     carry: [".gpu"]     timeout_s: 600
# It unpacks the offline bundle built here by `make gpu-bundle` (.gpu/, carried beside the
# checkout: FlashInfer's trimmed package and the pinned wheels it imports that the image lacks,
# installed with pip --no-index --no-deps --target into a temporary site), checks that the bundle
# holds every source FlashInfer's JIT compiles the paged prefill from and every module
# `import flashinfer` needs (or the image has it), puts the carried ninja on PATH, then runs `python -m relaxkv_sglang.gpu_check`: the plugin's repair pass on the GPU against
# the CPU (no host sync allowed in it), the plugin's FlashInfer calls against the torch reference,
# and the repair pass timed against a dense-context repair. Each step prints its time; results go
# to $OUT (or ./gpu-check-out): gpu_check.json (written after every step), gpu_check.log, device.txt.
#
#   bash scripts/gpu_check.sh [--quick] [--dry-run]
#
# --dry-run (any CPU, no GPU): everything but the CUDA calls. The bundle is unpacked and checked
# as on the GPU machine (the wheels are for CPython 3.12: installed with pip's --python-version
# 3.12, not imported), FlashInfer is not imported (its torch model stands in),
# and the check runs every step at small sizes on the CUDA-rules stand-in device.
# Exit: 0 all passed; 1 a step or case off; 2 the bundle or the machine is not usable (one line says why).
set -euo pipefail
QUICK=() DRY=0
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK=(--quick) ;;
    --dry-run) DRY=1 ;;
    *) echo "gpu_check: unknown argument '$arg' (use --quick, --dry-run)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ "$DRY" = 1 ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
T0=$(date +%s) TS=$(date +%s)
step() { local now; now=$(date +%s); echo "gpu_check: $1 done in $(( now - TS )) s, at +$(( now - T0 )) s"; TS=$now; }
die() { echo "gpu_check: $1" >&2; exit 2; }

BUNDLE=${RELAXKV_GPU_BUNDLE:-.gpu}  # another folder only for tests
test -d "$BUNDLE" || die "$BUNDLE/ is missing: run 'make gpu-bundle' here, then carry .gpu with the checkout"
TAR=$(ls "$BUNDLE"/flashinfer-*-prefill.tar.xz 2>/dev/null | head -n1)
WHEELS=("$BUNDLE"/*.whl)
[ -n "$TAR" ] && [ -e "${WHEELS[0]}" ] || die "$BUNDLE/ lacks the FlashInfer archive or the wheels: run 'make gpu-bundle' again and carry .gpu"
echo "gpu_check: $( [ "$DRY" = 1 ] && echo "dry run on $(uname -m), " )python $($PY -c 'import platform; print(platform.python_version())'), bundle $(du -sh "$BUNDLE" | cut -f1)"

SITE=$(mktemp -d "${TMPDIR:-/tmp}/relaxkv-gpu-site.XXXXXX")
trap 'rm -rf "$SITE"' EXIT
PIP_ARGS=(--no-index --no-deps --no-compile --disable-pip-version-check --target "$SITE")
if [ "$DRY" = 1 ]; then  # a cp312 wheel on this Python: as the GPU machine would install it
  PIP_ARGS+=(--python-version 3.12 --implementation cp --only-binary=:all:)
fi
if [ -z "${RELAXKV_GPU_NO_PIP:-}" ] && "$PY" -m pip --version >/dev/null 2>&1; then
  "$PY" -m pip install -q "${PIP_ARGS[@]}" "${WHEELS[@]}" || die "could not install the ${#WHEELS[@]} wheels of $BUNDLE/ (pip, offline)"
else  # an image whose Python has no pip (RELAXKV_GPU_NO_PIP=1: as if): the same layout by zipfile
  PYTHONPATH="$PWD" "$PY" -m relaxkv_sglang.gpu_check.bundle --install "$SITE" "${WHEELS[@]}" \
    || die "could not unpack the ${#WHEELS[@]} wheels of $BUNDLE/ (no pip)"
fi
# Python's lzma, not tar's: the lent image may lack the xz program.
"$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" "$TAR" "$SITE" \
  || die "could not unpack $TAR: run 'make gpu-bundle' again"
test -f "$SITE/tvm_ffi/__init__.py" || die "the tvm-ffi wheel did not unpack a tvm_ffi package"
step "bundle unpacked (${#WHEELS[@]} wheels)"
PYTHONPATH="$PWD" "$PY" -m relaxkv_sglang.gpu_check.bundle --verify "$SITE" || die "the bundle is incomplete: run 'make gpu-bundle' again and carry .gpu"
step "bundle checked"

export PYTHONUNBUFFERED=1
if [ "$DRY" = 1 ]; then
  # FlashInfer is not imported here (tvm-ffi is built for Python 3.12): its torch model stands in.
  export PYTHONPATH="$PWD"
  set +e
  "$PY" -m relaxkv_sglang.gpu_check "${QUICK[@]}" --dry-run --out "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log"
  rc=${PIPESTATUS[0]}
  set -e
  step "check (dry run, exit $rc)"
  exit "$rc"
fi

export PYTHONPATH="$SITE:$PWD"
export PATH="$SITE/bin:$PATH"  # the carried ninja, which FlashInfer's JIT runs by name
export MAX_JOBS=$(nproc) FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
command -v nvidia-smi >/dev/null || die "no nvidia-smi: this is not the GPU machine (use --dry-run on a CPU)"
nvidia-smi -L | tee "$OUT/device.txt"
# Printed, not required: the check records a failed import as a step and still runs the float32 pass.
"$PY" -c "import torch; print('torch', torch.__version__, '| cuda', torch.version.cuda, '| ninja', __import__('shutil').which('ninja'))" | tee -a "$OUT/device.txt" || true
step "device listed"
set +e
"$PY" -m relaxkv_sglang.gpu_check "${QUICK[@]}" --out "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
set -e
step "check (exit $rc)"
exit "$rc"
