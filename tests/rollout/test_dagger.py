"""Roll-in schedules match their formulas; the executor recorded per token matches who acted."""

import math
import random

import pytest

from stacx.rollout.agents.environments import GuessNumberEnvironment
from stacx.rollout.agents.episode import run_episode
from stacx.rollout.dagger import AggreVaTeRollIn, BetaMixtureRollIn, BetaSchedule, TMaxSchedule, build_roll_in
from stacx.rollout.tokenizer import build_char_tokenizer
from stacx.trainer.config.run import TeacherSection
from stacx.wire.sample import Executor
from stacx.wire.types import GenerateOutput, SamplingParams


def test_default_beta_is_linear_one_to_zero_over_five_iterations():
    assert [BetaSchedule()(i) for i in range(7)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.0, 0.0])


@pytest.mark.parametrize("kind", ["linear", "cosine", "exponential", "step"])
def test_beta_schedules_match_formulas(kind):
    s, e, n, rate = 0.9, 0.1, 4, 0.6
    schedule = BetaSchedule(kind=kind, start=s, end=e, num_iters=n, rate=rate)
    for i in range(8):
        u = min(i / n, 1.0)
        expected = {
            "linear": s + (e - s) * u,
            "cosine": e + (s - e) * 0.5 * (1 + math.cos(math.pi * u)),
            "exponential": e + (s - e) * rate ** i,
            "step": s if i < n else e,
        }[kind]
        assert schedule(i) == pytest.approx(expected, abs=1e-12)


def test_t_max_schedule_and_kappa_range():
    assert [TMaxSchedule()(i) for i in (0, 1, 2, 5, 6, 50)] == [0, 20, 40, 100, 100, 100]
    assert [TMaxSchedule(start=3, step=2, cap=8)(i) for i in range(5)] == [3, 5, 7, 8, 8]
    roll_in = AggreVaTeRollIn(TMaxSchedule(start=0, step=1, cap=3))
    rng = random.Random(0)
    seen = set()
    for _ in range(200):
        plan = roll_in.plan(iteration=5, rng=rng)  # T_max = 3
        kappa = plan.kappa
        seen.add(kappa)
        assert [plan(t) for t in range(5)] == [Executor.STUDENT] * kappa + [Executor.TEACHER] * (5 - kappa)
    assert seen == {0, 1, 2, 3}
    assert AggreVaTeRollIn().plan(0, rng)(0) == Executor.TEACHER  # T_max(0) = 0: the teacher does everything


def test_beta_mixture_frequency_and_per_turn_draws():
    rng = random.Random(1)
    roll_in = BetaMixtureRollIn(BetaSchedule(kind="linear", start=1.0, end=0.0, num_iters=4))
    draws = [roll_in.plan(2, rng)(t) for _ in range(500) for t in range(4)]  # beta(2) = 0.5
    assert abs(sum(d == Executor.TEACHER for d in draws) / len(draws) - 0.5) < 0.05
    plan = roll_in.plan(2, rng)
    assert [plan(t) for t in range(6)] == [plan(t) for t in range(6)]  # one draw per turn, remembered


def test_config_validation_and_builder():
    with pytest.raises(ValueError, match="dagger_beta_schedule"):
        BetaSchedule(kind="sigmoid")
    with pytest.raises(ValueError, match="dagger_sampling_mode"):
        build_roll_in(TeacherSection(dagger_sampling_mode="gamma"))
    assert isinstance(build_roll_in(TeacherSection(dagger_sampling_mode="kappa")), AggreVaTeRollIn)
    assert isinstance(build_roll_in(TeacherSection()), BetaMixtureRollIn)


class ScriptedEngine:
    """Answers every turn with a fixed digit followed by eos, and records the calls."""

    def __init__(self, tokenizer, digit, log_prob):
        self.ids = tokenizer(str(digit), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        self.log_prob, self.calls = log_prob, 0

    def generate(self, requests):
        self.calls += 1
        return [GenerateOutput(output_ids=list(self.ids), output_log_probs=[self.log_prob] * len(self.ids),
                               finish_reason="stop")]


def test_recorded_executor_per_token_matches_the_plan():
    tokenizer = build_char_tokenizer()
    student, teacher = ScriptedEngine(tokenizer, 3, -0.5), ScriptedEngine(tokenizer, 5, -9.0)
    engines = {Executor.STUDENT: student, Executor.TEACHER: teacher}
    plan = [Executor.STUDENT, Executor.TEACHER, Executor.STUDENT]
    sample = run_episode(GuessNumberEnvironment(), {"target": 7}, tokenizer=tokenizer, engines=engines,
                         turn_executor=lambda t: plan[t], sampling=SamplingParams(max_new_tokens=4),
                         max_turns=3, rng=random.Random(0))
    assert (student.calls, teacher.calls) == (2, 1)
    assert sample.metadata["turn_executors"] == ["student", "teacher", "student"]
    actions = [i for i, m in enumerate(sample.loss_mask) if m]
    assert [sample.executors[i] for i in actions] == [1, 1, 2, 2, 1, 1]  # digit + eos per turn
    assert all(sample.executors[i] == Executor.ENVIRONMENT for i, m in enumerate(sample.loss_mask) if not m)
    assert [sample.rollout_log_probs[i] for i in actions] == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
    text = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    assert text == "3higher5higher3"
    assert sample.reward == 0.0 and sample.finish_reason == "length"
    assert len(sample.response_ids) == len(sample.loss_mask) == len(sample.executors) == len(sample.rollout_log_probs)
    solved = run_episode(GuessNumberEnvironment(), {"target": 5}, tokenizer=tokenizer, engines=engines,
                         turn_executor=lambda t: Executor.TEACHER, sampling=SamplingParams(max_new_tokens=4),
                         max_turns=3, rng=random.Random(0))
    assert solved.reward == 1.0 and solved.finish_reason == "stop" and set(solved.executors) == {2}
