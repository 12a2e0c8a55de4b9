"""SGLang's streamed `/generate` (`"stream": true`): the events of one batched call, gathered per request.

SGLang (0.5 line: its HTTP server's `generate_request` and its tokenizer manager's batch handling) answers a
streamed `/generate` with server-sent events, `data: {...}` each, then `data: [DONE]`. For a batch (Stacx always
sends one: every field a list), each event is the state of ONE request of the batch, named by its `"index"`:

    {"text": ..., "output_ids": [...], "meta_info": {"id", "finish_reason": null | {...}, "weight_version",
     "completion_tokens", "output_token_logprobs": [...], "input_token_logprobs": [...], ...}, "index": i}

- `meta_info`'s log-prob lists (prompt and output, top-k, token-id log-probs) are **cumulative**: every event
  carries all of them so far, so the last event of a request is its unstreamed answer's `meta_info`;
- `output_ids` are cumulative too, unless the server was started with `--stream-output`, when each event holds
  only its new tokens; `completion_tokens` (the request's tokens so far) tells which;
- `finish_reason` is null until the request's last event. An abort whose `status_code` is 400 is the request's
  fault (unstreamed, SGLang answers 400); one whose `status_code` is 500 or 503 is the engine's (unstreamed, a
  5xx); an abort without a status code is an ordinary abort (`/abort_request`: partial rollouts);
- a request refused while streaming (SGLang raised `ValueError`; unstreamed, a 400) is one event
  `{"error": {"message": ...}}` before `[DONE]`.

    stream = SglangStream(requests)
    for event in transport.post_events("/generate", payload): stream.add(event)
    stream.outputs()   # once every request finished; stream.partial(): the tokens received so far
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from stacx.wire.sglang_protocol import parse_generate_item
from stacx.wire.types import GenerateOutput, GenerateRequest

ENGINE_FAULT_STATUSES = (500, 503)
"""An abort's `status_code` that says the engine failed (SGLang's scheduler aborted the request), not the caller."""


def stream_error(event: Any) -> Optional[tuple[int, str]]:
    """(status, message) of an event that ends the call with an error, else None: SGLang's `{"error": ...}` event
    (400: SGLang refuses a request by raising ValueError, a 400 unstreamed), or a request aborted with a status
    code (`meta_info.finish_reason.status_code`)."""
    if not isinstance(event, dict):
        return 500, f"an event that is not a JSON object: {str(event)[:200]}"
    error = event.get("error")
    if error is not None:
        message = error.get("message", error) if isinstance(error, dict) else error
        return int(error.get("code") or 400) if isinstance(error, dict) else 400, str(message)
    finish = (event.get("meta_info") or {}).get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort" and finish.get("status_code") is not None:
        return int(finish["status_code"]), str(finish.get("message", "aborted"))
    return None


class SglangStream:
    """The events of one streamed batched `/generate`, gathered per request (module doc)."""

    def __init__(self, requests: Sequence[GenerateRequest]):
        self.requests = list(requests)
        self.output_ids: list[list[int]] = [[] for _ in self.requests]
        self.latest: list[Optional[dict]] = [None] * len(self.requests)
        """Each request's last event (its `meta_info` holds every log-prob so far)."""
        self.finished = [False] * len(self.requests)

    def add(self, event: dict) -> None:
        """One event (not an error: `stream_error` first)."""
        index = int(event.get("index", 0))
        if not 0 <= index < len(self.requests):
            raise ValueError(f"/generate streamed an event for request {index} of a batch of {len(self.requests)}")
        meta = event.get("meta_info") or {}
        ids = [int(t) for t in event.get("output_ids") or ()]
        so_far = meta.get("completion_tokens")
        if so_far is None or len(ids) == int(so_far):  # cumulative (SGLang's default)
            self.output_ids[index] = ids
        else:  # --stream-output: the new tokens only
            self.output_ids[index].extend(ids)
        self.latest[index] = event
        self.finished[index] = meta.get("finish_reason") is not None

    def done(self) -> bool:
        return all(self.finished)

    def outputs(self) -> list[GenerateOutput]:
        """Every request's answer, as the unstreamed `/generate` gives it (each must have finished)."""
        return [self._output(i) for i in range(len(self.requests))]

    def partial(self) -> list[GenerateOutput]:
        """The tokens received so far: a finished request's answer whole, the others with finish reason 'abort'
        and every log-prob field of their tokens (a request with no event yet: no token)."""
        return [self._output(i) if self.latest[i] is not None else GenerateOutput(output_ids=[], finish_reason="abort")
                for i in range(len(self.requests))]

    def _output(self, index: int) -> GenerateOutput:
        event = self.latest[index]
        meta = dict(event.get("meta_info") or {})
        if not self.finished[index]:
            meta["finish_reason"] = {"type": "abort", "message": "the stream broke off"}
        elif isinstance(meta["finish_reason"], dict) and meta["finish_reason"].get("type") == "abort":
            meta["finish_reason"] = {"type": "abort"}
        return parse_generate_item({"output_ids": self.output_ids[index], "meta_info": meta}, self.requests[index])
