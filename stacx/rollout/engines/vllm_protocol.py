"""vLLM's own wire format, as its OpenAI server (0.32) speaks it: request building and answer parsing.

Generation is `POST /v1/completions` with the prompt as token ids and the ids back:

    {"model": M, "prompt": [ids], "max_tokens": N, "temperature", "top_p", "top_k", "seed",
     "stop_token_ids", "ignore_eos", "logprobs": K, "return_token_ids": true,
     "return_tokens_as_token_ids": true, "request_id": rid, "prompt_logprobs": K?, "logprob_token_ids": [...]?}

answered by `{"choices": [{"token_ids", "finish_reason", "logprobs": {"token_logprobs", "tokens",
"top_logprobs"}, "prompt_logprobs", "routed_experts"}]}`: `tokens` are "token_id:<id>" strings,
`top_logprobs` one {"token_id:<id>": logprob} per position, `prompt_logprobs` one
{"<id>": {"logprob", "rank", "decoded_token"}} per prompt position (null first), and `routed_experts`
base64 of a `.npy` array [tokens - 1, layers, top_k] (servers started with
--enable-return-routed-experts). The server runs with `--logprobs-mode processed_logprobs`, so a
token's log-prob is that of the distribution it was drawn from (after temperature), Stacx's convention
(stacx.wire.types).

Streamed (`"stream": true`), the answer is server-sent events, one `data: {...}` per engine step, then
`data: [DONE]`: each chunk's `choices[0]` holds the step's new `token_ids` and their `logprobs` (the same
fields, for those tokens only), `finish_reason` null until the last; the first one also has
`prompt_token_ids`. No chunk carries `prompt_logprobs` or `routed_experts`, so only requests that ask
neither are streamed (`streams`). A failure after the answer began is a chunk `{"error": {"message",
"type", "code"}}` with the HTTP status the unstreamed call would have answered.

The RL control endpoints (served with VLLM_SERVER_DEV_MODE=1): `POST /pause?mode=abort|wait|keep`,
`POST /resume`, `POST /abort_requests {"request_ids": [...]}` (empty: all), `POST /reset_prefix_cache`,
and `POST /collective_rpc {"method", "args": [json string]}` -> `{"results": [one per worker]}`, which
runs the Stacx worker extension's methods (stacx_vllm_worker.StacxWorkerExtension).
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any, Optional, Sequence

import numpy as np
import torch

from stacx.wire.types import GenerateOutput, GenerateRequest

TOKEN_PREFIX = "token_id:"
_FINISH_REASONS = {"length": "length", "stop": "stop", "abort": "abort"}


def build_completion_payload(request: GenerateRequest, *, model: str) -> dict:
    """One `/v1/completions` body for `request` (token ids in, token ids and log-probs out)."""
    sampling = request.sampling
    payload: dict[str, Any] = {
        "model": model,
        "prompt": list(request.input_ids),
        "max_tokens": max(1, sampling.max_new_tokens),  # vLLM refuses 0: a scoring request's one token is dropped
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "ignore_eos": sampling.ignore_eos,
        "stop_token_ids": list(sampling.stop_token_ids),
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        "add_special_tokens": False,
    }
    if sampling.seed is not None:
        payload["seed"] = int(sampling.seed)
    if request.rid is not None:
        payload["request_id"] = request.rid
    if request.return_logprob:
        payload["logprobs"] = request.top_logprobs_num
        if request.token_ids_logprob:
            payload["logprob_token_ids"] = list(request.token_ids_logprob)
        if request.logprob_start_len >= 0:
            payload["prompt_logprobs"] = request.top_logprobs_num
    return payload


def engine_request_id(rid: str) -> str:
    """The id vLLM's engine knows a completion by: the server names prompt 0 of request `rid` `cmpl-<rid>-0`."""
    return f"cmpl-{rid}-0"


def build_abort_payload(rids: Optional[Sequence[str]] = None) -> dict:
    """`POST /abort_requests`: the engine ids of these requests (`engine_request_id`), or every in-flight
    request (None)."""
    if rids is None:
        return {"request_ids": []}
    rids = list(rids)
    if not all(isinstance(r, str) and r for r in rids):
        raise ValueError(f"abort: request ids must be non-empty strings, got {rids!r}")
    return {"request_ids": [engine_request_id(r) for r in rids]}


