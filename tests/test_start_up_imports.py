"""What a process a run starts imports before it does any work (start-up time, paid by every launch).

A Ray role worker imports `stacx.trainer.cluster.ray.role_worker` when its actor starts; what it
needs later (megatron-core through `stacx.parallel.megatron_import`, the model) it imports when the
driver's calls arrive. The modules below are each a second or more of CPU per process and are used
only elsewhere: the rollout stack and the run checks on the driver, `transformers` in the engine and
the tokenizer, `torch._dynamo` only when something compiles. Run in a fresh interpreter.

Every process that loads a tokenizer (the driver, the preflight, `stacx eval`, `stacx serve`) loads it without
`AutoTokenizer`'s resolution of the model's config class, which imports transformers' model registry and its
model-loading stack (`stacx.models.saved_tokenizer`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

NOT_AT_WORKER_START_UP = ("transformers", "torch._dynamo", "megatron.core", "stacx.trainer.config.checks",
                          "stacx.rollout.agents", "stacx.rollout.manager", "stacx.rollout.evaluation")
"""Packages a role worker must not load by importing its entry module (each with its submodules)."""


NOT_LOADED_BY_A_TOKENIZER = ("transformers.models", "transformers.core_model_loading", "torch.distributed.tensor",
                             "torch._dynamo", "sympy")
"""Packages loading a saved tokenizer must not load: the model registry and what its config classes pull."""


def modules_loaded_by(probe: str) -> list[str]:
    return subprocess.run([sys.executable, "-c", f"{probe}\nimport sys; print('\\n'.join(sys.modules))"], cwd=REPO,
                          capture_output=True, text=True, check=True, timeout=120).stdout.split()


def modules_loaded_by_importing(module: str) -> list[str]:
    return modules_loaded_by(f"import {module}")


def under(loaded: list[str], packages: tuple[str, ...]) -> list[str]:
    return sorted(m for m in loaded if any(m == p or m.startswith(p + ".") for p in packages))


def test_a_ray_role_worker_starts_without_the_rollout_stack_transformers_or_the_compiler():
    loaded = modules_loaded_by_importing("stacx.trainer.cluster.ray.role_worker")
    assert "stacx.trainer.cluster.ray.role_worker" in loaded
    crept_in = under(loaded, NOT_AT_WORKER_START_UP)
    assert not crept_in, (f"importing the role worker's entry module loads {crept_in}: import them where they are "
                          "used (a function-local import with a comment saying why)")


def test_loading_a_saved_tokenizer_loads_no_model_registry(tmp_path):
    """A checkpoint folder as `stacx.tasks.write_tiny_checkpoint` writes its tokenizer (Llama config)."""
    folder = str(tmp_path)
    loaded = modules_loaded_by(
        "import json, os\n"
        "from stacx.rollout.tokenizer import build_char_tokenizer\n"
        "from stacx.models.saved_tokenizer import load_saved_tokenizer\n"
        f"build_char_tokenizer('0123456789=').save_pretrained({folder!r})\n"
        f"with open(os.path.join({folder!r}, 'config.json'), 'w') as handle:\n"
        "    json.dump({'model_type': 'llama'}, handle)\n"
        f"assert load_saved_tokenizer({folder!r}).encode('12=') == [7, 8, 16]")
    assert "transformers.tokenization_utils_tokenizers" in loaded
    crept_in = under(loaded, NOT_LOADED_BY_A_TOKENIZER)
    assert not crept_in, (f"loading a saved tokenizer loads {crept_in}: AutoTokenizer's config-class resolution is "
                          "back (load tokenizers with stacx.models.saved_tokenizer.load_saved_tokenizer)")
