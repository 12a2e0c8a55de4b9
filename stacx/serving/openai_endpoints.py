"""`stacx serve`'s OpenAI-compatible endpoint: chat completions with tools, completions, sessions.

    secret = requests.post(f"{server.url}/stacx/sessions/{session_id}").json()["secret"]   # the trainer
    client = openai.OpenAI(base_url=f"{server.url}/sessions/{session_id}/{secret}/v1", api_key="unused")
    client.chat.completions.create(model="policy", messages=[...], tools=[...])            # the agent
    turns = requests.delete(f"{server.url}/stacx/sessions/{session_id}",
                            headers={"Authorization": f"Bearer {secret}"}).json()["turns"]  # the trainer

Endpoints (a session prefix records the turns under that session; without one nothing is
recorded):
  POST [<session>]/v1/chat/completions   messages, tools -> chat.completion (tool calls parsed
                                         from the model's text, stacx.wire.tool_calls)
  POST [<session>]/v1/completions        prompt -> text_completion
  GET  [<session>]/v1/models             the served model
  POST /stacx/sessions/<id>              (stacx) open a session for one episode -> {"session_id", "secret",
                                         "base_path"}; it needs its secret from then on and is never evicted
                                         (needs the server's API key, when it has one)
  GET  /stacx/sessions/<id>              (stacx) {"session_id", "turns": [RecordedTurn.to_json()]}
  DELETE /stacx/sessions/<id>            (stacx) the same, and the server forgets the session
  GET  /stacx/sessions                   (stacx) {"open_sessions", "other_sessions", "evicted_sessions"}

<session> is `/sessions/<id>/<secret>` for an opened session (or `/sessions/<id>` with the secret as
the API key: `Authorization: Bearer <secret>`; the /stacx calls send it so), or `/sessions/<id>`
for one nobody opened (anyone may use it; evicted, least recently used first, when the book is
full). A request to an opened session without its secret gets 401, with a wrong one 403; a secret
for a session that is not open (never opened, or popped when its episode ended) 404.

Requests may ask for `n` samples (one engine batch; each sample is recorded as its own turn, the
n turns siblings extending the same leaf of the session's tree, so a next request may continue any
one of them), `stop` strings (openai_stop.py), `stream: true` (openai_streaming.py), the engine's
top-k log-probs, and `tool_choice` "required" or a named function (openai_tool_choice.py); errors on
these paths (the sessions' 401/403/404 included) are in OpenAI's schema (openai_errors.py).
Generation goes through the same admission, pause gate, abort book and batcher as `/generate`
(EngineHttpServer.run_engine). The request and answer formats are in openai_protocol.py; how a
session's prompts reuse the ids the engine generated is in openai_sessions.py.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional, Sequence

import anyio

from stacx.serving.endpoint_host import EndpointHost
from stacx.serving.http_guard import HttpError, check_bearer_token
from stacx.serving.openai_protocol import (
    Choice,
    parse_chat_request,
    parse_completion_request,
    render_chat_response,
    render_completion_response,
)
from stacx.serving.openai_sessions import (
    SessionBook,
    SessionTurn,
    chat_prompt_ids,
    check_session_id,
    completion_prompt_ids,
    encode,
)
from stacx.serving.openai_streaming import chat_chunks, completion_chunks, event_stream, token_pieces
from stacx.serving.openai_tool_choice import forced_call_opening
from stacx.serving.request_bodies import check_text_budget
from stacx.serving.stop_sequences import cut_at_stop_sequences
from stacx.wire.chat_encoding import decode_reply
from stacx.wire.tool_calls import ParsedToolCalls, parse_tool_calls, tool_call_style_for
from stacx.wire.trajectories import RecordedTurn
from stacx.wire.types import GenerateRequest, SamplingParams

if TYPE_CHECKING:  # annotations only
    from fastapi import Request

async def off_the_loop(function, *args):
    """`function(*args)` in a worker thread: rendering a chat template and tokenizing take long for long
    conversations, and the event loop must keep answering `/health` and every other request meanwhile."""
    return await anyio.to_thread.run_sync(lambda: function(*args))


__all__ = ["DEFAULT_MAX_TOKENS", "OpenAIEndpoints"]

DEFAULT_MAX_TOKENS = 1024
"""Tokens generated when a request gives no max_tokens (less when the model's context is shorter)."""
SESSION_PREFIXES = ("/sessions/{session_id}", "/sessions/{session_id}/{secret}")
"""Where a session's turns are recorded: an opened session's secret is in the path or the API key."""


class OpenAIEndpoints:
    """The handlers; each returns (status, JSON body) for `server`'s `answering` wrapper."""

    def __init__(self, server: EndpointHost, read_json):
        self.server = server
        self.read_json = read_json
        self.sessions = SessionBook()
        self.model_name = os.path.basename(os.path.normpath(server.model_path)) if server.model_path else "stacx"

    def routes(self, json_body: dict) -> list[tuple]:
        """(methods, path, handler, summary, openapi extra) for build_app."""
        routes = []
        for prefix in ("", *SESSION_PREFIXES):
            recorded = " (recorded under the session)" if prefix else ""
            routes += [
                (("POST",), f"{prefix}/v1/chat/completions", self.chat_completions,
                 f"OpenAI chat completions: messages, tools -> chat.completion{recorded}", json_body),
                (("POST",), f"{prefix}/v1/completions", self.completions,
                 f"OpenAI completions: prompt -> text_completion{recorded}", json_body),
                (("GET",), f"{prefix}/v1/models", self.models, "the served model", None),
            ]
        routes += [
            (("POST",), "/stacx/sessions/{session_id}", self.open_session,
             "(stacx) open a session for one episode: -> {session_id, secret, base_path}", None),
            (("GET",), "/stacx/sessions", self.session_stats, "(stacx) open, other and evicted sessions", None),
            (("GET",), "/stacx/sessions/{session_id}", self.session_turns, "(stacx) a session's recorded turns", None),
            (("DELETE",), "/stacx/sessions/{session_id}", self.pop_session,
             "(stacx) a session's recorded turns; the server forgets them", None),
        ]
        return routes

    # ---- handlers -----------------------------------------------------------------------------

    async def models(self, request: "Request"):
        return 200, {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                 "owned_by": "stacx"}]}

    async def open_session(self, request: "Request"):
        session_id = check_session_id(request.path_params["session_id"])
        if self.server.api_key is not None:  # an open session is kept until popped: only the trainer opens them
            refusal = check_bearer_token(self.server.api_key, request.headers.get("authorization"))
            if refusal is not None:
                raise HttpError(refusal[0], f"POST /stacx/sessions/{session_id}: {refusal[1]}",
                                headers={"WWW-Authenticate": "Bearer"})
        secret = self.sessions.open(session_id)
        return 200, {"session_id": session_id, "secret": secret, "base_path": f"/sessions/{session_id}/{secret}/v1"}

    async def session_stats(self, request: "Request"):
        return 200, self.sessions.stats()

    async def session_turns(self, request: "Request"):
        session_id, secret = self.session_of(request)
        turns = self.sessions.turns(session_id, secret=secret)
        return 200, {"session_id": session_id, "turns": [t.to_json() for t in turns]}

    async def pop_session(self, request: "Request"):
        session_id, secret = self.session_of(request)
        turns = self.sessions.turns(session_id, secret=secret, remove=True)
        return 200, {"session_id": session_id, "turns": [t.to_json() for t in turns]}

    async def chat_completions(self, request: "Request"):
        tokenizer = self._tokenizer("/v1/chat/completions")
        session_id, secret = self.session_of(request)
        chat = parse_chat_request(await self.read_body(request, "/v1/chat/completions"))
        leaves = self.sessions.leaves(session_id, secret) if session_id else []
        prompt_ids, continued = await off_the_loop(chat_prompt_ids, tokenizer, chat.messages, chat.tools, leaves)
        forced = chat.tool_choice.mode in ("required", "function")
        opening = forced_call_opening(tokenizer, chat.tools, chat.tool_choice.name) if forced else ""
        prompt_ids += encode(tokenizer, opening) if opening else []
        choices = []
        for output in await self._generate(request, prompt_ids, chat.sampling, chat.top_logprobs):
            choice = self._cut(output, chat.sampling.stop, self._decode_reply)
            text = opening + choice.text
            parsed = parse_tool_calls(text, self._tool_call_style()) if chat.tools and chat.use_tools \
                else ParsedToolCalls(content=text, calls=(), errors=())
            if forced and not parsed.calls:  # validated, never made up: the text comes back as it is
                parsed = ParsedToolCalls(content=text, calls=(), errors=parsed.errors or ("no tool call",))
            choices.append(Choice(output=choice.output, text=text, parsed=parsed, stop=choice.stop))
        answer = render_chat_response(choices, num_prompt_tokens=len(prompt_ids), model=self.model_name,
                                      token_text=self._token_text if chat.logprobs else None,
                                      top_logprobs=chat.top_logprobs)
        for rendered, choice in zip(answer["choices"], choices):
            if choice.parsed.errors and chat.tools and chat.use_tools:
                rendered["stacx"]["tool_call_errors"] = list(choice.parsed.errors)
        self.record_turns(session_id, secret, prompt_ids, [
            (c.output, {"messages": chat.messages, "reply": r["message"]}) for c, r in zip(choices, answer["choices"])],
            continued=continued)
        if chat.stream:
            pieces = [None if opening else token_pieces(self._decode_reply, c.output.output_ids) for c in choices]
            return 200, self._event_stream(chat_chunks(answer, pieces, chat.include_usage))
        return 200, answer

    async def completions(self, request: "Request"):
        tokenizer = self._tokenizer("/v1/completions")
        session_id, secret = self.session_of(request)
        completion = parse_completion_request(await self.read_body(request, "/v1/completions"))
        leaves = self.sessions.leaves(session_id, secret) if session_id else []
        prompt_ids, continued = await off_the_loop(completion_prompt_ids, tokenizer, completion.prompt, leaves)
        choices = [self._cut(output, completion.sampling.stop, self._decode)
                   for output in await self._generate(request, prompt_ids, completion.sampling,
                                                      completion.top_logprobs)]
        answer = render_completion_response(choices, num_prompt_tokens=len(prompt_ids), model=self.model_name,
                                            token_text=self._token_text if completion.logprobs else None,
                                            top_logprobs=completion.top_logprobs)
        prompt_text = completion.prompt if isinstance(completion.prompt, str) else None
        self.record_turns(session_id, secret, prompt_ids, [
            (c.output, {"text": None if prompt_text is None else prompt_text + c.text}) for c in choices],
            continued=continued)
        if completion.stream:
            pieces = [token_pieces(self._decode, c.output.output_ids) for c in choices]
            return 200, self._event_stream(completion_chunks(answer, pieces, completion.include_usage))
        return 200, answer

    # ---- helpers ------------------------------------------------------------------------------

    def record_turn(self, session_id: Optional[str], secret: Optional[str], prompt_ids: list[int], output, *,
                    continued: Optional[SessionTurn] = None, **kept) -> None:
        """Record one served turn (the engine's `output` for `prompt_ids`) under the request's session (nothing
        without one, `session_of`). `continued`: the leaf its prompt continues (from `sessions.leaves`), else
        None (a new branch); `kept`: what a next request must repeat to continue it (`SessionTurn`'s
        `messages` and `reply` for a chat, `text` for a completion)."""
        self.record_turns(session_id, secret, prompt_ids, [(output, kept)], continued=continued)

    def record_turns(self, session_id: Optional[str], secret: Optional[str], prompt_ids: list[int],
                     samples: Sequence[tuple[Any, dict]], *, continued: Optional[SessionTurn] = None) -> None:
        """Record one request's `n` samples, `(output, kept)` in choice order, as `record_turn` records one:
        each its own turn extending the same leaf `continued` (siblings in the session's tree, each its
        own trajectory; a next request may continue any one of them)."""
        if session_id:
            self.sessions.record(session_id, [SessionTurn(self._recorded(prompt_ids, output), **kept)
                                              for output, kept in samples], secret=secret, continued=continued)

    async def read_body(self, request: "Request", endpoint: str):
        """The request's JSON body, its text bounded before anything is tokenized (the server's max_text_chars:
        a 10 MB message took 30 s to refuse and stalled every other request meanwhile)."""
        body = await self.read_json(request)
        check_text_budget(body, self.server.max_text_chars, f"{endpoint}: the request")
        return body

    def _tokenizer(self, endpoint: str):
        if self.server.tokenizer is None:
            raise ValueError(f"{endpoint} needs a server with a tokenizer (saved in its --hf-checkpoint folder, "
                             "with a chat template for chat completions)")
        return self.server.tokenizer

    def _tool_call_style(self) -> str:
        try:
            return tool_call_style_for(self.server.tokenizer)
        except ValueError as err:
            raise ValueError(f"/v1/chat/completions: 'tools' were given, but the served tokenizer's chat template "
                             f"does not show how the model writes tool calls ({err})") from None

    def session_of(self, request: "Request") -> tuple[Optional[str], Optional[str]]:
        """(the request's session id or None, the secret it presents or None), refused early (SessionRefused)
        when the session is not the caller's. The secret is the path's, else the bearer token when the
        session is open (any other client's API key is not a secret to check)."""
        session_id = request.path_params.get("session_id")
        if session_id is None:
            return None, None
        check_session_id(session_id)
        secret = request.path_params.get("secret")
        if secret is None and self.sessions.is_open(session_id):
            scheme, _, token = (request.headers.get("authorization") or "").strip().partition(" ")
            secret = token.strip() if scheme.lower() == "bearer" and token.strip() else None
        self.sessions.check(session_id, secret)
        return session_id, secret

    def _max_new_tokens(self, requested: Optional[int], num_prompt: int) -> int:
        context = getattr(self.server.engine, "context_length", None)
        room = None if context is None else context - num_prompt
        if room is not None and room < 1:
            raise ValueError(f"the prompt ({num_prompt} tokens) fills the model's context length {context}; "
                             "shorten the conversation")
        if requested is None:
            return DEFAULT_MAX_TOKENS if room is None else min(DEFAULT_MAX_TOKENS, room)
        return requested  # the engine refuses prompt + max_tokens beyond its context, naming the field

    async def _generate(self, request: "Request", prompt_ids: list[int], sampling, top_logprobs: int = 0) -> list:
        """`sampling.n` outputs for one prompt, generated as one engine batch; sample i is seeded seed + i."""
        tokenizer = self.server.tokenizer
        stop = (tokenizer.eos_token_id,) if getattr(tokenizer, "eos_token_id", None) is not None else ()
        max_new_tokens = self._max_new_tokens(sampling.max_tokens, len(prompt_ids))
        requests = [GenerateRequest(
            input_ids=tuple(prompt_ids), return_logprob=True, top_logprobs_num=top_logprobs,
            sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=sampling.temperature,
                                    top_p=sampling.top_p, seed=None if sampling.seed is None else sampling.seed + i,
                                    stop_token_ids=stop))
            for i in range(sampling.n)]
        return await self.server.run_engine(request, requests)

    def _decode(self, ids: list[int]) -> str:
        """A completion's text (`/v1/completions`: a raw prompt's continuation, special tokens left out)."""
        return self.server.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _decode_reply(self, ids: list[int]) -> str:
        """A chat reply's text: markers kept, one end-of-turn cut (chat_encoding.decode_reply, the decoding
        Stacx's own episodes use: a tokenizer may register `<tool_call>` as a special token)."""
        return decode_reply(self.server.tokenizer, ids)

    def _cut(self, output, stops, decode) -> Choice:
        """The output and its text (`decode`), cut at the stop string that completes first (stop_sequences.py)."""
        cut = cut_at_stop_sequences(output, stops, decode)
        return Choice(output=cut.output, text=cut.text, stop=cut.stop_sequence)

    def _token_text(self, token: int) -> str:
        return self.server.tokenizer.decode([token], skip_special_tokens=False)

    @staticmethod
    def _event_stream(chunks):
        from fastapi.responses import StreamingResponse

        return StreamingResponse(event_stream(chunks), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @staticmethod
    def _recorded(prompt_ids: list[int], output) -> RecordedTurn:
        return RecordedTurn(prompt_ids=tuple(prompt_ids), output_ids=tuple(output.output_ids),
                            output_log_probs=tuple(output.output_log_probs), weight_version=output.weight_version,
                            finish_reason=output.finish_reason)