def build_rpc_payload(method: str, argument: Optional[dict] = None, *, timeout_s: Optional[float] = None) -> dict:
    """`POST /collective_rpc` body calling a worker-extension method with one JSON-string argument."""
    payload: dict[str, Any] = {"method": method, "args": [] if argument is None else [json.dumps(argument)]}
    if timeout_s is not None:
        payload["timeout"] = float(timeout_s)
    return payload


def parse_rpc_results(body: Any, method: str) -> list[dict]:
    """The per-worker answers of a `/collective_rpc` call (ValueError when the shape is not vLLM's)."""
    results = body.get("results") if isinstance(body, dict) else None
    if not isinstance(results, list) or not results or not all(isinstance(r, dict) for r in results):
        raise ValueError(f"/collective_rpc {method}: expected {{'results': [one object per worker]}}, got "
                         f"{str(body)[:200]}; is the server started with --worker-extension-cls "
                         "stacx_vllm_worker.StacxWorkerExtension?")
    return results


def token_id_of(token: str) -> int:
    """'token_id:123' -> 123 (the server's `return_tokens_as_token_ids` form)."""
    if not isinstance(token, str) or not token.startswith(TOKEN_PREFIX):
        raise ValueError(f"logprobs token {token!r} is not of the form '{TOKEN_PREFIX}<id>'; send "
                         "return_tokens_as_token_ids")
    return int(token[len(TOKEN_PREFIX):])


def _top_pairs(entry: Optional[dict]) -> list[tuple[float, int]]:
    """{"token_id:<id>": logprob} -> [(logprob, id)], most likely first."""
    pairs = [(float(logprob), token_id_of(token)) for token, logprob in (entry or {}).items()]
    return sorted(pairs, key=lambda pair: -pair[0])


def _prompt_entry(entry: Optional[dict], token_id: int) -> tuple[Optional[float], list[tuple[float, int]]]:
    """One `prompt_logprobs` position -> (log-prob of the prompt token, [(logprob, id)] of the others)."""
    if entry is None:
        return None, []
    pairs = [(float(value["logprob"]), int(key)) for key, value in entry.items()]
    own = next((logprob for logprob, tid in pairs if tid == token_id), None)
    return own, sorted(pairs, key=lambda pair: -pair[0])


def _first_positions(logprobs: Optional[dict], count: int) -> dict:
    """A completion's `logprobs` cut to its first `count` generated positions."""
    return {key: (value[:count] if isinstance(value, list) else value) for key, value in (logprobs or {}).items()}


def parse_routed_experts(encoded: Optional[str], num_tokens: int) -> torch.Tensor:
    """`routed_experts` (base64 `.npy`, [tokens - 1, layers, top_k]) -> [num_tokens, layers, top_k] int32."""
    if not isinstance(encoded, str):
        raise ValueError("choices[0].routed_experts is missing: start vLLM with --enable-return-routed-experts "
                         "(a mixture-of-experts model; docs/vllm.md)")
    array = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    routes = torch.from_numpy(np.ascontiguousarray(array)).to(torch.int32)
    if routes.shape[0] != num_tokens:
        raise ValueError(f"choices[0].routed_experts covers {routes.shape[0]} tokens, expected {num_tokens}")
    return routes.sort(dim=-1).values if routes.dim() == 3 else routes


def streams(request: GenerateRequest) -> bool:
    """Whether `request`'s answer can come streamed: it generates, and asks nothing the chunks lack (the prompt's
    log-probs, routed experts)."""
    prompt_asked = request.return_logprob and request.logprob_start_len >= 0
    return request.sampling.max_new_tokens > 0 and not prompt_asked and not request.return_routed_experts


def stream_error(chunk: Any) -> Optional[tuple[int, str]]:
    """(HTTP status, message) of a streamed error chunk; None for a completion chunk."""
    error = chunk.get("error") if isinstance(chunk, dict) else None
    if error is None:
        return None
    if not isinstance(error, dict):
        return 500, str(error)
    return int(error.get("code") or 500), str(error.get("message", error))


