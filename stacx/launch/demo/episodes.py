"""The agent demo's held-out measurement: greedy episodes played by a `transformers` model.

    engine = TransformersGreedyEngine(measure.load_reference_model(checkpoint), eos_token_id=tok.eos_token_id)
    scores = play_heldout_episodes(engine, examples, tokenizer=tok, max_new_tokens=48, seed=0)
    scores.success, scores.tool_call_rate, scores.parse_errors, scores.turns

The episodes are Stacx's own (`stacx.rollout.rollin`: the same sessions, tools and rewards as in
training); only the model is read with `transformers`, as in the main demo, so the numbers do not
depend on the engine being trained.
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass
from typing import Sequence

import torch

from stacx.rollout import rollin
from stacx.serving.kv_cache_decoding import new_cache
from stacx.wire.sample import Executor
from stacx.wire.types import GenerateOutput, GenerateRequest, SamplingParams


class TransformersGreedyEngine:
    """The slice of `InferenceEngine` the roll-in uses: greedy `generate` with a `transformers` model,
    prompts of equal length batched, one cached forward per new token (episodes are ~500 tokens long)."""

    def __init__(self, model, *, eos_token_id: int):
        self.model, self.eos_token_id = model, eos_token_id
        # transformers 5.x names the cache argument `cache` (`past_key_values` is deprecated there)
        self.cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        outputs: list[GenerateOutput] = [None] * len(requests)  # type: ignore[list-item]
        by_length: dict[int, list[int]] = {}
        for index, request in enumerate(requests):
            by_length.setdefault(len(request.input_ids), []).append(index)
        for indices in by_length.values():
            max_new_tokens = max(requests[i].sampling.max_new_tokens for i in indices)
            responses = self._greedy([requests[i].input_ids for i in indices], max_new_tokens)
            for index, ids in zip(indices, responses):
                outputs[index] = GenerateOutput(output_ids=ids, output_log_probs=[0.0] * len(ids),
                                                finish_reason="stop" if ids and ids[-1] == self.eos_token_id else "length")
        return outputs

    @torch.no_grad()
    def _greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy responses (through eos) of equal-length prompts."""
        responses: list[list[int]] = [[] for _ in prompts]
        done = torch.zeros(len(prompts), dtype=torch.bool)
        cache = {self.cache_argument: new_cache(self.model.config, len(prompts[0]) + max_new_tokens)}
        logits = self.model(torch.tensor([list(p) for p in prompts], dtype=torch.long), use_cache=True, **cache).logits
        for _ in range(max_new_tokens):
            chosen = logits[:, -1].argmax(-1)  # [B]
            for row in range(len(prompts)):
                if not done[row]:
                    responses[row].append(int(chosen[row]))
            done |= chosen == self.eos_token_id
            if bool(done.all()):
                break
            logits = self.model(chosen[:, None], use_cache=True, **cache).logits  # [B, 1, V]
        return responses


@dataclass(frozen=True)
class EpisodeScores:
    success: float
    """Fraction of episodes that earned reward 1 (for the demo's task: the exact sum after a correct tool call)."""
    tool_call_rate: float
    """Fraction of episodes with at least one well-formed tool call."""
    parse_errors: float
    """Malformed tool calls per episode."""
    turns: float
    """Model replies per episode."""


def play_heldout_episodes(engine, examples: Sequence, *, tokenizer, max_new_tokens: int, seed: int) -> EpisodeScores:
    """One greedy episode per prompt row of `examples` (`stacx.rollout.data.Example`s naming an environment)."""
    rng = random.Random(seed)
    episodes = rollin.start_episodes(examples, n_samples_per_prompt=1, spec=rollin.RollInSpec("student"),
                                     iteration=0, rng=rng, tokenizer=tokenizer)
    rollin.run_turns(episodes, engines={Executor.STUDENT: engine},
                     sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0), tokenizer=tokenizer, rng=rng)
    counts = [episode.sample.metadata["episode"] for episode in episodes]
    n = len(episodes)
    return EpisodeScores(success=sum(float(e.sample.reward or 0.0) >= 1.0 for e in episodes) / n,
                         tool_call_rate=sum(c["tool_calls"] > 0 for c in counts) / n,
                         parse_errors=sum(c["parse_errors"] for c in counts) / n,
                         turns=sum(c["turns"] for c in counts) / n)
