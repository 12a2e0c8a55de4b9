"""Plain data passed between the rollout driver and an inference engine.

Log-prob convention (the same on every engine and in the trainer): a token's log-prob is
taken from the *sampling distribution after temperature*, `log_softmax(logits / T)` over the
full vocabulary, before top-k/top-p truncation. Top-k/top-p only choose which tokens may be
drawn. Greedy decoding (`temperature == 0`) reports `log_softmax(logits)` (T = 1). The trainer
divides its logits by the same temperature, so the rollout/trainer log-prob mismatch is zero
up to numerics when weights agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling settings; field names follow SGLang's `sampling_params`."""

    max_new_tokens: int = 16
    """Most tokens to generate (0 = score the prompt only, as the teacher does)."""
    temperature: float = 1.0
    """Logits are divided by this before softmax; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 keeps all."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after any of these tokens (it is kept in the output)."""
    ignore_eos: bool = False
    """Do not stop at the engine's end-of-sequence token."""
    seed: Optional[int] = None
    """Seed for this request's sampling (CPU engine); None draws from the engine's generator."""

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise ValueError(f"sampling_params.max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"sampling_params.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling_params.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling_params.top_k must be -1 (all) or >= 1, got {self.top_k}")

    def to_sglang(self) -> dict:
        out = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "ignore_eos": self.ignore_eos,
        }
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        return out

    @classmethod
    def from_sglang(cls, params: dict | None) -> "SamplingParams":
        params = dict(params or {})
        known = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "sampling_seed"}
        unknown = sorted(set(params) - known - _IGNORED_SGLANG_SAMPLING_KEYS)
        if unknown:
            raise ValueError(f"sampling_params: unsupported keys {unknown}; supported: {sorted(known)}")
        return cls(
            max_new_tokens=int(params.get("max_new_tokens", 16)),
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=int(params.get("top_k", -1)),
            stop_token_ids=tuple(int(t) for t in params.get("stop_token_ids") or ()),
            ignore_eos=bool(params.get("ignore_eos", False)),
            seed=params.get("sampling_seed"),
        )


# Accepted and ignored: they only affect text detokenization, which the token-level API skips.
_IGNORED_SGLANG_SAMPLING_KEYS = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """One sequence to continue (or, with max_new_tokens=0, to score)."""

    input_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    return_logprob: bool = True
    """Return per-token log-probs of the generated tokens (and of the prompt from logprob_start_len)."""
    logprob_start_len: int = -1
    """First prompt position whose log-prob is returned; -1 = output tokens only (SGLang's default)."""
    top_logprobs_num: int = 0
    """Also return the K most likely tokens (log-prob, id) at each returned position."""
    token_ids_logprob: tuple[int, ...] = ()
    """Also return the log-probs of these token ids at each returned position."""
    return_routed_experts: bool = False
    """Also return the experts every MoE layer routed each token to (`GenerateOutput.routed_experts`;
    SGLang's `return_routed_experts`, which needs its server flag `--enable-return-routed-experts`)."""
    rid: Optional[str] = None
    """Request id (SGLang's `rid`): `InferenceEngine.abort([rid])` stops this request; None: it can
    only be stopped by aborting every request."""

    def __post_init__(self):
        if len(self.input_ids) == 0:
            raise ValueError("input_ids must not be empty")
        if self.rid is not None and (not isinstance(self.rid, str) or not self.rid):
            raise ValueError(f"rid must be a non-empty string or None, got {self.rid!r}")
        if not -1 <= self.logprob_start_len <= len(self.input_ids):
            raise ValueError(
                f"logprob_start_len must be -1 or in [0, {len(self.input_ids)}], got {self.logprob_start_len}"
            )
        if self.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {self.top_logprobs_num}")


@dataclass(kw_only=True)
class GenerateOutput:
    """An engine's answer to one `GenerateRequest`.

    Prompt fields cover prompt positions `logprob_start_len .. len(prompt)-1`; the log-prob at
    prompt position i is log p(prompt[i] | prompt[:i]); position 0 has none (None), as in SGLang.
    """

    output_ids: list[int]
    output_log_probs: list[float] = field(default_factory=list)
    """The behaviour log-prob of each output token (under the weights of `output_token_versions`)."""
    finish_reason: str = "length"
    """"length" (max_new_tokens reached), "stop" (eos or a stop token), or "abort" (stopped by
    `InferenceEngine.abort`: the fields hold what was generated until then)."""
    input_log_probs: list[Optional[float]] = field(default_factory=list)
    input_top_log_probs: list[Optional[list[tuple[float, int]]]] = field(default_factory=list)
    output_top_log_probs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_ids_log_probs: list[Optional[list[tuple[float, int]]]] = field(default_factory=list)
    output_token_ids_log_probs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_token_versions: list[int] = field(default_factory=list)
    """Per output token, the weight version that produced it (`InferenceEngine.weight_version`)."""
    weight_version: int = 0
    """The oldest weight version among the output's tokens (the engine's version when it started,
    for an output without tokens); one engine call uses one version for all of its tokens."""
    routed_experts: Optional[torch.Tensor] = None
    """With `return_routed_experts`: [len(input_ids) + len(output_ids) - 1, MoE layers, top_k] int32, the
    experts each token the engine ran through the model was sent to (prompt and output tokens; the last
    output token is never run), expert ids ascending per row. The routes of routing replay
    (stacx.models.routing_replay). None when not asked for."""


@dataclass(frozen=True)
class EngineTarget:
    """Where a run's rollout weights go: the engine kind (`cpu` for a `stacx serve` child, `http`,
    `sglang`), its servers' URLs and the key their weight endpoints need (never shown in a repr)."""

    kind: str
    urls: tuple[str, ...]
    api_key: Optional[str] = field(default=None, repr=False)
    weight_transfer: Optional[str] = None
    """How the weights travel when the kind offers a choice (vLLM: --vllm-weight-transfer); None: the kind's own."""

    def push_options(self) -> dict:
        """The keyword arguments a weight push takes beyond the kind, URL and key: only those set."""
        return {} if self.weight_transfer is None else {"weight_transfer": self.weight_transfer}
