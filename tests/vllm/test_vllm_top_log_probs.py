"""Top-k log-probs from a live vLLM server, for distillation: the rollout's top-k per generated token, and a
teacher's top-k per response token of given trajectories (`TeacherClient` over a `VllmEngine`: prefill-only
scoring, which vLLM serves as one drawn token the client drops), each equal to the trainer's fp32 top-k."""

from __future__ import annotations

import pytest
import torch

from stacx.rollout.engines.vllm import VllmEngine
from stacx.rollout.teacher import TeacherClient
from stacx.wire.types import GenerateRequest, SamplingParams
from tests.vllm.test_vllm_engine import FP32_TOLERANCE, PROMPTS, push_checkpoint, trainer_log_probs

pytestmark = pytest.mark.vllm

TOP_K = 4


def test_top_k_log_probs_of_the_rollout_and_of_a_teacher_agree_with_the_trainer(vllm_engine, vllm_checkpoints):
    served = vllm_checkpoints[0]
    push_checkpoint(vllm_engine, served)
    request = GenerateRequest(input_ids=PROMPTS[0], top_logprobs_num=TOP_K,
                              sampling=SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, ignore_eos=True))
    (output,) = vllm_engine.generate([request])
    sequence = list(PROMPTS[0]) + output.output_ids
    (ref,) = trainer_log_probs(served, [sequence])
    start = len(PROMPTS[0]) - 1
    expected = [ref[start + j].topk(TOP_K) for j in range(len(output.output_ids))]
    assert len(output.output_top_log_probs) == len(output.output_ids)
    for pairs, (values, ids) in zip(output.output_top_log_probs, expected):
        assert [token for _, token in pairs] == ids.tolist()
        assert max(abs(lp - v) for (lp, _), v in zip(pairs, values.tolist())) < FP32_TOLERANCE

    teacher = TeacherClient(engines=[VllmEngine(vllm_engine.url)])
    try:
        (scores,) = teacher.score([sequence], [len(output.output_ids)], top_k=TOP_K)
    finally:
        teacher.close()
    gathered = torch.tensor([ref[start + j, token].item() for j, token in enumerate(output.output_ids)],
                            dtype=torch.float64)
    torch.testing.assert_close(scores.log_probs.double(), gathered, atol=FP32_TOLERANCE, rtol=0)
    assert scores.top_ids.tolist() == [ids.tolist() for _, ids in expected]
    torch.testing.assert_close(scores.top_log_probs.double(), torch.stack([values for values, _ in expected]),
                               atol=FP32_TOLERANCE, rtol=0)
    print(f"vLLM top-{TOP_K} vs trainer fp32: rollout and teacher equal to {FP32_TOLERANCE} over "
          f"{len(output.output_ids)} positions")
