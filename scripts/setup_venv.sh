#!/usr/bin/env bash
# Create .venv (if missing) with the CPU torch wheel pinned, then install Stacx with its test extras.
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
.venv/bin/python -m pip install -q -e ".[test]"
