"""SGLang's native `/generate` wire format: request building and response parsing.

Pure functions shared by the HTTP client (talking to SGLang or `stacx serve`) and by the
`stacx serve` server (which answers in the same shape). Field names follow SGLang's
`GenerateReqInput` and its `meta_info`; see docs/sglang.md for the version they were read from.

A batch request carries one list entry per sequence for every per-request field:

    {"input_ids": [[...], ...], "sampling_params": [{...}, ...], "return_logprob": [True, ...],
     "logprob_start_len": [-1, ...], "top_logprobs_num": [0, ...], "token_ids_logprob": [[...]|None, ...]}

and the answer is a list of `{"output_ids": [...], "meta_info": {...}}`. Log-prob entries are
`[logprob, token_id, text_or_null]` triples; the first prompt position's log-prob is null.

Abort (partial rollout): requests with an id carry `"rid": [...]` (one per sequence; SGLang needs
all or none, so the ones without get a fresh id); `POST /abort_request` takes `{"rid": id}` or
`{"abort_all": true}`, and the aborted request's own `/generate` answer holds the tokens generated
so far with `meta_info.finish_reason.type == "abort"`. An answer is produced under one weight
version (`meta_info.weight_version`), which every one of its tokens records.
"""

from __future__ import annotations

import base64
import math
import uuid
from typing import Any, Optional, Sequence

import torch

from stacx.wire.types import GenerateOutput, GenerateRequest, SamplingParams

_FINISH_TYPES = {"length", "stop", "abort"}


def build_generate_payload(requests: Sequence[GenerateRequest]) -> dict:
    """One batched `/generate` body for `requests` (token ids in, no text)."""
    if not requests:
        raise ValueError("build_generate_payload: no requests")
    payload = {
        "input_ids": [list(r.input_ids) for r in requests],
        "sampling_params": [r.sampling.to_sglang() for r in requests],
        "return_logprob": [r.return_logprob for r in requests],
        "logprob_start_len": [r.logprob_start_len for r in requests],
        "top_logprobs_num": [r.top_logprobs_num for r in requests],
        "return_text_in_logprobs": False,
        "stream": False,
    }
    if any(r.token_ids_logprob for r in requests):
        payload["token_ids_logprob"] = [list(r.token_ids_logprob) or None for r in requests]
    if any(r.return_routed_experts for r in requests):
        payload["return_routed_experts"] = [r.return_routed_experts for r in requests]
    if any(r.rid is not None for r in requests):
        payload["rid"] = [r.rid if r.rid is not None else uuid.uuid4().hex for r in requests]
    return payload


def build_abort_payload(rid: Optional[str] = None) -> dict:
    """SGLang's `POST /abort_request` body: one request by its rid, or every request (rid None)."""
    if rid is None:
        return {"abort_all": True}
    if not isinstance(rid, str) or not rid:
        raise ValueError(f"abort: rid must be a non-empty string, got {rid!r}")
    return {"rid": rid}


def parse_abort_payload(payload: Any) -> Optional[list[str]]:
    """A `/abort_request` body -> the rids to abort (None: every request). SGLang's shape:
    `{"rid": "<id>"}` or `{"abort_all": true}`; a list of rids is taken as well."""
    if not isinstance(payload, dict):
        raise ValueError('/abort_request: body must be a JSON object, {"rid": "<id>"} or {"abort_all": true}')
    abort_all = payload.get("abort_all", False)
    if not isinstance(abort_all, bool):
        raise ValueError(f"/abort_request: 'abort_all' must be true or false, got {abort_all!r}")
    rid = payload.get("rid")
    if abort_all:
        return None
    rids = rid if isinstance(rid, list) else [rid]
    if rid in (None, "", []) or not all(isinstance(r, str) and r for r in rids):
        raise ValueError(f"/abort_request: 'rid' must be a non-empty string (or a list of them), got {rid!r}; "
                         'send {"abort_all": true} to abort every request')
    return rids


