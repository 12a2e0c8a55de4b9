"""megatron-core's expected fallback warnings (no Apex / Transformer Engine on CPU) are not printed
by processes that import Stacx, unless STACX_SHOW_BACKEND_WARNINGS=1; other warnings still are."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

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


@pytest.mark.slow
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


def test_library_deprecation_notices_a_user_cannot_act_on_are_filtered_where_they_arise():
    notices = [
        ("`load_state_dict` is deprecated and will be removed", FutureWarning,
         "megatron.core.dist_checkpointing.strategies.torch"),
        ("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning,
         "torch.distributed.checkpoint.planner_helpers"),
        ("When using async grad allreduce it is recommended to set the environment variable "
         "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup", UserWarning, "megatron.core.tensor_parallel.layers"),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert silence_expected_backend_warnings({})
        for message, category, module in notices:
            warnings.warn_explicit(message, category, "lib.py", 1, module=module)
            warnings.warn_explicit(message, category, "mine.py", 1, module="my_project.train")
    assert [w.filename for w in caught] == ["mine.py"] * len(notices)


def test_one_start_up_line_names_the_absent_gpu_packages():
    from stacx.backend_warnings import absent_gpu_packages, cpu_path_notice

    installed = {"apex"}
    find_spec = lambda name: object() if name in installed else None  # noqa: E731
    assert absent_gpu_packages(find_spec) == ["transformer-engine", "sglang"]
    notice = cpu_path_notice(False, {}, find_spec)
    assert notice.startswith("stacx: CPU path; optional GPU packages not installed: transformer-engine, sglang (")
    assert "\n" not in notice and f"{SHOW_ENV}=1 shows them" in notice
    assert "hidden" not in cpu_path_notice(False, {SHOW_ENV: "1"}, find_spec)  # nothing hidden then
    assert cpu_path_notice(True, {}, find_spec) is None  # a GPU machine: no CPU-path line
    installed.update({"transformer_engine", "sglang"})
    assert cpu_path_notice(False, {}, find_spec) is None

    def broken(name):
        raise ImportError("half-installed")
    assert absent_gpu_packages(broken) == ["transformer-engine", "apex", "sglang"]


def test_stacx_eval_prints_the_line_once_on_this_cpu_machine(tmp_path, capsys):
    import torch

    from stacx.backend_warnings import absent_gpu_packages
    from stacx.launch.cli import main
    from stacx.tasks import write_tiny_checkpoint

    if torch.cuda.is_available() or not absent_gpu_packages():
        import pytest
        pytest.skip("the CPU-path line is printed on a machine without CUDA and some GPU package")
    checkpoint = write_tiny_checkpoint(str(tmp_path / "ckpt"), "addition")
    assert main(["eval", "--hf-checkpoint", checkpoint, "--task", "addition", "--num-prompts", "2",
                 "--no-progress-bar", "--out", str(tmp_path / "eval.json")]) == 0
    err = capsys.readouterr().err
    assert err.count("stacx: CPU path; optional GPU packages not installed:") == 1
    assert "Falling back" not in err
