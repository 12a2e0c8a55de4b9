#!/usr/bin/env bash
# Create .venv (if missing) with the CPU torch wheel pinned, then install Stacx with the extras named
# as arguments: `setup_venv.sh` alone is what `make demo` runs (Stacx and its runtime dependencies);
# `setup_venv.sh test` adds the test extra (pytest, TRL, diffusers) that `make test` needs.
# A torch already importable inside .venv is kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# Each step that can take minutes says what it waits for first (pip itself stays quiet: -q).
if [ ! -x .venv/bin/python ]; then
  echo "setup_venv: creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "setup_venv: installing torch 2.13.0, the CPU wheel (a few hundred MB; minutes on a slow link)..."
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
extras=$(IFS=,; echo "$*")
if [ -n "$extras" ]; then
  echo "setup_venv: installing Stacx and the extras [$extras] (megatron-core, transformers, ray, ...; minutes)..."
  .venv/bin/python -m pip install -q -e ".[$extras]"
else
  echo "setup_venv: installing Stacx and its runtime dependencies (megatron-core, transformers, ray, ...; minutes)..."
  .venv/bin/python -m pip install -q -e .
fi
echo "setup_venv: .venv is ready"