def entries_to_pairs(entries: Optional[list]) -> Optional[list[tuple[float, int]]]:
    """SGLang's `[[log-prob, token id, text], ...]` of one position -> [(log-prob, token id), ...] (None stays)."""
    if entries is None:
        return None
    return [(as_optional_float(e[0]), int(e[1])) for e in entries]


def as_optional_float(value) -> Optional[float]:
    """A JSON log-prob (None at a position that has none) as a float."""
    return None if value is None else float(value)


def parse_finish_reason(raw: Any) -> str:
    """SGLang reports `{"type": "length"|"stop"|"abort", ...}` (or null while unfinished)."""
    if raw is None:
        return "abort"
    kind = raw.get("type") if isinstance(raw, dict) else raw
    if kind not in _FINISH_TYPES:
        raise ValueError(f"meta_info.finish_reason: unknown type {kind!r}, expected one of {sorted(_FINISH_TYPES)}")
    return kind


#: dtypes SGLang may send routed experts in (`meta_info.routed_experts_dtype`; int32 when absent).
_ROUTE_WIRE_DTYPES = {"int32": torch.int32, "int16": torch.int16, "uint8": torch.uint8, "int64": torch.int64}


def parse_routed_experts(meta: dict, num_tokens: int) -> torch.Tensor:
    """SGLang's `meta_info.routed_experts` (base64 of a flat row-major array, tokens x layers x top_k, of
    `routed_experts_dtype`, int32 by default) -> [num_tokens, layers * top_k] int32."""
    encoded = meta.get("routed_experts")
    if not isinstance(encoded, str):
        raise ValueError("meta_info.routed_experts is missing: start SGLang with --enable-return-routed-experts "
                         "(docs/sglang.md, 'Routing replay')")
    dtype_name = meta.get("routed_experts_dtype") or "int32"
    if dtype_name not in _ROUTE_WIRE_DTYPES:
        raise ValueError(f"meta_info.routed_experts_dtype {dtype_name!r} is not one of {sorted(_ROUTE_WIRE_DTYPES)}")
    raw = bytearray(base64.b64decode(encoded))
    flat = torch.frombuffer(raw, dtype=_ROUTE_WIRE_DTYPES[dtype_name]) if raw else torch.zeros(0, dtype=torch.int32)
    if num_tokens <= 0 or flat.numel() % num_tokens:
        raise ValueError(f"meta_info.routed_experts holds {flat.numel()} ids, not a whole number per each of the "
                         f"{num_tokens} tokens the engine ran")
    return flat.to(torch.int32).view(num_tokens, -1)


def parse_generate_item(item: dict, request: GenerateRequest) -> GenerateOutput:
    """One `{"output_ids", "meta_info"}` answer -> `GenerateOutput` (checks the lengths line up)."""
    try:
        meta = item["meta_info"]
        output_ids = [int(t) for t in item["output_ids"]]
    except (KeyError, TypeError) as err:
        raise ValueError(f"/generate answer lacks 'output_ids' or 'meta_info': {str(item)[:200]}") from err
    version = int(meta.get("weight_version") or 0)
    out = GenerateOutput(
        output_ids=output_ids,
        finish_reason=parse_finish_reason(meta.get("finish_reason")),
        weight_version=version,
        output_token_versions=[version] * len(output_ids),
    )
    if request.return_routed_experts:
        out.routed_experts = parse_routed_experts(meta, len(request.input_ids) + len(output_ids) - 1)
    if request.return_logprob:
        output_entries = meta.get("output_token_logprobs") or []
        out.output_log_probs = [float(e[0]) for e in output_entries]
        returned_ids = [int(e[1]) for e in output_entries]
        if returned_ids != output_ids:
            raise ValueError(
                f"meta_info.output_token_logprobs token ids {returned_ids[:8]}... do not match output_ids {output_ids[:8]}..."
            )
        if request.logprob_start_len >= 0:
            input_entries = meta.get("input_token_logprobs") or []
            expected = len(request.input_ids) - request.logprob_start_len
            if len(input_entries) != expected:
                raise ValueError(
                    f"meta_info.input_token_logprobs has {len(input_entries)} entries, expected {expected} "
                    f"(prompt {len(request.input_ids)} tokens from logprob_start_len {request.logprob_start_len})"
                )
            out.input_log_probs = [as_optional_float(e[0]) for e in input_entries]
        if request.top_logprobs_num > 0:
            out.output_top_log_probs = [entries_to_pairs(p) for p in meta.get("output_top_logprobs") or []]
            if request.logprob_start_len >= 0:
                out.input_top_log_probs = [entries_to_pairs(p) for p in meta.get("input_top_logprobs") or []]
        if request.token_ids_logprob:
            out.output_token_ids_log_probs = [entries_to_pairs(p) for p in meta.get("output_token_ids_logprobs") or []]
            if request.logprob_start_len >= 0:
                out.input_token_ids_log_probs = [entries_to_pairs(p) for p in meta.get("input_token_ids_logprobs") or []]
    return out


