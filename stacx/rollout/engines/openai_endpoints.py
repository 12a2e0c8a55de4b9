"""`stacx serve`'s OpenAI-compatible endpoint: chat completions with tools, completions, sessions.

    client = openai.OpenAI(base_url=f"{server.url}/sessions/{session_id}/v1", api_key="unused")
    client.chat.completions.create(model="policy", messages=[...], tools=[...])
    turns = [RecordedTurn.from_json(t) for t in requests.get(f"{server.url}/stacx/sessions/{session_id}").json()["turns"]]

Endpoints (the `/sessions/<id>` prefix records the turns under that session; without it nothing is
recorded):
  POST [/sessions/<id>]/v1/chat/completions   messages, tools -> chat.completion (tool calls parsed
                                              from the model's text, stacx.rollout.tool_calls)
  POST [/sessions/<id>]/v1/completions        prompt -> text_completion
  GET  [/sessions/<id>]/v1/models             the served model
  GET  /stacx/sessions/<id>                   (stacx) {"session_id", "turns": [RecordedTurn.to_json()]}
  DELETE /stacx/sessions/<id>                 (stacx) the same, and the server forgets the session

Generation goes through the same admission, pause gate, abort book and batcher as `/generate`
(EngineHttpServer.run_engine). The request and answer formats are in openai_protocol.py; how a
session's prompts reuse the ids the engine generated is in openai_sessions.py.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

from stacx.rollout.agent_trajectories import RecordedTurn
from stacx.rollout.chat_encoding import decode_reply
from stacx.rollout.engines.openai_protocol import (
    parse_chat_request,
    parse_completion_request,
    render_chat_response,
    render_completion_response,
)
from stacx.rollout.engines.openai_sessions import (
    SessionBook,
    SessionTurn,
    chat_prompt_ids,
    check_session_id,
    completion_prompt_ids,
)
from stacx.rollout.tool_calls import ParsedToolCalls, parse_tool_calls, tool_call_style_for
from stacx.rollout.types import GenerateRequest, SamplingParams

if TYPE_CHECKING:  # annotations only
    from fastapi import Request

    from stacx.rollout.engines.server import EngineHttpServer

__all__ = ["DEFAULT_MAX_TOKENS", "OpenAIEndpoints"]

DEFAULT_MAX_TOKENS = 1024
"""Tokens generated when a request gives no max_tokens (less when the model's context is shorter)."""
SESSION_PREFIX = "/sessions/{session_id}"


class OpenAIEndpoints:
    """The handlers; each returns (status, JSON body) for `server`'s `answering` wrapper."""

    def __init__(self, server: "EngineHttpServer", read_json):
        self.server = server
        self.read_json = read_json
        self.sessions = SessionBook()
        self.model_name = os.path.basename(os.path.normpath(server.model_path)) if server.model_path else "stacx"

    def routes(self, json_body: dict) -> list[tuple]:
        """(methods, path, handler, summary, openapi extra) for build_app."""
        routes = []
        for prefix in ("", SESSION_PREFIX):
            recorded = " (recorded under the session)" if prefix else ""
            routes += [
                (("POST",), f"{prefix}/v1/chat/completions", self.chat_completions,
                 f"OpenAI chat completions: messages, tools -> chat.completion{recorded}", json_body),
                (("POST",), f"{prefix}/v1/completions", self.completions,
                 f"OpenAI completions: prompt -> text_completion{recorded}", json_body),
                (("GET",), f"{prefix}/v1/models", self.models, "the served model", None),
            ]
        routes += [
            (("GET",), "/stacx/sessions/{session_id}", self.session_turns, "(stacx) a session's recorded turns", None),
            (("DELETE",), "/stacx/sessions/{session_id}", self.pop_session,
             "(stacx) a session's recorded turns; the server forgets them", None),
        ]
        return routes

    # ---- handlers -----------------------------------------------------------------------------

    async def models(self, request: "Request"):
        return 200, {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                 "owned_by": "stacx"}]}

    async def session_turns(self, request: "Request"):
        session_id = check_session_id(request.path_params["session_id"])
        return 200, {"session_id": session_id, "turns": [t.to_json() for t in self.sessions.turns(session_id)]}

    async def pop_session(self, request: "Request"):
        session_id = check_session_id(request.path_params["session_id"])
        turns = self.sessions.turns(session_id, remove=True)
        return 200, {"session_id": session_id, "turns": [t.to_json() for t in turns]}

    async def chat_completions(self, request: "Request"):
        tokenizer = self._tokenizer("/v1/chat/completions")
        session_id = self._session_of(request)
        chat = parse_chat_request(await self.read_json(request))
        previous = self.sessions.last(session_id) if session_id else None
        prompt_ids, _ = chat_prompt_ids(tokenizer, chat.messages, chat.tools, previous)
        output = await self._generate(request, prompt_ids, chat.sampling)
        text = decode_reply(tokenizer, output.output_ids)  # markers kept: <tool_call> may be a special token
        parsed = parse_tool_calls(text, self._tool_call_style()) if chat.tools and chat.use_tools \
            else ParsedToolCalls(content=text, calls=(), errors=())
        answer = render_chat_response(output, parsed, num_prompt_tokens=len(prompt_ids), model=self.model_name,
                                      token_texts=self._token_texts(output) if chat.logprobs else None)
        if session_id:
            self.sessions.record(session_id, SessionTurn(self._recorded(prompt_ids, output), messages=chat.messages,
                                                         reply=answer["choices"][0]["message"]))
        return 200, answer

    async def completions(self, request: "Request"):
        tokenizer = self._tokenizer("/v1/completions")
        session_id = self._session_of(request)
        completion = parse_completion_request(await self.read_json(request))
        previous = self.sessions.last(session_id) if session_id else None
        prompt_ids = completion_prompt_ids(tokenizer, completion.prompt, previous)
        output = await self._generate(request, prompt_ids, completion.sampling)
        text = tokenizer.decode(list(output.output_ids), skip_special_tokens=True)
        answer = render_completion_response(output, text, num_prompt_tokens=len(prompt_ids), model=self.model_name,
                                            token_texts=self._token_texts(output) if completion.logprobs else None)
        if session_id:
            prompt_text = completion.prompt if isinstance(completion.prompt, str) else None
            self.sessions.record(session_id, SessionTurn(self._recorded(prompt_ids, output),
                                                         text=None if prompt_text is None else prompt_text + text))
        return 200, answer

    # ---- helpers ------------------------------------------------------------------------------

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

    @staticmethod
    def _session_of(request: "Request") -> Optional[str]:
        session_id = request.path_params.get("session_id")
        return None if session_id is None else check_session_id(session_id)

    def _max_new_tokens(self, requested: Optional[int], num_prompt: int) -> int:
        context = getattr(self.server.engine, "context_length", None)
        room = None if context is None else context - num_prompt
        if room is not None and room < 1:
            raise ValueError(f"the prompt ({num_prompt} tokens) fills the model's context length {context}; "
                             "shorten the conversation")
        if requested is None:
            return DEFAULT_MAX_TOKENS if room is None else min(DEFAULT_MAX_TOKENS, room)
        return requested  # the engine refuses prompt + max_tokens beyond its context, naming the field

    async def _generate(self, request: "Request", prompt_ids: list[int], sampling):
        tokenizer = self.server.tokenizer
        stop = (tokenizer.eos_token_id,) if getattr(tokenizer, "eos_token_id", None) is not None else ()
        generate_request = GenerateRequest(
            input_ids=tuple(prompt_ids), return_logprob=True,
            sampling=SamplingParams(max_new_tokens=self._max_new_tokens(sampling.max_tokens, len(prompt_ids)),
                                    temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
                                    stop_token_ids=stop))
        (output,) = await self.server.run_engine(request, [generate_request])
        return output

    def _token_texts(self, output) -> list[str]:
        return [self.server.tokenizer.decode([t], skip_special_tokens=False) for t in output.output_ids]

    @staticmethod
    def _recorded(prompt_ids: list[int], output) -> RecordedTurn:
        return RecordedTurn(prompt_ids=tuple(prompt_ids), output_ids=tuple(output.output_ids),
                            output_log_probs=tuple(output.output_log_probs), weight_version=output.weight_version,
                            finish_reason=output.finish_reason)
