"""Mini-batch updates per rollout (--global-batch-size / --num-steps-per-rollout / --num-epochs).

Fast checks first (no model): the flags' derivation and refusals, the seeded split, the proximal
policy setting, the LR step count, the loop's schedule and metrics rows over fake role groups, the
resume guard. Then one launch of 2 gloo ranks: GRPO with 4 mini-batches per rollout over 3 rollouts
against a plain-PyTorch reference on one process (tests/trainer/mini_batch_reference.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from stacx.trainer.config.mini_batches import (
    mini_batch_indices,
    num_optimizer_steps,
    resolve_mini_batch_schedule,
    sample_groups,
    with_resolved_mini_batches,
)
from stacx.trainer.config.run import ConfigError, RunConfig
from tests.trainer.fakes import FakeRoleGroup, make_trainer


def schedule_of(data_source: str = "rollout", **values):
    config = RunConfig.from_dict({"rollout_batch_size": 8, "n_samples_per_prompt": 4, **values})
    return resolve_mini_batch_schedule(config.rollout, config.train, data_source=data_source)


# ---- flags -------------------------------------------------------------------------------------------

def test_either_flag_derives_the_other_and_inconsistent_values_are_refused():
    assert (schedule_of().global_batch_size, schedule_of().num_steps_per_rollout) == (32, 1)
    derived = schedule_of(global_batch_size=8)
    assert (derived.num_steps_per_rollout, derived.optimizer_steps_per_rollout) == (4, 4)
    assert schedule_of(num_steps_per_rollout=2, num_epochs=3).global_batch_size == 16
    assert schedule_of(num_steps_per_rollout=2, num_epochs=3).optimizer_steps_per_rollout == 6
    assert schedule_of(global_batch_size=16, num_steps_per_rollout=2).num_steps_per_rollout == 2
    assert schedule_of("dataset", global_batch_size=2).num_steps_per_rollout == 4  # SFT/DPO: rows per step
    with pytest.raises(ConfigError, match=r"--global-batch-size 8 x --num-steps-per-rollout 3 = 24 .* holds 32"):
        schedule_of(global_batch_size=8, num_steps_per_rollout=3)
    with pytest.raises(ConfigError, match=r"--global-batch-size 5 does not divide the 32 samples"):
        schedule_of(global_batch_size=5)
    with pytest.raises(ConfigError, match=r"--num-steps-per-rollout 3 does not divide"):
        schedule_of(num_steps_per_rollout=3)
    with pytest.raises(ConfigError, match=r"num_epochs.*>= 1.*--num-epochs"):
        RunConfig.from_dict({"num_epochs": 0})


def test_the_preflight_refuses_inconsistent_mini_batches_before_anything_starts():
    from stacx.trainer.config.checks import PreflightError
    from stacx.trainer.preflight import check_mini_batches
    from stacx.trainer.recipes import get_recipe

    grpo = get_recipe("grpo")
    check_mini_batches(RunConfig.from_dict({"rollout_batch_size": 8, "num_steps_per_rollout": 4}), grpo)
    with pytest.raises(PreflightError, match="--global-batch-size 6 x --num-steps-per-rollout 4"):
        check_mini_batches(RunConfig.from_dict({"rollout_batch_size": 8, "global_batch_size": 6,
                                                "num_steps_per_rollout": 4}), grpo)
    with pytest.raises(PreflightError, match="fewer samples than --data-parallel-size 4"):
        check_mini_batches(RunConfig.from_dict({"rollout_batch_size": 2, "n_samples_per_prompt": 2,
                                                "num_steps_per_rollout": 2, "data_parallel_size": 4}), grpo)


def test_the_lr_schedule_and_the_workers_count_optimizer_steps():
    config = with_resolved_mini_batches(RunConfig.from_dict({"num_steps": 5, "rollout_batch_size": 8,
                                                             "global_batch_size": 8, "num_epochs": 2}), "rollout")
    assert (config.train.global_batch_size, config.train.num_steps_per_rollout) == (8, 4)
    assert num_optimizer_steps(config.train) == 5 * 4 * 2
    assert num_optimizer_steps(RunConfig.from_dict({"num_steps": 5}).train) == 5
    # Resolving the resolved config again changes nothing (workers and saved run configs read it).
    assert with_resolved_mini_batches(config, "rollout") == config


def test_old_log_probs_become_the_proximal_policy_when_a_rollout_feeds_several_steps():
    from stacx.trainer.config.resolve import resolve_algorithm_config
    from stacx.trainer.recipes import get_recipe

    grpo = get_recipe("grpo")
    assert not resolve_algorithm_config(grpo, RunConfig(), environ={}).recompute_old_log_probs
    for values in ({"num_steps_per_rollout": 4}, {"num_epochs": 2}):
        assert resolve_algorithm_config(grpo, RunConfig.from_dict(values), environ={}).recompute_old_log_probs
    with pytest.raises(ConfigError, match="--no-recompute-old-log-probs with 4 optimizer steps per rollout"):
        resolve_algorithm_config(grpo, RunConfig.from_dict({"num_steps_per_rollout": 4,
                                                            "recompute_old_log_probs": False}), environ={})


# ---- the split ---------------------------------------------------------------------------------------

def test_the_split_is_seeded_covers_every_sample_once_per_pass_and_keeps_prompt_groups_whole():
    prompt_ids = [p for p in range(8) for _ in range(4)]
    groups, whole = sample_groups(prompt_ids, None, 32)
    assert not whole and len(groups) == 8
    steps = mini_batch_indices(groups, num_steps_per_rollout=4, num_epochs=2, seed=1, rollout_step=3)
    assert len(steps) == 8 and all(len(s) == 8 for s in steps)
    for epoch in (steps[:4], steps[4:]):
        assert sorted(i for s in epoch for i in s) == list(range(32))
        assert all(len({prompt_ids[i] for i in s}) == 2 for s in epoch)  # 2 whole groups of 4 per mini-batch
    assert steps[:4] != steps[4:]  # each pass reshuffles
    assert steps == mini_batch_indices(groups, num_steps_per_rollout=4, num_epochs=2, seed=1, rollout_step=3)
    assert steps != mini_batch_indices(groups, num_steps_per_rollout=4, num_epochs=2, seed=1, rollout_step=4)
    # 32 samples in 3 mini-batches: sizes 11, 10, 11 (a group may straddle a cut).
    assert [len(s) for s in mini_batch_indices(groups, num_steps_per_rollout=3, num_epochs=1, seed=1,
                                               rollout_step=0)] == [11, 10, 11]
    pairs, whole = sample_groups(None, [0, 0, 1, 1, 2, 2], 6)
    assert whole
    for split in mini_batch_indices(pairs, num_steps_per_rollout=2, num_epochs=1, seed=0, rollout_step=0,
                                    keep_groups_whole=whole):
        assert len(split) % 2 == 0 and all(split[k] // 2 == split[k + 1] // 2 for k in range(0, len(split), 2))
    with pytest.raises(ValueError, match="fewer than --num-steps-per-rollout 7"):
        mini_batch_indices([[0], [1]], num_steps_per_rollout=7, num_epochs=1, seed=0, rollout_step=0)


# ---- the loop over fake role groups ------------------------------------------------------------------

class FieldsRoleGroup(FakeRoleGroup):
    """A fake role that answers `compute_fields` and records each train step's samples and counts."""

    def __init__(self, name: str):
        super().__init__(name)
        self.steps = []

    def compute_fields(self, shards, names):
        self._record("compute_fields:" + ",".join(names))
        return [[{name: [torch.zeros(len(m)) for m in mb.loss_masks] for name in names} for mb in shards[0]]]

    def train_step(self, shards, counts, norm_length):
        self._record("train_step")
        self.steps.append((sum(mb.num_samples for mb in shards[0]), counts.num_tokens))
        return [{"loss": float(len(self.steps)), "grad_norm": 1.0}]


