"""The progress pieces of a streamed `/generate` (stacx.serving.generate_stream writes them, the client in
stacx.rollout.engines.streamed_generate reads them): one request's tokens `[start, start + n)` with everything the
final answer carries for those tokens, so the pieces received, joined, equal the answer (but its finish reason) and
a request whose engine died continues from them with nothing missing.

    {"index": 0, "start": 2, "output_ids": [5, 9], "weight_version": 3,
     "output_log_probs": [-0.1, -2.3],               with return_logprob
     "output_top_logprobs": [[[lp, id, null], ...], ...],        with top_logprobs_num (and return_logprob)
     "output_token_ids_logprobs": [[[lp, id, null], ...], ...],  with token_ids_logprob (and return_logprob)
     "input_log_probs": [null, -1.2, ...], "input_top_logprobs": [...], "input_token_ids_logprobs": [...],
                                                     the prompt's, once: in the piece with start 0 (logprob_start_len >= 0)
     "routed_experts": "<base64 int32>"}             with return_routed_experts: the route rows of the tokens run
                                                     through the model for these tokens (module note below)

Routed experts: an answer of n tokens to a prompt of p carries the routes of the p + n - 1 tokens the engine ran
(the last sampled one never is). The piece with start 0 and n tokens carries rows [0, p + n - 1), a later piece
rows [p + start - 1, p + start + n - 1): the rows received always number p + (tokens received) - 1.

An engine that decodes in this process builds each output in place while the stream reads it (token id first,
then its log-prob fields; route rows before the token they produced): `ready_tokens` counts the tokens whose every
asked field is there, so a piece never carries half a token.
"""

from __future__ import annotations

import base64
from typing import Any, Optional, Sequence

import torch

from stacx.wire.sglang_protocol import as_optional_float, entries_to_pairs, pairs_to_entries
from stacx.wire.types import GenerateOutput, GenerateRequest

STREAM_CAPABILITY = "stacx_generate_stream"
"""The key, true in a server's `/get_model_info` answer, of a server that streams `/generate` in these pieces
(`stacx serve`): a client of an attached server streams only then (SGLang streams another format)."""


def _prompt_asked(request: GenerateRequest) -> bool:
    return request.return_logprob and request.logprob_start_len >= 0


def _route_rows_held(route_pieces: Sequence[torch.Tensor]) -> int:
    return sum(int(piece.shape[0]) for piece in route_pieces)


def ready_tokens(output: GenerateOutput, request: GenerateRequest, route_pieces: Sequence[torch.Tensor] = ()) -> int:
    """How many of `output`'s tokens have every field `request` asks (the output may be growing meanwhile)."""
    lengths = [len(output.output_ids), len(output.output_token_versions)]
    if request.return_logprob:
        lengths.append(len(output.output_log_probs))
        if request.top_logprobs_num:
            lengths.append(len(output.output_top_log_probs))
        if request.token_ids_logprob:
            lengths.append(len(output.output_token_ids_log_probs))
    if request.return_routed_experts:
        lengths.append(_route_rows_held(route_pieces) - len(request.input_ids) + 1)
    return max(0, min(lengths))


def _route_rows(route_pieces: Sequence[torch.Tensor], first: int, end: int) -> torch.Tensor:
    """Rows [first, end) of the route pieces laid end to end."""
    return torch.cat(list(route_pieces))[first:end]


def encode_routes(routes: torch.Tensor) -> str:
    """Route rows as SGLang sends them: base64 of the flat int32 array."""
    return base64.b64encode(routes.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


def render_piece(index: int, output: GenerateOutput, request: GenerateRequest, start: int, end: int,
                 route_pieces: Sequence[torch.Tensor] = ()) -> dict:
    """The piece of request `index`'s tokens [start, end) (each ready: `ready_tokens`)."""
    piece: dict[str, Any] = {"index": index, "start": start, "output_ids": list(output.output_ids[start:end]),
                             "weight_version": output.weight_version, "output_log_probs": []}
    if request.return_logprob:
        piece["output_log_probs"] = list(output.output_log_probs[start:end])
        if request.top_logprobs_num:
            piece["output_top_logprobs"] = [pairs_to_entries(p) for p in output.output_top_log_probs[start:end]]
        if request.token_ids_logprob:
            piece["output_token_ids_logprobs"] = [pairs_to_entries(p)
                                                  for p in output.output_token_ids_log_probs[start:end]]
        if start == 0 and _prompt_asked(request):
            piece["input_log_probs"] = list(output.input_log_probs)
            if request.top_logprobs_num:
                piece["input_top_logprobs"] = [pairs_to_entries(p) for p in output.input_top_log_probs]
            if request.token_ids_logprob:
                piece["input_token_ids_logprobs"] = [pairs_to_entries(p) for p in output.input_token_ids_log_probs]
    if request.return_routed_experts:
        prompt = len(request.input_ids)
        piece["routed_experts"] = encode_routes(
            _route_rows(route_pieces, 0 if start == 0 else prompt + start - 1, prompt + end - 1))
    return piece


def extend_output(output: GenerateOutput, request: GenerateRequest, piece: dict) -> None:
    """Append a piece's tokens and their fields to `output` (the tokens received so far of `request`)."""
    if int(piece["start"]) != len(output.output_ids):
        raise ValueError(f"/generate stream: tokens from {piece['start']} after {len(output.output_ids)} received")
    ids, version = [int(t) for t in piece["output_ids"]], int(piece["weight_version"])
    output.output_ids.extend(ids)
    output.output_token_versions.extend([version] * len(ids))
    output.weight_version = version if len(output.output_ids) == len(ids) else min(output.weight_version, version)
    if request.return_logprob:
        output.output_log_probs.extend(float(lp) for lp in piece["output_log_probs"])
        if request.top_logprobs_num:
            output.output_top_log_probs.extend(entries_to_pairs(p) for p in piece["output_top_logprobs"])
        if request.token_ids_logprob:
            output.output_token_ids_log_probs.extend(entries_to_pairs(p) for p in piece["output_token_ids_logprobs"])
        if "input_log_probs" in piece:
            output.input_log_probs = [as_optional_float(lp) for lp in piece["input_log_probs"]]
            if request.top_logprobs_num:
                output.input_top_log_probs = [entries_to_pairs(p) for p in piece["input_top_logprobs"]]
            if request.token_ids_logprob:
                output.input_token_ids_log_probs = [entries_to_pairs(p) for p in piece["input_token_ids_logprobs"]]
    if request.return_routed_experts:
        rows = len(ids) + (len(request.input_ids) - 1 if int(piece["start"]) == 0 else 0)
        output.routed_experts = _joined_routes(output.routed_experts, piece["routed_experts"], rows)


def _joined_routes(held: Optional[torch.Tensor], encoded: str, rows: int) -> Optional[torch.Tensor]:
    """The route rows held followed by a piece's `rows` ([rows, layers * top_k] int32, as the final answer's)."""
    raw = bytearray(base64.b64decode(encoded))
    if not rows:
        return held
    flat = torch.frombuffer(raw, dtype=torch.int32) if raw else torch.zeros(0, dtype=torch.int32)
    if flat.numel() % rows:
        raise ValueError(f"/generate stream: {flat.numel()} routed expert ids are not a whole number per each of "
                         f"the piece's {rows} tokens")
    new = flat.clone().view(rows, -1)
    return new if held is None else torch.cat([held, new])