def parse_generate_response(body: Any, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
    """A `/generate` answer (a list for a batch, a dict for one request) -> outputs in order."""
    items = body if isinstance(body, list) else [body]
    if len(items) != len(requests):
        raise ValueError(f"/generate returned {len(items)} answers for {len(requests)} requests")
    return [parse_generate_item(item, request) for item, request in zip(items, requests)]


# ---- server side: the same format read and written by `stacx serve` --------------------------

_BATCHABLE = ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "rid",
              "return_routed_experts")


def parse_generate_payload(payload: Any, tokenizer: Any = None) -> tuple[list[GenerateRequest], bool]:
    """A `/generate` body -> (requests, is_batch).

    The prompt is `input_ids` (token ids, or a list of such lists) or, as in SGLang, `text` (a
    string, or a list of strings), which `tokenizer` encodes; a server without a tokenizer
    refuses `text`. Giving both is an error.

    Every field is type-checked as JSON gives it (no coercion: `"false"` is not a boolean, `1.0` is
    not a token id, NaN and inf are not temperatures); a mistake raises ValueError naming the
    field and, in a batch, the request index.
    """
    if not isinstance(payload, dict):
        raise ValueError("/generate body must be a JSON object")
    if payload.get("text") is not None:
        payload = dict(payload, input_ids=encode_text_prompts(payload, tokenizer))
    if payload.get("stream") not in (None, False):
        raise ValueError("/generate: 'stream' is not supported by this server")
    input_ids = payload.get("input_ids")
    if not isinstance(input_ids, list) or not input_ids:
        raise ValueError("/generate: 'input_ids' must be a non-empty list of token ids (or a list of such lists)")
    is_batch = isinstance(input_ids[0], list)
    sequences = input_ids if is_batch else [input_ids]
    n = len(sequences)
    for i, sequence in enumerate(sequences):
        where = f"input_ids[{i}]" if is_batch else "input_ids"
        if not isinstance(sequence, list) or not sequence:
            raise ValueError(f"/generate: '{where}' must be a non-empty list of token ids")
        _check_token_ids(sequence, where)

    def per_request(key: str, default) -> list:
        value = payload.get(key)
        if value is None:
            return [default] * n
        if key == "token_ids_logprob":
            # a flat id list applies to every request; a list of lists is one entry per request
            per_item = is_batch and isinstance(value, list) and bool(value) and isinstance(value[0], (list, type(None)))
        else:
            per_item = isinstance(value, list)
        if not per_item:
            return [value] * n
        if len(value) != n:
            raise ValueError(f"/generate: '{key}' has {len(value)} entries for {n} requests")
        return [default if v is None else v for v in value]

    fields = {key: per_request(key, default) for key, default in
              zip(_BATCHABLE, ({}, False, -1, 0, None, None, False))}
    requests = []
    for i in range(n):
        suffix = f"[{i}]" if is_batch else ""
        return_logprob = fields["return_logprob"][i]
        if not isinstance(return_logprob, bool):
            raise ValueError(f"/generate: 'return_logprob{suffix}' must be true or false, got {return_logprob!r}")
        logprob_start_len = _check_int(fields["logprob_start_len"][i], f"logprob_start_len{suffix}", minimum=-1)
        top_logprobs_num = _check_int(fields["top_logprobs_num"][i], f"top_logprobs_num{suffix}", minimum=0)
        token_ids = fields["token_ids_logprob"][i] or []
        if not isinstance(token_ids, list):
            raise ValueError(f"/generate: 'token_ids_logprob{suffix}' must be a list of token ids, got {token_ids!r}")
        _check_token_ids(token_ids, f"token_ids_logprob{suffix}")
        sampling = parse_sampling_params(fields["sampling_params"][i], f"sampling_params{suffix}")
        return_routed_experts = fields["return_routed_experts"][i]
        if not isinstance(return_routed_experts, bool):
            raise ValueError(f"/generate: 'return_routed_experts{suffix}' must be true or false, "
                             f"got {return_routed_experts!r}")
        rid = fields["rid"][i]
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise ValueError(f"/generate: 'rid{suffix}' must be a non-empty string, got {rid!r}")
        try:
            requests.append(GenerateRequest(
                input_ids=tuple(sequences[i]), sampling=sampling, return_logprob=return_logprob,
                logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                token_ids_logprob=tuple(token_ids), rid=rid, return_routed_experts=return_routed_experts,
            ))
        except ValueError as err:
            raise ValueError(f"/generate: request {i}: {err}") from err
    return requests, is_batch


