"""User code reaches every rank (issue 13, item 2): the two commands users hit first, trained for
2 steps through `stacx train` on Ray (workers get the module *source* from the driver) and under
torchrun (every rank imports it), plus a recipe file in `stacx/custom/` (no import cycle). Both runs
also roll out on a toy engine kind registered in a `--custom-module` file (toy_engine.py, issue 29):
its launcher starts the servers, the driver generates through its client, and the policy ranks push
their weights through it. Both train a tiny Qwen3-MoE model with its experts spread over two ranks
(--expert-model-parallel-size 2, issue 31): on Ray the role workers build the expert grid, and the
engine (the CPU engine's server) serves the mixture-of-experts weights both ranks push."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from stacx.tasks import write_tiny_checkpoint
from tests.warm import torchrun_command, warm_python

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
CUSTOM_FOLDER_LAUNCHER = os.path.join(REPO, "tests", "launch", "train_with_custom_folder.py")

SMALL_ROLLOUT = ["--prompt-data", "builtin:sorting", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
                 "--rollout-max-response-len", "6", "--rollout-engine", "cpu", "--no-progress-bar"]

TOY_ENGINE = os.path.join(REPO, "tests", "launch", "toy_engine.py")


def toy_engine_flags(tmp_path) -> tuple[list[str], str]:
    """(flags rolling out on the toy engine kind of a --custom-module file, the file its calls are noted in)."""
    return ["--custom-module", TOY_ENGINE, "--rollout-engine", "toy"], str(tmp_path / "toy_engine.log")


def toy_engine_calls(log: str) -> list[tuple[str, int]]:
    """(call, process id) of every call the toy engine noted."""
    with open(log) as handle:
        return [(call, int(pid)) for call, pid in (line.split() for line in handle)]


EXPERTS_ON_TWO_RANKS = ["--data-parallel-size", "2", "--expert-model-parallel-size", "2"]
PER_EXPERT_LOAD = ["--log-expert-load", "per-expert"]
"""The per-expert token counts `assert_moe_steps_trained_on_both_expert_ranks` reads (a summary by default)."""
MOE_TOP_K = 2
SORTING_PROMPT_TOKENS = 6  # five digits and "=", the character tokenizer's one token each


def assert_moe_steps_trained_on_both_expert_ranks(steps: list[dict]) -> None:
    """Each step's loss is finite, and every MoE layer's logged expert load counts top-k slots for every token of
    the step's sequences (prompt and response), those of the rank holding experts 0-1 and of the one holding
    2-3: a rank whose tokens were not dispatched, or whose counts were not reduced, would leave about half."""
    for step in steps:
        assert math.isfinite(step["policy/loss"]), step
        num_tokens = SORTING_PROMPT_TOKENS * step["policy/num_sequences"] + step["policy/num_loss_tokens"]
        for layer in range(2):
            routed = sum(step[f"policy/moe/layer{layer}/expert{e}_tokens"] for e in range(4))
            assert routed == MOE_TOP_K * num_tokens, (layer, routed, num_tokens)
        assert step["policy/moe/max_imbalance"] >= 1.0


def train_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"})
    env.update(extra or {})
    return env


def run_stacx_train(launcher: str, flags: list[str], out: str, *, custom_dirs: tuple[str, ...] = (),
                    num_steps: int = 2, ray_address: str | None = None, env: dict | None = None) -> list[dict]:
    """Train with `stacx train` on `launcher` and return the metrics of each step. Ray: attached with
    `--ray-address` to `ray_address` (the shared test cluster, whose workers see none of this driver's
    environment or files), or a local cluster of its own when None; torchrun: 2 DP ranks.
    `custom_dirs` are searched as part of `stacx/custom/`."""
    flags = [*flags, "--num-steps", str(num_steps), "--out", out, "--no-plots"]  # plots: the demo's test
    if launcher == "ray" and ray_address is not None:
        flags += ["--ray-address", ray_address]
    if custom_dirs:
        entry = [CUSTOM_FOLDER_LAUNCHER]
    else:
        entry = ["-m", "stacx.train"]
    if launcher == "ray":
        command = [warm_python(), *entry, *flags]
    else:
        command = [*torchrun_command(), "--standalone", "--nproc-per-node=2", *entry, *flags, "--data-parallel-size", "2"]
    env = train_env({**(env or {}),
                     **({"STACX_TEST_CUSTOM_DIRS": os.pathsep.join(custom_dirs)} if custom_dirs else {})})
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert completed.returncode == 0, completed.stderr[-5000:]
    # A successful run ends quietly: no failed teardown request, no library deprecation notices.
    for noise in ("ConnectionError", "FutureWarning", "CUDA_DEVICE_MAX_CONNECTIONS", "Traceback"):
        assert noise not in completed.stderr, completed.stderr[-5000:]
    with open(os.path.join(out, "metrics.jsonl")) as handle:
        steps = [json.loads(line) for line in handle]
    assert len(steps) == num_steps, steps
    return steps


def ray_address_for(launcher: str, request) -> str | None:
    """The shared test cluster's address for a Ray launch (None for torchrun, which uses no Ray)."""
    return request.getfixturevalue("shared_ray_address") if launcher == "ray" else None


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "sorting"), "sorting", seed=0)


