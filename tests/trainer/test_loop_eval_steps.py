"""Where the loop's evaluations land in metrics.jsonl: row k holds the eval of the model after k
training steps (the progress bar's "step k/N"), row 0 the starting model's, and a resumed run
never evaluates step 0 again. In-process: a fake role group, the real StepRollout's eval on an
engine that answers with the number of optimizer steps the policy has taken."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

from stacx.objectives.algorithm_config import AlgorithmConfig
from stacx.rollout.manager import RolloutManager
from stacx.rollout.step_rollout import StepRollout
from stacx.rollout.tokenizer import build_char_tokenizer
from stacx.trainer.batch import StepBatch
from stacx.trainer.config.rollout_plan import rollout_plan
from stacx.trainer.config.run import RunConfig
from stacx.trainer.metrics import MetricsLogger
from stacx.trainer.recipes import get_recipe
from stacx.wire.types import GenerateOutput, SamplingParams
from tests.trainer.fakes import FakeDataSource, FakeRoleGroup, make_trainer

TOKENIZER = build_char_tokenizer()
NUM_STEPS, EVAL_INTERVAL = 4, 2


class StepsDoneEngine:
    """Answers every prompt with the number of train_step calls `policy` has had: the eval's reward."""

    def __init__(self, policy: FakeRoleGroup):
        self.policy = policy

    def generate(self, requests):
        text = str(self.policy.calls.count("train_step"))
        ids = TOKENIZER(text, add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id]
        return [GenerateOutput(output_ids=ids, output_log_probs=[-0.5] * len(ids), finish_reason="stop",
                               weight_version=0) for _ in requests]

    def weight_version(self):
        return 0


def _trainer(tmp_path, *, start_step: int, bar: io.StringIO):
    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    run_config = RunConfig.from_dict({"num_steps": NUM_STEPS, "eval_interval": EVAL_INTERVAL,
                                      "eval_data": str(eval_data), "out": str(tmp_path / "out")})
    policy = FakeRoleGroup("policy")
    trainer = make_trainer("sft", roles={"policy": policy}, run_config=run_config,
                           data=FakeDataSource(StepBatch.supervised([[1, 2]], [[3, 4]])))
    engine = StepsDoneEngine(policy)
    service = SimpleNamespace(
        tokenizer=TOKENIZER, sampling_params=lambda: SamplingParams(max_new_tokens=4),
        manager=lambda step, **_: RolloutManager(engine, tokenizer=TOKENIZER, reward_fn=lambda r, l, m: float(r)))
    trainer.step_rollout = StepRollout(service, None, rollout=run_config.rollout,
                                       plan=rollout_plan(get_recipe("grpo"), run_config),
                                       out_dir=run_config.logging.out, algorithm=AlgorithmConfig())
    trainer.make_metrics_logger = lambda start: MetricsLogger(run_config.logging.out, total_steps=NUM_STEPS,
                                                              start_step=start, tensorboard=False, progress_file=bar,
                                                              plots=False)
    # A resume restores the policy's steps (the engine then serves them) and returns the checkpoint's step.
    policy.calls += ["train_step"] * start_step
    trainer.resume_if_requested = lambda: start_step
    return trainer


def _eval_rows(tmp_path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["eval/mean_reward"]) for row in rows if "eval/mean_reward" in row]


def test_eval_rows_count_the_steps_done_and_start_with_the_starting_model(tmp_path):
    bar = io.StringIO()
    last = _trainer(tmp_path, start_step=0, bar=bar).run()
    # (row step, steps the evaluated model had taken): the same number, from 0 to the end.
    assert _eval_rows(tmp_path) == [(0, 0.0), (2, 2.0), (4, 4.0)]
    steps = [json.loads(line)["step"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]  # training rows 0..3, then the final model's eval row
    assert last["eval/mean_reward"] == 4.0 and "policy/loss" in last
    assert "step 4/4" in bar.getvalue() and "step 5/4" not in bar.getvalue()  # the eval row is not a step


def test_a_resumed_run_does_not_evaluate_step_0_again(tmp_path):
    _trainer(tmp_path, start_step=0, bar=io.StringIO()).run()
    _trainer(tmp_path, start_step=2, bar=io.StringIO()).run()  # resumed from the checkpoint of step 2
    assert _eval_rows(tmp_path) == [(0, 0.0), (2, 2.0), (4, 4.0)]


def test_with_two_optimizer_steps_per_rollout_an_eval_lands_in_its_models_row(tmp_path):
    """Rows count optimizer steps: the eval of the model after k rollouts (2k optimizer steps) is row 2k."""
    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    run_config = RunConfig.from_dict({"num_steps": NUM_STEPS, "eval_interval": EVAL_INTERVAL, "rollout_batch_size": 2,
                                      "num_steps_per_rollout": 2, "eval_data": str(eval_data),
                                      "out": str(tmp_path / "out")})
    policy = FakeRoleGroup("policy")
    trainer = make_trainer("sft", roles={"policy": policy}, run_config=run_config,
                           data=FakeDataSource(StepBatch.supervised([[1, 2], [1, 3]], [[3, 4], [5, 6]])))
    engine = StepsDoneEngine(policy)
    service = SimpleNamespace(
        tokenizer=TOKENIZER, sampling_params=lambda: SamplingParams(max_new_tokens=4),
        manager=lambda step, **_: RolloutManager(engine, tokenizer=TOKENIZER, reward_fn=lambda r, l, m: float(r)))
    trainer.step_rollout = StepRollout(service, None, rollout=run_config.rollout,
                                       plan=rollout_plan(get_recipe("grpo"), run_config),
                                       out_dir=run_config.logging.out, algorithm=AlgorithmConfig())
    trainer.make_metrics_logger = lambda start: MetricsLogger(run_config.logging.out, total_steps=2 * NUM_STEPS,
                                                              start_step=start, tensorboard=False,
                                                              progress_bar=False, plots=False)
    trainer.resume_if_requested = lambda: 0
    trainer.run()
    assert _eval_rows(tmp_path) == [(0, 0.0), (4, 4.0), (8, 8.0)]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(2 * NUM_STEPS + 1))
    assert [row["rollout_step"] for row in rows] == [0, 0, 1, 1, 2, 2, 3, 3, 4]
