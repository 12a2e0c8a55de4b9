"""megatron-core's expected fallback warnings (no Apex / Transformer Engine on CPU) are not printed
by processes that import Stacx, unless STACX_SHOW_BACKEND_WARNINGS=1; other warnings still are."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

from stacx.backend_warnings import SHOW_ENV, silence_expected_backend_warnings

IMPORT_MEGATRON = (
    "import stacx\n"
    "import megatron.core.optimizer, megatron.core.models.backends\n"
    "from megatron.core.models.gpt import gpt_layer_specs\n"
    "from megatron.core.transformer.transformer_config import TransformerConfig\n"
    "TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)\n"
)


def _stderr_of_a_fresh_process(extra_env: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k != SHOW_ENV} | extra_env
    completed = subprocess.run([sys.executable, "-c", IMPORT_MEGATRON], env=env, capture_output=True, text=True,
                               timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stderr


def test_expected_fallback_warnings_are_quiet_and_can_be_shown():
    assert "Warning" not in _stderr_of_a_fresh_process({})
    shown = _stderr_of_a_fresh_process({SHOW_ENV: "1"})
    assert "Apex is not installed" in shown and "Transformer Engine and Apex are not installed" in shown


def test_only_megatrons_fallback_messages_are_filtered():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert silence_expected_backend_warnings({})
        warnings.warn_explicit("Apex is not installed. Falling back", UserWarning, "x.py", 1, module="megatron.core.x")
        warnings.warn_explicit("Apex is not installed. Falling back", UserWarning, "y.py", 1, module="my_project.y")
        warnings.warn_explicit("something else", UserWarning, "x.py", 2, module="megatron.core.x")
    assert [(w.filename, str(w.message)) for w in caught] == [
        ("y.py", "Apex is not installed. Falling back"), ("x.py", "something else")]
    assert not silence_expected_backend_warnings({SHOW_ENV: "1"})
