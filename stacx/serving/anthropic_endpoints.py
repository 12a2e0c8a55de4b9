"""`stacx serve`'s Anthropic Messages adapter: `/v1/messages`, on the OpenAI endpoint's machinery.

    client = anthropic.Anthropic(base_url=f"{server.url}/sessions/{session_id}", api_key="unused")
    client.messages.create(model="policy", max_tokens=256, messages=[...], tools=[...])

Endpoints (the `/sessions/<id>` prefix records the turn under that session, as for the OpenAI routes):
  POST [/sessions/<id>]/v1/messages                messages, system, tools -> message (or its SSE stream)
  POST [/sessions/<id>]/v1/messages/count_tokens   -> {"input_tokens"} (nothing generated or recorded)

A request is translated to the OpenAI chat form (anthropic_protocol.py) and then takes the OpenAI
route's steps, with its objects: the session book and its token-in/token-out prompt
(`chat_prompt_ids`), `_generate` (admission, pause gate, batching), tool-call parsing, and the
recorded turn, whose reply is the OpenAI message the chat route would have answered. A conversation
therefore records the same ids whether its client speaks OpenAI's or Anthropic's API, and a session
may mix the two.

`stream: true` answers Anthropic's event sequence once the reply is generated (tool calls are
parsed from the whole reply), so the recorded ids equal a non-streamed call's. `max_tokens` beyond
the model's context is cut to the room left (CLIs send their own large defaults). Errors are
Anthropic's `{"type": "error", "error": {"type", "message"}}` with the HTTP status the OpenAI routes
give. The key: generation stays open as on the OpenAI routes, whatever `x-api-key` a client sends;
where the server checks its key, `x-api-key: KEY` counts as `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import TYPE_CHECKING, Awaitable, Callable

from starlette.responses import Response

from stacx.serving.anthropic_protocol import (
    MessagesRequest,
    error_body,
    message_events,
    parse_messages_request,
    render_message,
    server_sent_events,
)
from stacx.serving.http_guard import HttpError
from stacx.serving.openai_endpoints import SESSION_PREFIXES, off_the_loop
from stacx.serving.openai_protocol import Choice, render_chat_response
from stacx.serving.openai_sessions import chat_prompt_ids
from stacx.serving.stop_sequences import cut_at_stop_sequences
from stacx.wire.engine import GenerationCancelled
from stacx.wire.tool_calls import ParsedToolCalls, parse_tool_calls

if TYPE_CHECKING:  # annotations only
    from fastapi import Request

    from stacx.serving.openai_endpoints import OpenAIEndpoints

__all__ = ["AnthropicEndpoints"]

logger = logging.getLogger(__name__)

MESSAGES = "/v1/messages"


class AnthropicEndpoints:
    """The handlers over `openai` (the server's OpenAIEndpoints: its session book, tokenizer and
    generation); each returns (status, Response) for the server's `answering` wrapper."""

    def __init__(self, openai: "OpenAIEndpoints"):
        self.openai = openai
        self.server = openai.server

    def routes(self, json_body: dict) -> list[tuple]:
        """(methods, path, handler, summary, openapi extra) for build_app."""
        routes = []
        for prefix in ("", *SESSION_PREFIXES):
            recorded = " (recorded under the session)" if prefix else ""
            routes += [
                (("POST",), f"{prefix}{MESSAGES}", self._anthropic(self._messages),
                 f"Anthropic messages: system, messages, tools -> message, or its event stream{recorded}", json_body),
                (("POST",), f"{prefix}{MESSAGES}/count_tokens", self._anthropic(self._count_tokens),
                 "Anthropic token counting: the prompt's length in tokens", json_body),
            ]
        return routes

    # ---- handlers -----------------------------------------------------------------------------

    async def _messages(self, request: "Request") -> Response:
        openai = self.openai
        tokenizer = openai._tokenizer(MESSAGES)
        session_id, secret = openai.session_of(request)
        asked = parse_messages_request(await openai.read_body(request, MESSAGES))
        leaves = openai.sessions.leaves(session_id, secret) if session_id else []
        prompt_ids, continued = await off_the_loop(chat_prompt_ids, tokenizer, asked.messages, asked.tools, leaves)
        sampling = dataclasses.replace(asked.sampling, max_tokens=self._room(asked.sampling.max_tokens, len(prompt_ids)))
        (output,) = await openai._generate(request, prompt_ids, sampling)
        cut = cut_at_stop_sequences(output, asked.stop_sequences, openai._decode_reply)
        output = cut.output
        parsed = self._parse(cut.text, asked)
        # recorded as the chat route records it: its reply is the OpenAI message
        reply = render_chat_response([Choice(output=output, text=cut.text, parsed=parsed, stop=cut.stop_sequence)],
                                     num_prompt_tokens=len(prompt_ids), model=openai.model_name,
                                     token_text=None)["choices"][0]["message"]
        openai.record_turn(session_id, secret, prompt_ids, output, continued=continued, messages=asked.messages,
                           reply=reply)
        message = render_message(output, parsed, stop_sequence=cut.stop_sequence, num_prompt_tokens=len(prompt_ids),
                                 model=openai.model_name)
        if asked.stream:
            return Response(server_sent_events(message_events(message)), 200, media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache"})
        return _json(200, message)

    async def _count_tokens(self, request: "Request") -> Response:
        openai = self.openai
        tokenizer = openai._tokenizer(f"{MESSAGES}/count_tokens")
        session_id, secret = openai.session_of(request)
        asked = parse_messages_request(await openai.read_body(request, f"{MESSAGES}/count_tokens"),
                                       endpoint=f"{MESSAGES}/count_tokens")
        leaves = openai.sessions.leaves(session_id, secret) if session_id else []
        prompt_ids, _ = await off_the_loop(chat_prompt_ids, tokenizer, asked.messages, asked.tools, leaves)
        return _json(200, {"input_tokens": len(prompt_ids)})

    # ---- helpers ------------------------------------------------------------------------------

    def _parse(self, text: str, asked: MessagesRequest) -> ParsedToolCalls:
        if asked.tools and asked.use_tools:
            return parse_tool_calls(text, self.openai._tool_call_style())
        return ParsedToolCalls(content=text, calls=(), errors=())

    def _room(self, requested: int, num_prompt: int) -> int:
        """`max_tokens`, cut to the context the prompt leaves (ValueError when it leaves none)."""
        context = getattr(self.server.engine, "context_length", None)
        if context is None:
            return requested
        if context - num_prompt < 1:
            raise ValueError(f"{MESSAGES}: the prompt ({num_prompt} tokens) fills the model's context length "
                             f"{context}; shorten the conversation")
        return min(requested, context - num_prompt)

    @staticmethod
    def _anthropic(handler: Callable[["Request"], Awaitable[Response]]):
        """`handler` answering its errors in Anthropic's schema, with the status the OpenAI routes give
        (a client that left is the server's `answering` wrapper's to log)."""

        async def answer(request: "Request") -> tuple[int, Response]:
            headers: dict = {}
            try:
                response = await handler(request)
                return response.status_code, response
            except GenerationCancelled:
                raise
            except HttpError as err:
                status, message, headers = err.status, str(err), dict(err.headers)
                if err.close:
                    headers["Connection"] = "close"
            except ValueError as err:  # the caller's mistake
                status, message = 400, str(err)
            except Exception as err:  # an engine failure: the client may retry
                logger.exception("%s %s failed", request.method, request.url.path)
                status, message = 500, f"{type(err).__name__}: {err}"
            return status, _json(status, error_body(status, message), headers)

        return answer


def _json(status: int, body: dict, headers: dict | None = None) -> Response:
    return Response(json.dumps(body), status, headers=headers, media_type="application/json")
