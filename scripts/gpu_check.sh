#!/usr/bin/env bash
# The GPU check in one command (one CUDA GPU; an H200 finishes in <= 8 minutes):
#   bf16 model parity vs transformers, a timed ~1B Qwen2-shaped training step (tokens/s, MFU),
#   the log-prob kernels at vocab 151,936 x 8k tokens vs megatron-core; writes bench/results/gpu.json.
#
#   scripts/gpu_check.sh [--megatron-wheel PATH] [--out FILE] [--peak-tflops 790]
#   scripts/gpu_check.sh --dry-run      # CPU: the same code at tiny sizes, then checks the JSON it wrote
#
# The GPU machine has no network: when megatron-core is not installed, the script installs the
# cp312 wheel it is given (--megatron-wheel PATH or STACX_MEGATRON_WHEEL) with --no-deps --no-index.
# Python: $PYTHON (default python3). Time limit: $GPU_CHECK_TIMEOUT_S seconds (default 480).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
WHEEL=${STACX_MEGATRON_WHEEL:-}
DRY_RUN=0
OUT=""
PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --megatron-wheel) WHEEL="$2"; shift ;;
    --megatron-wheel=*) WHEEL="${1#*=}" ;;
    --out) OUT="$2"; shift ;;
    --out=*) OUT="${1#*=}" ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) PASS+=("$1") ;;
  esac
  shift
done

# Whether it is installed, not an import of it: importing megatron-core costs several seconds of CPU,
# and the run below imports it anyway (and fails with its traceback if the installation is broken).
if ! "$PYTHON" -c "import importlib.util as u, sys; sys.exit(u.find_spec('megatron') is None or u.find_spec('megatron.core') is None)" \
    >/dev/null 2>&1; then
  if [ -z "$WHEEL" ]; then
    echo "gpu_check: megatron-core is not installed for $PYTHON; pass its wheel with --megatron-wheel PATH" \
         "or STACX_MEGATRON_WHEEL=PATH (pip download megatron-core==0.16.1 --no-deps --only-binary :all:" \
         "--python-version 3.12 -d DIR, on a machine with network)" >&2
    exit 2
  fi
  if [ ! -f "$WHEEL" ]; then
    echo "gpu_check: --megatron-wheel $WHEEL: no such file" >&2
    exit 2
  fi
  "$PYTHON" -m pip install --no-deps --no-index "$WHEEL"
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
TIMEOUT_S=${GPU_CHECK_TIMEOUT_S:-480}
if [ "$DRY_RUN" = 1 ]; then
  OUT=${OUT:-$(mktemp -d)/gpu_dry_run.json}
  timeout "$TIMEOUT_S" "$PYTHON" bench/gpu_check.py --dry-run --out "$OUT" ${PASS[@]+"${PASS[@]}"}
else
  OUT=${OUT:-bench/results/gpu.json}
  timeout "$TIMEOUT_S" "$PYTHON" bench/gpu_check.py --out "$OUT" ${PASS[@]+"${PASS[@]}"}
fi
"$PYTHON" bench/gpu_check.py --check "$OUT"
