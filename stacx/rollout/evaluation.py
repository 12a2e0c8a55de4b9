"""Held-out evaluation (mean reward, pass@k) and rollout dumps for inspection.

pass@k uses the unbiased estimator over n >= k samples with c correct (reward > threshold):
    pass@k = 1 - C(n - c, k) / C(n, k)          averaged over prompts
"""

from __future__ import annotations

import json
import math
import os
from typing import Sequence

from stacx.rollout.data import Example
from stacx.rollout.manager import RolloutManager
from stacx.wire.sample import Sample
from stacx.wire.types import SamplingParams


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={num_samples}")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def evaluate(manager: RolloutManager, examples: Sequence[Example], sampling: SamplingParams, *, n_samples: int = 1,
             correct_threshold: float = 0.5, prefix: str = "eval") -> dict[str, float]:
    """{'eval/mean_reward', 'eval/pass@1', 'eval/pass@n', 'eval/reward_errors'} over `examples`."""
    samples = manager.generate([e.prompt_ids for e in examples], sampling, n_samples_per_prompt=n_samples,
                               labels=[e.label for e in examples], metadatas=[e.metadata for e in examples])
    return evaluation_metrics(samples, num_prompts=len(examples), n_samples=n_samples,
                              correct_threshold=correct_threshold, prefix=prefix)


def evaluation_metrics(samples: Sequence[Sample], *, num_prompts: int, n_samples: int,
                       correct_threshold: float = 0.5, prefix: str = "eval") -> dict[str, float]:
    """`evaluate`'s metrics from scored samples (n_samples per prompt, `group_index` = prompt index)."""
    rewards = [s.reward if s.reward is not None else 0.0 for s in samples]
    metrics = {f"{prefix}/mean_reward": sum(rewards) / len(rewards),
               f"{prefix}/reward_errors": float(sum(s.reward_error is not None for s in samples))}
    for k in sorted({1, n_samples}):
        per_prompt = []
        for index in range(num_prompts):
            group = [r for s, r in zip(samples, rewards) if s.group_index == index]
            per_prompt.append(pass_at_k(len(group), sum(r > correct_threshold for r in group), k))
        metrics[f"{prefix}/pass@{k}"] = sum(per_prompt) / len(per_prompt)
    return metrics


def response_turns(sample: Sample, tokenizer) -> list[dict]:
    """A multi-turn response cut where its loss mask changes, decoded: {"role": "model", "text": ...}
    for the ids the policy generated (its tool calls included, as it wrote them) and {"role":
    "observation", "text": ...} for the ids it was given (tool results, the chat template's turn markers)."""
    turns: list[dict] = []
    start = 0
    mask = list(sample.loss_mask)
    for end in range(1, len(mask) + 1):
        if end == len(mask) or mask[end] != mask[start]:
            turns.append({"role": "model" if mask[start] else "observation",
                          "text": tokenizer.decode(sample.response_ids[start:end])})
            start = end
    return turns


class RolloutDumper:
    """Appends the first `per_step` samples of each step to DIR/rollouts.jsonl."""

    def __init__(self, directory: str, per_step: int = 4, tokenizer=None):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "rollouts.jsonl")
        self.per_step, self.tokenizer = per_step, tokenizer

    def write(self, step: int, samples: Sequence[Sample]) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            for sample in list(samples)[: self.per_step]:
                row = {"step": step, **sample.to_json()}
                if self.tokenizer is not None:
                    row["prompt_text"] = self.tokenizer.decode(sample.prompt_ids)
                    if not row["response_text"]:  # an agent's samples are not decoded on the way
                        row["response_text"] = self.tokenizer.decode(sample.response_ids)
                    if 0 in (sample.loss_mask or ()):  # a multi-turn episode: what the model said, what came back
                        row["turns"] = response_turns(sample, self.tokenizer)
                handle.write(json.dumps(row) + "\n")
