"""Continuing an aborted generation: the request that resumes it, and the joined output.

Partial rollout (asynchronous RL) interrupts in-flight requests at a weight update
(`InferenceEngine.abort`), keeps what they generated, and continues them under the new weights:

    first = engine.submit(request).result()              # finish_reason "abort" after the abort
    engine.update_weights(buckets, version=v + 1)
    rest = engine.generate([continuation_request(request, first)])[0]
    whole = join_outputs(first, rest)                    # one output, every token with its version

The continuation's prompt is the original prompt followed by the tokens generated so far, and its
budget what is left of `max_new_tokens`; the engine recomputes their KV cache (under the new
weights) and goes on. Each joined token keeps the behaviour log-prob and the weight version of the
call that produced it, so the trainer can weigh every token against the policy that sampled it.

Repeated interruptions: always continue the ORIGINAL request from the output joined so far
(`continuation_request(request, joined)`); the functions are stateless.

What a continuation reproduces: with unchanged weights, a greedy (temperature 0) request continues
with exactly the tokens an uninterrupted generation picks (their log-probs equal to fp32 rounding:
the generated tokens are prefilled instead of decoded one by one). A sampled request continues
with a fresh seed (`continuation_seed`): a valid draw from the same policy, not the same draw.
"""

from __future__ import annotations

import dataclasses

from stacx.wire.types import GenerateOutput, GenerateRequest

_SEED_MASK = (1 << 31) - 1  # SGLang has kept sampling seeds in int32 tensors


def continuation_seed(seed: int, num_generated: int) -> int:
    """A seed for the continuation of a request seeded `seed` after `num_generated` tokens.

    Re-using `seed` would replay the draws the first segment already used (the continued tokens
    would depend on the earlier ones through the same uniforms); a hash of (seed, num_generated)
    gives fresh, reproducible draws (a 64-bit mix, kept to 31 bits: a non-negative int32 for SGLang).
    """
    x = (seed * 0x9E3779B97F4A7C15 + num_generated + 1) & ((1 << 64) - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 31)) & _SEED_MASK


def continuation_request(request: GenerateRequest, so_far: GenerateOutput) -> GenerateRequest:
    """The request that continues `request` after it was aborted having produced `so_far`.

    input_ids = request.input_ids + so_far.output_ids; max_new_tokens = what is left; prompt
    log-probs are not asked again when `so_far` holds them (logprob_start_len = -1; an output that
    stopped before its first token may not: an engine that died before streaming any); the output
    log-prob fields (top-K, chosen ids) and the rid stay; a seed becomes `continuation_seed`.
    """
    if so_far.finish_reason != "abort":
        raise ValueError(f"continuation_request: the output finished with {so_far.finish_reason!r}, not 'abort'; "
                         "only an aborted generation is continued")
    remaining = request.sampling.max_new_tokens - len(so_far.output_ids)
    if remaining <= 0:
        raise ValueError(f"continuation_request: the output already holds {len(so_far.output_ids)} tokens, "
                         f"sampling.max_new_tokens is {request.sampling.max_new_tokens}: nothing is left to generate")
    seed = request.sampling.seed
    sampling = dataclasses.replace(
        request.sampling, max_new_tokens=remaining,
        seed=None if seed is None else continuation_seed(seed, len(so_far.output_ids)))
    prompt_again = not so_far.output_ids and not so_far.input_log_probs
    return dataclasses.replace(request, input_ids=tuple(request.input_ids) + tuple(so_far.output_ids),
                               sampling=sampling, logprob_start_len=request.logprob_start_len if prompt_again else -1)


def join_outputs(so_far: GenerateOutput, continued: GenerateOutput) -> GenerateOutput:
    """`so_far` (aborted) followed by `continued` (the answer to `continuation_request`): output
    fields concatenated token by token, prompt fields from `so_far` (from `continued` when `so_far`
    stopped before any: `continuation_request` asked them again), the finish reason of
    `continued`, `weight_version` the oldest version among the tokens."""
    if so_far.finish_reason != "abort":
        raise ValueError(f"join_outputs: the first segment finished with {so_far.finish_reason!r}, not 'abort'")
    for segment, name in ((so_far, "so_far"), (continued, "continued")):
        if segment.output_ids and len(segment.output_token_versions) != len(segment.output_ids):
            raise ValueError(f"join_outputs: {name} has {len(segment.output_ids)} tokens but "
                             f"{len(segment.output_token_versions)} output_token_versions")
    versions = so_far.output_token_versions + continued.output_token_versions
    prompt = so_far if so_far.output_ids or so_far.input_log_probs else continued
    return GenerateOutput(
        output_ids=so_far.output_ids + continued.output_ids,
        output_log_probs=so_far.output_log_probs + continued.output_log_probs,
        finish_reason=continued.finish_reason,
        input_log_probs=list(prompt.input_log_probs),
        input_top_log_probs=list(prompt.input_top_log_probs),
        output_top_log_probs=so_far.output_top_log_probs + continued.output_top_log_probs,
        input_token_ids_log_probs=list(prompt.input_token_ids_log_probs),
        output_token_ids_log_probs=so_far.output_token_ids_log_probs + continued.output_token_ids_log_probs,
        output_token_versions=versions,
        weight_version=min(versions) if versions else continued.weight_version,
        # the continuation ran the whole sequence (prompt and the tokens so far) again: its routes cover it
        routed_experts=continued.routed_experts,
    )
