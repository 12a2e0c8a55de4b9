#!/usr/bin/env bash
# Create .venv (if missing) with the CPU torch wheel pinned, then install Stacx with the extras named
# as arguments: `setup_venv.sh` alone is what `make demo` runs (Stacx and its runtime dependencies);
# `setup_venv.sh test` adds the test extra (pytest, TRL, diffusers) that `make test` needs.
# A torch already importable inside .venv is kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
extras=$(IFS=,; echo "$*")
if [ -n "$extras" ]; then
  .venv/bin/python -m pip install -q -e ".[$extras]"
else
  .venv/bin/python -m pip install -q -e .
fi
