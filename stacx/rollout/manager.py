"""`RolloutManager`: the trainer's one entry point for producing training samples.

    manager = RolloutManager(engine, tokenizer=tok, reward_fn="math", teacher=TeacherClient(url))
    samples = manager.generate(prompt_ids, sampling, n_samples_per_prompt=4, labels=labels)
    batch = StepBatch.from_samples(samples)        # the trainer's step batch (stacx.trainer.batch)
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Optional, Sequence

import torch

from stacx.objectives.distillation import TEACHER_EXECUTED_SENTINEL
from stacx.wire.engine import InferenceEngine
from stacx.rollout.rewards import RewardFn, compute_rewards, resolve_reward_fn
from stacx.rollout.teacher import TeacherClient
from stacx.wire.types import GenerateRequest, SamplingParams
from stacx.wire.sample import Executor, Sample

logger = logging.getLogger(__name__)


class RolloutManager:
    """Generates samples with an engine and scores rewards and teacher log-probs (weight updates: `RolloutService`)."""

    def __init__(
        self,
        engine: InferenceEngine,
        *,
        tokenizer=None,
        reward_fn: Optional[str | RewardFn] = None,
        teacher: Optional[TeacherClient] = None,
        num_teacher_top_log_probs: int = 0,
        seed: int = 0,
        reward_workers: int = 8,
        reward_timeout_s: Optional[float] = None,
        return_routed_experts: bool = False,
        teacher_top_k: None = None,
    ):
        """num_teacher_top_log_probs: how many of the teacher's top log-probs (and their ids) to fetch per
        response token, for top-K distillation (0: only the sampled token's log-prob).
        reward_timeout_s: per-call limit of the reward function (None: its @reward_timeout, else the default).
        teacher_top_k: the former name of num_teacher_top_log_probs, refused (the run config's
        teacher_top_k is another setting: the teacher's K of top-K distillation, never 0)."""
        if teacher_top_k is not None:
            raise TypeError(f"RolloutManager(teacher_top_k={teacher_top_k!r}) is now "
                            f"RolloutManager(num_teacher_top_log_probs={teacher_top_k!r}) (0 fetches none)")
        self.engine = engine
        self.tokenizer = tokenizer
        self.reward_fn = resolve_reward_fn(reward_fn) if isinstance(reward_fn, str) else reward_fn
        self.teacher = teacher
        self.num_teacher_top_log_probs = num_teacher_top_log_probs
        self.reward_workers = reward_workers
        self.reward_timeout_s = reward_timeout_s
        self._seeds = itertools.count(seed * 1_000_003)
        self.return_routed_experts = return_routed_experts
        """Ask the engine for each token's routed experts (--use-routing-replay)."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        n_samples_per_prompt: int = 1,
        labels: Optional[Sequence[Any]] = None,
        metadatas: Optional[Sequence[dict]] = None,
    ) -> list[Sample]:
        """n samples per prompt (grouped, prompt-major), with rewards and teacher fields if configured.

        Each sample gets its own sampling seed from the manager's counter, so a run is reproducible.
        """
        if n_samples_per_prompt < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
        labels = list(labels) if labels is not None else [None] * len(prompts)
        metadatas = list(metadatas) if metadatas is not None else [{} for _ in prompts]
        requests, owners = [], []
        for index, prompt in enumerate(prompts):
            for _ in range(n_samples_per_prompt):
                seeded = SamplingParams(**{**sampling.__dict__, "seed": next(self._seeds)}) if sampling.seed is None else sampling
                requests.append(GenerateRequest(input_ids=tuple(prompt), sampling=seeded, return_logprob=True,
                                                return_routed_experts=self.return_routed_experts))
                owners.append(index)
        outputs = self.engine.generate(requests)
        samples = []
        for request, output, index in zip(requests, outputs, owners):
            samples.append(Sample(
                prompt_ids=list(request.input_ids), response_ids=list(output.output_ids),
                rollout_log_probs=list(output.output_log_probs), loss_mask=[1] * len(output.output_ids),
                executors=[int(Executor.STUDENT)] * len(output.output_ids), group_index=index,
                finish_reason=output.finish_reason, weight_version=output.weight_version,
                label=labels[index], metadata=dict(metadatas[index] or {}), routed_experts=output.routed_experts,
            ))
        self.decode(samples)
        self.score_rewards(samples)
        self.score_with_teacher(samples)
        return samples

    def decode(self, samples: Sequence[Sample]) -> None:
        if self.tokenizer is None:
            return
        for s in samples:
            s.response_text = self.tokenizer.decode(s.response_ids, skip_special_tokens=True)

    def score_rewards(self, samples: Sequence[Sample]) -> None:
        """Fill `reward` (and `reward_error` where the reward function raised)."""
        if self.reward_fn is None or not samples:
            return
        results = compute_rewards(
            self.reward_fn, [s.response_text for s in samples], [s.label for s in samples],
            [s.metadata for s in samples], max_workers=self.reward_workers, timeout_s=self.reward_timeout_s,
        )
        for s, r in zip(samples, results):
            s.reward, s.reward_error = r.reward, r.error
        failed = sum(r.error is not None for r in results)
        if failed:
            logger.warning("reward function failed on %d of %d samples (marked reward_error)", failed, len(samples))

    def score_with_teacher(self, samples: Sequence[Sample]) -> None:
        """Fill teacher fields; teacher-executed tokens carry the +1.0 sentinel instead of a log-prob."""
        if self.teacher is None:
            return
        scorable = [s for s in samples if s.response_length > 0]
        scores = self.teacher.score([s.tokens for s in scorable], [s.response_length for s in scorable],
                                    top_k=self.num_teacher_top_log_probs)
        for s, sc in zip(scorable, scores):
            log_probs = sc.log_probs.tolist()
            s.teacher_log_probs = [TEACHER_EXECUTED_SENTINEL if e == Executor.TEACHER else lp
                                   for lp, e in zip(log_probs, s.executors)]
            s.teacher_top_log_probs, s.teacher_top_ids = sc.top_log_probs, sc.top_ids
        # An empty response gets empty [0, K] teacher fields: StepBatch.from_samples keeps a field only when
        # every sample has it, so a None here would drop the top-K fields of the whole batch.
        num_top = next((s.teacher_top_ids.shape[1] for s in scorable if s.teacher_top_ids is not None), None)
        for s in samples:
            if s.response_length == 0:
                s.teacher_log_probs = []
                if num_top is not None:
                    s.teacher_top_log_probs = torch.empty(0, num_top, dtype=torch.float32)
                    s.teacher_top_ids = torch.empty(0, num_top, dtype=torch.long)