@pytest.fixture(scope="module")
def tiny_moe_checkpoint(tmp_path_factory):
    """A tiny random Qwen3-MoE (4 experts, top-2: stacx.models.testing) with the sorting task's tokenizer."""
    from stacx.models.testing import save_tiny_hf_checkpoint
    from stacx.rollout.tokenizer import build_char_tokenizer
    from stacx.tasks import get_task

    folder = str(tmp_path_factory.mktemp("moe") / "sorting")
    tokenizer = build_char_tokenizer(get_task("sorting").alphabet)
    save_tiny_hf_checkpoint(folder, "qwen3_moe", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("launcher", ["ray"])
def test_custom_estimator_and_loss_from_a_file_train_on_every_rank(launcher, tiny_moe_checkpoint, tmp_path, request):
    """The issue's first command (the example's config, tiny sizes): failed in Ray workers with
    `unknown policy loss 'tempered_pg'` before the source was shipped. Under torchrun every rank imports
    the file itself; a file registering an estimator and a loss runs there in
    test_design_doc_examples.py (padded_plugins/my_algorithm.py with its YAML), and a specialization
    file below. GRPO of a Qwen3-MoE model with its experts on two Ray workers (refused on Ray before)."""
    toy_flags, toy_log = toy_engine_flags(tmp_path)
    steps = run_stacx_train(launcher, [
        "--custom-module", "examples/custom_algorithm/my_algo.py", "--config", "examples/configs/grpo.yaml",
        "--advantage-estimator", "rank_centered", "--policy-loss", "tempered_pg",
        "--algorithm-param", "pg_temperature=0.5", "--hf-checkpoint", tiny_moe_checkpoint,
        "--ref-load", tiny_moe_checkpoint, *EXPERTS_ON_TWO_RANKS, *PER_EXPERT_LOAD, "--save", str(tmp_path / "checkpoints"), *SMALL_ROLLOUT, *toy_flags], str(tmp_path / "out"),
        ray_address=ray_address_for(launcher, request), env={"STACX_TEST_TOY_ENGINE_LOG": toy_log})
    # The kernel's own metric is logged (tempered ratio sum / loss tokens, 1 on policy).
    assert all(step["policy/tempered_ratio"] == pytest.approx(1.0, abs=1e-4) for step in steps)
    assert_moe_steps_trained_on_both_expert_ranks(steps)
    # Step 1 sampled from the weights both expert ranks pushed after step 0 (the engine confirms the version).
    assert [step["rollout/weight_version"] for step in steps] == [0.0, 1.0]
    # The driver launched and sampled through the toy kind; the Ray workers (which see none of this
    # environment, so note nothing) looked it up in the shipped file to push weights 1 and 2: an
    # unknown kind would have failed the run, and the engine confirms each version it serves.
    calls = [call for call, _ in toy_engine_calls(toy_log)]
    assert calls[0] == "launch" and calls.count("launch") == 1 and calls.count("generate") >= 2


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("launcher", ["torchrun"])
def test_custom_specialization_class_and_recipe_from_a_file_train_on_every_rank(launcher, tiny_moe_checkpoint, tmp_path,
                                                                               request):
    """docs/adding-an-algorithm.md §4: failed on Ray with `No module named 'stacx_user_module_...'`
    (the specialization class is pickled by reference to the user module). The reward comes from a
    file (`--reward-fn FILE.py:fn`), which was refused with `No module named '<path>'` (issue 27); it runs
    on the driver, so the launcher does not matter for it. On Ray, a specialization and its recipe from
    a file train in test_design_doc_examples.py (specialization_in_one_file/my_algo.py). The two ranks hold
    two experts each of a Qwen3-MoE model (--expert-model-parallel-size 2)."""
    toy_flags, toy_log = toy_engine_flags(tmp_path)
    steps = run_stacx_train(launcher, [
        "--custom-module", "examples/custom_specialization/reward_weighted_sft.py", "--algorithm",
        "reward_weighted_sft", "--algorithm-param", "rwr_temperature=0.5", "--hf-checkpoint", tiny_moe_checkpoint,
        "--expert-model-parallel-size", "2", *PER_EXPERT_LOAD, *SMALL_ROLLOUT, "--reward-fn",
        "tests/launch/constant_reward.py:quarter", *toy_flags], str(tmp_path / "out"),
        ray_address=ray_address_for(launcher, request), env={"STACX_TEST_TOY_ENGINE_LOG": toy_log})
    assert all(step["policy/weighted_nll"] > 0 and step["policy/mean_weight"] > 0 for step in steps)
    assert_moe_steps_trained_on_both_expert_ranks(steps)
    assert all(step["rollout/reward_mean"] == pytest.approx(0.25) for step in steps)
    # Rank 0 drives: it launched the toy servers and sampled through the toy client; as the policy's
    # TP/DP rank 0 it pushed weights 1 and 2 through the same kind.
    calls = toy_engine_calls(toy_log)
    assert [call for call, _ in calls if call.startswith(("launch", "update_weights"))] == [
        "launch", "update_weights_1", "update_weights_2"]
    assert {call for call, _ in calls} == {"launch", "generate", "update_weights_1", "update_weights_2"}
    assert len({pid for _, pid in calls}) == 1  # one process: the driver rank


RECIPE_IN_CUSTOM_FOLDER = '''
from stacx.specializations.causal_decoder import CausalDecoderSpecialization
from stacx.trainer.config.recipe import ModelRole, TrainingConfig
from stacx.trainer.recipes import recipe


class FolderSFTSpecialization(CausalDecoderSpecialization):
    """Plain SFT, defined in a stacx/custom/ file."""


@recipe("folder_sft")
def folder_sft_config():
    return TrainingConfig(
        name="folder_sft",
        roles=(ModelRole(name="policy", specialization_cls=FolderSFTSpecialization, sync_to_rollout=True),),
        syncs=(),
        description="SFT recipe from a stacx/custom/ file",
        data_source="dataset",
    )
'''


@pytest.mark.slow
def test_a_recipe_file_in_the_custom_folder_is_found_without_an_import_cycle(tiny_checkpoint, tmp_path):
    """It crashed `stacx train` with a circular import (stacx.objectives imported stacx/custom/ from its
    __init__, while stacx.trainer.config.recipe was half-imported)."""
    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "folder_recipe.py").write_text(RECIPE_IN_CUSTOM_FOLDER)
    completed = subprocess.run(
        [warm_python(), "-W", "error::RuntimeWarning", CUSTOM_FOLDER_LAUNCHER, "--algorithm", "folder_sft",
         "--hf-checkpoint", tiny_checkpoint, "--prompt-data", "builtin:sorting", "--dry-run"],
        env=train_env({"STACX_TEST_CUSTOM_DIRS": str(folder)}), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "recipe folder_sft" in completed.stdout and "FolderSFTSpecialization" in completed.stdout