class RecordingLogger:
    def __init__(self):
        self.rows = []

    def log(self, step, metrics):
        self.rows.append((step, dict(metrics)))

    def close(self):
        pass


def rollout_batch(num_prompts: int = 4, group_size: int = 4):
    from stacx.trainer.batch import StepBatch

    lengths = [3 + (i % 5) for i in range(num_prompts * group_size)]
    return StepBatch(tokens=[torch.arange(n + 2) for n in lengths], response_lengths=lengths,
                     loss_masks=[torch.ones(n) for n in lengths], rewards=[float(i % 3) for i in range(len(lengths))],
                     prompt_id=[i // group_size for i in range(len(lengths))])


def test_the_loop_trains_four_steps_per_rollout_on_old_log_probs_computed_once():
    config = RunConfig.from_dict({"num_steps": 2, "rollout_batch_size": 4, "n_samples_per_prompt": 4,
                                  "num_steps_per_rollout": 4})
    policy = FieldsRoleGroup("policy")
    trainer = make_trainer("grpo", roles={"policy": policy}, run_config=config)
    trainer.collect_batch = lambda step: (rollout_batch(), {"rollout/reward_mean": float(step)})
    trainer.engine_target = None
    logger = RecordingLogger()
    trainer.make_metrics_logger = lambda start: logger
    trainer.run()
    assert policy.calls == (["compute_fields:log_probs"] + ["train_step"] * 4) * 2
    # Each step's loss is normalized by its own mini-batch's tokens: the four counts add up to the rollout's.
    batch_tokens = sum(rollout_batch().response_lengths)
    assert all(samples == 4 for samples, _ in policy.steps)
    assert sum(tokens for _, tokens in policy.steps[:4]) == batch_tokens
    # One row per optimizer step: `step` counts optimizer steps, `rollout_step` groups them; the
    # rollout-level metrics are in the rollout's last row.
    assert [(step, row["rollout_step"]) for step, row in logger.rows] == [(i, i // 4) for i in range(8)]
    assert [row["policy/loss"] for _, row in logger.rows] == [float(i) for i in range(1, 9)]
    assert ["rollout/reward_mean" in row for _, row in logger.rows] == [False, False, False, True] * 2
    assert trainer.last_metrics["policy/loss"] == 8.0


def test_a_checkpoint_of_another_mini_batch_schedule_is_refused_on_resume():
    from stacx.trainer.checkpoint import CheckpointError

    trainer = make_trainer("grpo", roles={"policy": FieldsRoleGroup("policy")},
                           run_config=RunConfig.from_dict({"num_steps_per_rollout": 4}))
    trainer.check_resumed_mini_batches({"train": {"global_batch_size": 8, "num_steps_per_rollout": 4,
                                                  "num_epochs": 1}}, where="ckpt/step_2")
    with pytest.raises(CheckpointError, match=r"--num-steps-per-rollout: saved 2, now 4.*run_config.json"):
        trainer.check_resumed_mini_batches({"train": {"num_steps_per_rollout": 2}}, where="ckpt/step_2")
    with pytest.raises(CheckpointError, match=r"saved 1 \(one optimizer step per rollout\)"):
        trainer.check_resumed_mini_batches({"train": {}}, where="ckpt/step_2")  # written before these flags


# ---- end to end: 2 gloo ranks against a plain-PyTorch reference -------------------------------------

@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grpo_with_four_mini_batches_matches_a_plain_pytorch_reference_over_dp2(tmp_path):
    """DP=2 with several micro-batches per rank, 3 rollouts x 4 mini-batches: losses, clip fractions and
    grad norms of every optimizer step agree with a one-process reference within 1e-5 relative (measured:
    ~2.5e-6, 0, ~1.3e-6), old log-probs are computed once per rollout, the clip acts from the second
    mini-batch on, and the LR schedule decays over the 12 optimizer steps."""
    from stacx.rollout.tokenizer import build_char_tokenizer
    from stacx.testing.distributed import run_distributed
    from tests.trainer import mini_batch_reference as reference
    from tests.trainer.training_fixtures import write_tiny_run_files

    root = str(tmp_path)
    checkpoint = write_tiny_run_files(root)["policy"]
    rollouts = reference.make_rollouts(3, len(build_char_tokenizer()))
    results = run_distributed(reference.train_stacx, 2, args=(root, checkpoint, rollouts,
                                                              {"num_steps_per_rollout": 4,
                                                               "max_tokens_per_micro_batch": 40}))
    rows = results[0]["rows"]
    expected = reference.reference_run(checkpoint, rollouts, num_steps_per_rollout=4)
    assert len(rows) == len(expected) == 12
    assert [row["rollout_step"] for row in rows] == [row["rollout_step"] for row in expected]
    assert all(result["calls"] == [["log_probs"]] * 3 and result["recompute_old_log_probs"] for result in results)
    differences = reference.max_relative_differences(rows, expected)
    assert max(differences.values()) < 1e-5, differences
    for index, row in enumerate(rows):
        assert math.isfinite(row["policy/loss"])
        if index % 4 == 0:  # pi == pi_old at a rollout's first update: ratio 1, no clipping
            assert row["policy/pg_clipfrac"] == 0.0 and abs(row["policy/ppo_kl"]) < 1e-6
        else:
            assert row["policy/pg_clipfrac"] > 0.0 and abs(row["policy/ppo_kl"]) > 1e-4
    # The LR (logged after each step) decays linearly over all 12 optimizer steps, not over 3 rollouts.
    settings = reference.SETTINGS
    lrs = [settings["lr"] - (settings["lr"] - settings["min_lr"]) * (i + 1) / 12 for i in range(12)]
    assert [row["policy/lr"] for row in rows] == pytest.approx(lrs, rel=1e-6)
