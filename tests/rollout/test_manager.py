"""RolloutManager units with a scripted engine and teacher (no model)."""

import pytest
import torch

from stacx.rollout.manager import RolloutManager
from stacx.rollout.teacher import TeacherScores
from stacx.trainer.batch import StepBatch
from stacx.wire.types import GenerateOutput, SamplingParams

NUM_TOP = 3


class LengthScriptedEngine:
    """Answers prompt i with `prompt[0]` copies of token 7 (so a prompt starting with 0 gets none)."""

    def generate(self, requests):
        return [GenerateOutput(output_ids=[7] * r.input_ids[0], output_log_probs=[-0.25] * r.input_ids[0],
                               finish_reason="stop", weight_version=1) for r in requests]


class ScriptedTeacher:
    def score(self, token_lists, response_lengths, *, top_k):
        return [TeacherScores(log_probs=torch.full((length,), -1.0),
                              top_log_probs=torch.full((length, top_k), -2.0),
                              top_ids=torch.arange(top_k).repeat(length, 1))
                for length in response_lengths]


def test_an_empty_response_keeps_the_batch_teacher_top_fields():
    manager = RolloutManager(LengthScriptedEngine(), teacher=ScriptedTeacher(), num_teacher_top_log_probs=NUM_TOP)
    samples = manager.generate([[2, 5], [0, 5]], SamplingParams(max_new_tokens=4))
    assert [s.response_length for s in samples] == [2, 0]
    batch = StepBatch.from_samples(samples)
    assert [tuple(t.shape) for t in batch["teacher_top_log_probs"]] == [(2, NUM_TOP), (0, NUM_TOP)]
    assert [tuple(t.shape) for t in batch["teacher_top_ids"]] == [(2, NUM_TOP), (0, NUM_TOP)]
    assert batch["teacher_top_ids"][1].dtype == torch.long
    assert [t.tolist() for t in batch["teacher_log_probs"]] == [[-1.0, -1.0], []]


def test_the_former_teacher_top_k_keyword_is_refused_naming_the_new_one():
    """The run config's teacher_top_k is the K of top-K distillation (default 8); the manager's count of
    teacher top log-probs to fetch (0: none) is another setting with its own name."""
    with pytest.raises(TypeError, match=r"RolloutManager\(teacher_top_k=8\) is now "
                                        r"RolloutManager\(num_teacher_top_log_probs=8\)"):
        RolloutManager(LengthScriptedEngine(), teacher=ScriptedTeacher(), teacher_top_k=8)
    assert RolloutManager(LengthScriptedEngine()).num_teacher_top_log_probs == 0