def encode_text_prompts(payload: dict, tokenizer: Any) -> list:
    """`text` (a string or a list of strings) -> token ids (a list, or a list of lists)."""
    text = payload["text"]
    if payload.get("input_ids") is not None:
        raise ValueError("/generate: give either 'text' or 'input_ids', not both")
    if tokenizer is None:
        raise ValueError("/generate: 'text' needs a server with a tokenizer (saved in its --hf-checkpoint folder); "
                         "send 'input_ids' instead")
    is_batch = isinstance(text, list)
    texts = text if is_batch else [text]
    if not texts:
        raise ValueError("/generate: 'text' must be a non-empty string or a non-empty list of strings")
    for i, item in enumerate(texts):
        where = f"text[{i}]" if is_batch else "text"
        if not isinstance(item, str) or not item:
            raise ValueError(f"/generate: '{where}' must be a non-empty string, got {item!r}")
        try:
            item.encode("utf-8")
        except UnicodeEncodeError as err:  # a lone surrogate ("\ud800"): JSON allows it, UTF-8 does not
            raise ValueError(f"/generate: '{where}' holds a lone surrogate {item[err.start]!r} at character "
                             f"{err.start}, which is not text; send valid Unicode") from None
    encoded = [list(tokenizer.encode(item)) for item in texts]
    return encoded if is_batch else encoded[0]


_SAMPLING_INTS = {"max_new_tokens": 0, "top_k": -1}
_SAMPLING_FLOATS = ("temperature", "top_p")


