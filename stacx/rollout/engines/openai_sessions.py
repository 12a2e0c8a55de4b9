"""Sessions of the OpenAI-compatible endpoint: what each turn recorded, and token-in/token-out prompts.

An agent reaches a session through its base URL, `http://HOST:PORT/sessions/<session_id>/v1`, so
an unmodified OpenAI client records its turns by being given that URL. Each turn records the
prompt ids the engine got, the ids it generated, their log-probs and the weight version
(`RecordedTurn`); the trainer reads them back (`GET /stacx/sessions/<id>`) and assembles
trajectories (stacx.rollout.agent_trajectories).

Token-in/token-out: when a chat request continues the session's last turn (its messages are that
turn's messages, then the assistant reply the server gave, then new messages), its prompt is

    last turn's prompt ids + the ids the engine generated + ids(close + new)

where `new` is what the chat template renders after the reply (tool results, the next user
message, the generation prompt) and `close` is the template's end of an assistant message that the
engine did not generate itself (e.g. `<|im_end|>\\n` after a reply cut by max_tokens, or just
`\\n` after one that ended on `<|im_end|>`): `stacx.rollout.chat_continuation`, the rule Stacx's own
episodes use. The generated ids are never re-tokenized, so the ids trained on are the ids sampled.
Message content is encoded with control spellings held back (`stacx.rollout.chat_encoding`): a tool
result or a user message holding `<|im_end|>` is text, never a forged turn. A request that does not
continue the last turn (the agent edited or truncated its history, or the template renders history
differently) gets the template's ids of the whole conversation and starts a new trajectory.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from stacx.rollout.agent_trajectories import RecordedTurn
from stacx.rollout.chat_continuation import ids_after_assistant_turn
from stacx.rollout.chat_encoding import chat_ids
from stacx.rollout.engines.openai_protocol import template_messages

__all__ = ["SessionBook", "SessionTurn", "chat_prompt_ids", "check_session_id", "completion_prompt_ids"]

SESSION_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


def check_session_id(session_id: str) -> str:
    if not SESSION_ID.fullmatch(session_id or ""):
        raise ValueError(f"session id {session_id!r} must be 1-128 characters of letters, digits, '.', '_' or '-' "
                         "(the base URL is /sessions/<session_id>/v1)")
    return session_id


@dataclass(frozen=True)
class SessionTurn:
    """One recorded turn and what a next request must repeat to continue it."""

    turn: RecordedTurn
    messages: Optional[list[dict]] = None
    """The chat request's messages (None for a completion)."""
    reply: Optional[dict] = None
    """The assistant message the server answered (chat)."""
    text: Optional[str] = None
    """Prompt text + completion text (a completion): a next prompt extending it continues the turn."""


class SessionBook:
    """The recorded turns of every session, oldest sessions dropped beyond `max_sessions` (thread-safe).
    Only the last turn of a session keeps its messages (a request can only continue that one)."""

    def __init__(self, *, max_sessions: int = 4096, max_turns_per_session: int = 4096):
        self.max_sessions = max_sessions
        self.max_turns_per_session = max_turns_per_session
        self._sessions: "OrderedDict[str, list[SessionTurn]]" = OrderedDict()
        self._lock = threading.Lock()

    def last(self, session_id: str) -> Optional[SessionTurn]:
        with self._lock:
            turns = self._sessions.get(session_id)
            return turns[-1] if turns else None

    def record(self, session_id: str, turn: SessionTurn) -> None:
        with self._lock:
            turns = self._sessions.setdefault(session_id, [])
            self._sessions.move_to_end(session_id)
            if len(turns) >= self.max_turns_per_session:
                raise ValueError(f"session {session_id}: more than {self.max_turns_per_session} turns; "
                                 "start a new session (a new base URL) per episode")
            if turns:  # only the last turn is ever continued: drop what the older ones kept for that
                turns[-1] = SessionTurn(turns[-1].turn)
            turns.append(turn)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)

    def turns(self, session_id: str, *, remove: bool = False) -> list[RecordedTurn]:
        """The session's turns in order ([] for an unknown session); `remove` forgets them."""
        with self._lock:
            turns = self._sessions.pop(session_id, []) if remove else list(self._sessions.get(session_id, []))
        return [t.turn for t in turns]


def _essence(message: dict) -> tuple:
    """What a message means to the template: role, content, tool calls (name and arguments), tool id."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"].get("arguments") or {}, sort_keys=True))
                  for c in message.get("tool_calls") or ())
    return message["role"], message.get("content") or "", calls, message.get("tool_call_id")


def encode(tokenizer: Any, text: str) -> list[int]:
    """Completion text -> ids (a raw prompt: control spellings in it are the tokens)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_prompt_ids(tokenizer: Any, messages: list[dict], tools: Optional[list[dict]],
                    previous: Optional[SessionTurn]) -> tuple[list[int], bool]:
    """(the prompt ids of a chat request, whether they continue `previous`), as in the module doc."""
    rendered = template_messages(messages)
    if previous is not None and previous.messages is not None:
        ids = _continuation_ids(tokenizer, rendered, tools, previous)
        if ids is not None:
            return ids, True
    return chat_ids(tokenizer, rendered, tools=tools), False


def _continuation_ids(tokenizer: Any, rendered: list[dict], tools: Optional[list[dict]],
                      previous: SessionTurn) -> Optional[list[int]]:
    before = template_messages(previous.messages)
    num_before = len(before)
    if len(rendered) <= num_before + 1 or rendered[num_before]["role"] != "assistant":
        return None
    if [_essence(m) for m in rendered[:num_before]] != [_essence(m) for m in before]:
        return None
    if _essence(rendered[num_before]) != _essence(template_messages([previous.reply])[0]):
        return None
    after = ids_after_assistant_turn(tokenizer, rendered[:num_before], rendered[num_before + 1:], tools=tools,
                                     generated_ids=previous.turn.output_ids)
    if after is None:
        return None
    return list(previous.turn.prompt_ids + previous.turn.output_ids) + after


def completion_prompt_ids(tokenizer: Any, prompt: str | list[int], previous: Optional[SessionTurn]) -> list[int]:
    """A completion prompt's ids: token ids as given; text extending `previous`'s prompt and completion
    continues its ids (token-in/token-out), other text is encoded as `/generate` encodes text."""
    if isinstance(prompt, list):
        return list(prompt)
    if previous is not None and previous.text is not None and prompt.startswith(previous.text) \
            and len(prompt) > len(previous.text):
        return list(previous.turn.prompt_ids + previous.turn.output_ids) + encode(tokenizer, prompt[len(previous.text):])
    return list(tokenizer.encode(prompt))