def extend_from_chunk(output: GenerateOutput, request: GenerateRequest, chunk: Any, *, weight_version: int) -> bool:
    """Append one streamed completion chunk's tokens (and their log-prob fields) to `output`, the tokens received so
    far of `request`; True when the chunk is the last (its finish reason is then `output`'s). A chunk without
    choices (usage) adds nothing."""
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not choices:
        return False
    choice = choices[0]
    ids = [int(t) for t in choice.get("token_ids") or []]
    if ids or choice.get("logprobs"):
        part = parse_completion_response({"choices": [{**choice, "token_ids": ids, "finish_reason": "length"}]},
                                         request, weight_version=weight_version)
        output.output_ids.extend(part.output_ids)
        output.output_token_versions.extend(part.output_token_versions)
        output.output_log_probs.extend(part.output_log_probs)
        output.output_top_log_probs.extend(part.output_top_log_probs)
        output.output_token_ids_log_probs.extend(part.output_token_ids_log_probs)
    reason = choice.get("finish_reason")
    if reason is None:
        return False
    if reason not in _FINISH_REASONS:
        raise ValueError(f"choices[0].finish_reason {reason!r} is not one of {sorted(_FINISH_REASONS)}")
    output.finish_reason = _FINISH_REASONS[reason]
    return True


def parse_completion_response(body: Any, request: GenerateRequest, *, weight_version: int) -> GenerateOutput:
    """A `/v1/completions` answer -> `GenerateOutput` (every token tagged `weight_version`); checks the ids
    and log-probs line up."""
    try:
        choice = body["choices"][0]
        output_ids = [int(t) for t in choice["token_ids"]]
    except (KeyError, IndexError, TypeError) as err:
        raise ValueError(f"/v1/completions answer lacks choices[0].token_ids (send return_token_ids): "
                         f"{str(body)[:200]}") from err
    reason = choice.get("finish_reason")
    finish = _FINISH_REASONS.get(reason, "abort" if reason is None else None)
    if finish is None:
        raise ValueError(f"choices[0].finish_reason {reason!r} is not one of {sorted(_FINISH_REASONS)}")
    scoring = request.sampling.max_new_tokens == 0  # prefill only (a teacher's scoring): the one token vLLM drew goes
    if scoring:
        choice = {**choice, "token_ids": [], "logprobs": _first_positions(choice.get("logprobs"), 0)}
        output_ids, finish = [], "length"
    out = GenerateOutput(output_ids=output_ids, finish_reason=finish, weight_version=weight_version,
                         output_token_versions=[weight_version] * len(output_ids))
    if request.return_logprob:
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens") or []
        returned = [token_id_of(t) for t in tokens]
        if returned != output_ids:
            raise ValueError(f"choices[0].logprobs.tokens {returned[:8]}... do not match token_ids {output_ids[:8]}...")
        out.output_log_probs = [float(v) for v in logprobs.get("token_logprobs") or []]
        if len(out.output_log_probs) != len(output_ids):
            raise ValueError(f"choices[0].logprobs.token_logprobs has {len(out.output_log_probs)} entries for "
                             f"{len(output_ids)} tokens")
        top = [_top_pairs(entry) for entry in logprobs.get("top_logprobs") or []]
        if request.token_ids_logprob:
            out.output_token_ids_log_probs = top
        elif request.top_logprobs_num > 0:
            out.output_top_log_probs = [pairs[:request.top_logprobs_num] for pairs in top]
        if request.logprob_start_len >= 0:
            entries = choice.get("prompt_logprobs") or []
            if len(entries) != len(request.input_ids):
                raise ValueError(f"choices[0].prompt_logprobs has {len(entries)} entries for a prompt of "
                                 f"{len(request.input_ids)} tokens")
            parsed = [_prompt_entry(entry, tid) for entry, tid in zip(entries, request.input_ids)]
            start = request.logprob_start_len
            out.input_log_probs = [own for own, _ in parsed[start:]]
            if request.top_logprobs_num > 0:
                out.input_top_log_probs = [None if own is None and not pairs else pairs[:request.top_logprobs_num]
                                           for own, pairs in parsed[start:]]
    if request.return_routed_experts and not (finish == "abort" and choice.get("routed_experts") is None):
        # vLLM returns none for a request aborted before its first forward: its continuation routes them all
        out.routed_experts = parse_routed_experts(choice.get("routed_experts"),
                                                  len(request.input_ids) + len(output_ids) - 1)
    return out