def parse_sampling_params(params: Any, where: str = "sampling_params") -> SamplingParams:
    """SGLang's `sampling_params` object, every value type-checked (ValueError naming `where.key`)."""
    if not isinstance(params, dict):
        raise ValueError(f"/generate: '{where}' must be a JSON object, got {type(params).__name__}")
    for key, minimum in _SAMPLING_INTS.items():
        if params.get(key) is not None:
            _check_int(params[key], f"{where}.{key}", minimum=minimum)
    for key in _SAMPLING_FLOATS:
        value = params.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
            raise ValueError(f"/generate: '{where}.{key}' must be a finite number, got {value!r}")
    if params.get("ignore_eos") is not None and not isinstance(params["ignore_eos"], bool):
        raise ValueError(f"/generate: '{where}.ignore_eos' must be true or false, got {params['ignore_eos']!r}")
    if params.get("sampling_seed") is not None:
        _check_int(params["sampling_seed"], f"{where}.sampling_seed", minimum=0, maximum=SEED_MAX)
    if params.get("stop_token_ids") is not None:
        if not isinstance(params["stop_token_ids"], list):
            raise ValueError(f"/generate: '{where}.stop_token_ids' must be a list of token ids")
        _check_token_ids(params["stop_token_ids"], f"{where}.stop_token_ids")
    try:
        return SamplingParams.from_sglang(params)
    except ValueError as err:
        raise ValueError(f"/generate: {where}: {err}") from err


INT_MAX = 2**63 - 1
"""The largest integer a request field may hold (a C long); a sampling seed may go to SEED_MAX."""
SEED_MAX = 2**64 - 1
"""The largest seed torch's generators take."""


def _check_int(value: Any, where: str, *, minimum: int, maximum: int = INT_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"/generate: '{where}' must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"/generate: '{where}' must be >= {minimum}, got {value}")
    if value > maximum:
        raise ValueError(f"/generate: '{where}' must be <= {maximum}, got {value}")
    return value


def _check_token_ids(ids: list, where: str) -> None:
    for j, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"/generate: '{where}[{j}]' must be a non-negative integer token id, got {token!r}")


def pairs_to_entries(pairs):
    """[(log-prob, token id), ...] of one position -> SGLang's entries (`entries_to_pairs` reversed)."""
    return None if pairs is None else [[lp, tok, None] for lp, tok in pairs]


def render_generate_item(output: GenerateOutput, request: GenerateRequest, rid: str, tokenizer: Any = None) -> dict:
    """`GenerateOutput` -> SGLang's `{"text", "output_ids", "meta_info"}` answer for one request;
    `text` is the completion decoded by `tokenizer` (special tokens skipped), "" without one."""
    if output.finish_reason == "length":
        finish = {"type": "length", "length": len(output.output_ids)}
    elif output.finish_reason == "stop":
        finish = {"type": "stop", "matched": output.output_ids[-1] if output.output_ids else None}
    else:
        finish = {"type": "abort", "message": "aborted"}
    meta = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": len(request.input_ids),
        "completion_tokens": len(output.output_ids),
        "cached_tokens": 0,
        "weight_version": str(output.weight_version),
    }
    if request.return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(output.output_log_probs, output.output_ids)]
        if request.logprob_start_len >= 0:
            prompt_ids = request.input_ids[request.logprob_start_len:]
            meta["input_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(output.input_log_probs, prompt_ids)]
        if request.top_logprobs_num > 0:
            meta["output_top_logprobs"] = [pairs_to_entries(p) for p in output.output_top_log_probs]
            if request.logprob_start_len >= 0:
                meta["input_top_logprobs"] = [pairs_to_entries(p) for p in output.input_top_log_probs]
        if request.token_ids_logprob:
            meta["output_token_ids_logprobs"] = [pairs_to_entries(p) for p in output.output_token_ids_log_probs]
            if request.logprob_start_len >= 0:
                meta["input_token_ids_logprobs"] = [pairs_to_entries(p) for p in output.input_token_ids_log_probs]
    if output.routed_experts is not None:  # SGLang's encoding: base64 of the flat int32 array
        routes = output.routed_experts.to(torch.int32).contiguous()
        meta["routed_experts"] = base64.b64encode(routes.numpy().tobytes()).decode("ascii")
    text = "" if tokenizer is None else tokenizer.decode(list(output.output_ids), skip_special_tokens=True)
    return {"text": text, "output_ids": list(output.output_ids), "meta_info": meta}
