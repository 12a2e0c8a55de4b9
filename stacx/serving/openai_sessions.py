"""Sessions of the OpenAI-compatible endpoint: what each turn recorded, who may use it, and
token-in/token-out prompts.

An agent reaches a session through its base URL, `http://HOST:PORT/sessions/<session_id>/v1`, so
an unmodified OpenAI client records its turns by being given that URL. A session the trainer opened
for an episode (`SessionBook.open`) also needs its secret: the base URL the agent is given is
`/sessions/<session_id>/<secret>/v1` (or the client sends the secret as its API key). Each turn records the
prompt ids the engine got, the ids it generated, their log-probs and the weight version
(`RecordedTurn`); the trainer reads them back (`GET /stacx/sessions/<id>`) and assembles
trajectories (stacx.rollout.agents.agent_trajectories).

Token-in/token-out: when a chat request continues a turn of the session (its messages are that
turn's messages, then the assistant reply the server gave, then new messages; the newest such turn
among those no request continued yet, the session's leaves), its prompt is

    that turn's prompt ids + the ids the engine generated + ids(close + new)

where `new` is what the chat template renders after the reply (tool results, the next user
message, the generation prompt) and `close` is the template's end of an assistant message that the
engine did not generate itself (e.g. `<|im_end|>\\n` after a reply cut by max_tokens, or just
`\\n` after one that ended on `<|im_end|>`): `stacx.wire.chat_continuation`, the rule Stacx's own
episodes use. The generated ids are never re-tokenized, so the ids trained on are the ids sampled.
Message content is encoded with control spellings held back (`stacx.wire.chat_encoding`): a tool
result or a user message holding `<|im_end|>` is text, never a forged turn. A request that continues no turn (the agent dropped a reply after
a format error, compacted or truncated its history, started a sub-agent, or the template renders
history differently) gets the template's ids of the whole conversation: a branch of the session's
tree, a new trajectory of the same episode (stacx.rollout.agents.agent_trajectories).

Recording a turn from another API (e.g. another chat protocol) takes what the OpenAI handlers
(openai_endpoints.py) do: `session_id, secret = endpoints.session_of(request)` (refuses a foreign
caller), `leaves = endpoints.sessions.leaves(session_id, secret)` (what may be continued), the
prompt ids and the leaf they continue (or None), generation, then `endpoints.record_turn(session_id,
secret, prompt_ids, output, continued=leaf, ...what a next request must repeat)` (a request of `n`
samples: `endpoints.record_turns(..., [(output, kept), ...], continued=leaf)`, n sibling leaves).
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from stacx.serving.http_guard import HttpError
from stacx.serving.openai_protocol import template_messages
from stacx.wire.chat_continuation import ids_after_assistant_turn
from stacx.wire.chat_encoding import chat_ids
from stacx.wire.trajectories import RecordedTurn

__all__ = ["SessionBook", "SessionRefused", "SessionTurn", "chat_prompt_ids", "check_session_id",
           "completion_prompt_ids"]

logger = logging.getLogger(__name__)

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
    """The recorded turns of every session (thread-safe), and who may use each.

    A session the trainer *opens* (`open`, one per episode) gets a secret: without it the session
    cannot be written, read or popped (`SessionRefused`), and it is never evicted; it lives until it
    is popped. Any other session id is created by its first recorded turn, open to anyone who names
    it, and evicted (least recently used first, counted in `evicted`, warned) beyond `max_sessions`
    such sessions; at most `max_open_sessions` are open at once.

    A session is a tree of turns (stacx.rollout.agents.agent_trajectories): a request may continue any turn
    no later turn continued (a *leaf*); the newest `max_leaves_per_session` leaves keep what a
    request must repeat to continue them (`SessionTurn`)."""

    def __init__(self, *, max_sessions: int = 4096, max_open_sessions: int = 4096,
                 max_turns_per_session: int = 4096, max_leaves_per_session: int = 64):
        self.max_sessions = max_sessions
        self.max_open_sessions = max_open_sessions
        self.max_turns_per_session = max_turns_per_session
        self.max_leaves_per_session = max_leaves_per_session
        self.evicted = 0
        """Sessions dropped to keep at most `max_sessions` (never an open one)."""
        self._open: dict[str, _Session] = {}
        self._loose: "OrderedDict[str, _Session]" = OrderedDict()
        self._lock = threading.Lock()

    # ---- who may use a session ------------------------------------------------------------------

    def open(self, session_id: str) -> str:
        """Open `session_id` for one episode; returns its secret (SessionRefused 409 if it exists)."""
        check_session_id(session_id)
        with self._lock:
            if session_id in self._open or session_id in self._loose:
                raise SessionRefused(409, f"session {session_id} already exists; open each episode under a new id")
            if len(self._open) >= self.max_open_sessions:
                raise SessionRefused(429, f"{len(self._open)} sessions are open (max_open_sessions); pop finished "
                                          "episodes' sessions (DELETE /stacx/sessions/<id>) before opening more")
            secret = secrets.token_urlsafe(24)
            self._open[session_id] = _Session(secret=secret)
            return secret

    def check(self, session_id: str, secret: Optional[str]) -> None:
        """Raise SessionRefused unless `secret` may use `session_id` (see `_session`)."""
        with self._lock:
            self._session(session_id, secret)

    def is_open(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._open

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"open_sessions": len(self._open), "other_sessions": len(self._loose),
                    "evicted_sessions": self.evicted}

    # ---- turns ----------------------------------------------------------------------------------

    def leaves(self, session_id: str, secret: Optional[str] = None) -> list[SessionTurn]:
        """The turns a next request may continue, newest first ([] for an unknown session)."""
        with self._lock:
            session = self._session(session_id, secret)
            return [] if session is None else session.leaves[::-1]

    def last(self, session_id: str, secret: Optional[str] = None) -> Optional[SessionTurn]:
        """The newest leaf (None for an unknown session)."""
        leaves = self.leaves(session_id, secret)
        return leaves[0] if leaves else None

    def record(self, session_id: str, turn: SessionTurn | Sequence[SessionTurn], *, secret: Optional[str] = None,
               continued: Optional[SessionTurn] = None) -> None:
        """Record one request's `turn`, or its `n` turns (one per sample, in choice order), under the
        session; `continued` (one of `leaves`) is the turn the request continues, which stops being a
        leaf: the request's samples are siblings extending it, each a leaf (a next request may continue
        any one of them). A session the trainer opened and since popped refuses (404)."""
        new = [turn] if isinstance(turn, SessionTurn) else list(turn)
        with self._lock:
            session = self._session(session_id, secret)
            if session is None:
                session = self._loose[session_id] = _Session()
                self._evict()
            if session_id in self._loose:
                self._loose.move_to_end(session_id)
            if len(session.turns) + len(new) > self.max_turns_per_session:
                raise ValueError(f"session {session_id}: more than {self.max_turns_per_session} turns; "
                                 "start a new session (a new base URL) per episode")
            session.turns.extend(t.turn for t in new)
            session.leaves = [leaf for leaf in session.leaves if leaf is not continued] + new
            del session.leaves[:-self.max_leaves_per_session]

    def turns(self, session_id: str, *, secret: Optional[str] = None, remove: bool = False) -> list[RecordedTurn]:
        """The session's turns in order ([] for an unknown session); `remove` forgets them."""
        with self._lock:
            session = self._session(session_id, secret)
            if session is None:
                return []
            if remove:
                (self._open if session_id in self._open else self._loose).pop(session_id)
            return list(session.turns)

    def _session(self, session_id: str, secret: Optional[str]) -> Optional["_Session"]:
        """The session (None: unknown). An open session needs its secret: 401 without one, 403 with a
        wrong one. A secret for a session that is not open (never opened, or its episode is over) is
        404: its turns would belong to no episode."""
        opened = self._open.get(session_id)
        if opened is not None:
            if secret is None:
                raise SessionRefused(401, f"session {session_id} belongs to an episode: use the base URL it was "
                                          "given (/sessions/<id>/<secret>/v1) or send its secret as the API key "
                                          "('Authorization: Bearer <secret>')")
            if not hmac.compare_digest(secret.encode("utf-8", "surrogateescape"), opened.secret.encode()):
                raise SessionRefused(403, f"session {session_id}: the secret is wrong")
            return opened
        if secret is not None:
            raise SessionRefused(404, f"no open session {session_id}: it was never opened (POST "
                                      "/stacx/sessions/<id>) or its episode is over (popped)")
        return self._loose.get(session_id)

    def _evict(self) -> None:
        while len(self._loose) > self.max_sessions:
            evicted, _ = self._loose.popitem(last=False)
            self.evicted += 1
            if self.evicted & (self.evicted - 1) == 0:  # the 1st, 2nd, 4th, 8th, ... eviction
                logger.warning("session book full (max_sessions %d sessions that no episode opened): dropped "
                               "session %s, the least recently used; %d dropped so far. Sessions opened for an "
                               "episode (POST /stacx/sessions/<id>) are never dropped", self.max_sessions, evicted,
                               self.evicted)


@dataclass(eq=False)
class _Session:
    secret: Optional[str] = None
    """Set when the trainer opened the session (`SessionBook.open`)."""
    turns: list = field(default_factory=list)
    """Every RecordedTurn, in order."""
    leaves: list = field(default_factory=list)
    """The SessionTurns no later turn continued, oldest first."""


class SessionRefused(HttpError):
    """A request the session's owner did not make (401, 403, 404), or an `open` that cannot be (409, 429)."""

    def __init__(self, status: int, message: str):
        super().__init__(status, message, headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)


def _essence(message: dict) -> tuple:
    """What a message means to the template: role, content, tool calls (name and arguments), tool id."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"].get("arguments") or {}, sort_keys=True))
                  for c in message.get("tool_calls") or ())
    return message["role"], message.get("content") or "", calls, message.get("tool_call_id")


def encode(tokenizer: Any, text: str) -> list[int]:
    """Completion text -> ids (a raw prompt: control spellings in it are the tokens)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_prompt_ids(tokenizer: Any, messages: list[dict], tools: Optional[list[dict]],
                    leaves: Sequence[SessionTurn]) -> tuple[list[int], Optional[SessionTurn]]:
    """(the prompt ids of a chat request, the leaf they continue or None), as in the module doc;
    `leaves` (SessionBook.leaves) are tried newest first."""
    rendered = template_messages(messages)
    for previous in leaves:
        if previous.messages is not None:
            ids = _continuation_ids(tokenizer, rendered, tools, previous)
            if ids is not None:
                return ids, previous
    return chat_ids(tokenizer, rendered, tools=tools), None


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


def completion_prompt_ids(tokenizer: Any, prompt: str | list[int],
                          leaves: Sequence[SessionTurn]) -> tuple[list[int], Optional[SessionTurn]]:
    """(a completion prompt's ids, the leaf they continue or None): token ids as given; text extending a
    leaf's prompt and completion (the longest such) continues its ids (token-in/token-out), other text
    is encoded as `/generate` encodes text."""
    if isinstance(prompt, list):
        return list(prompt), None
    extended = [leaf for leaf in leaves if leaf.text is not None and prompt.startswith(leaf.text)
                and len(prompt) > len(leaf.text)]
    if extended:
        previous = max(extended, key=lambda leaf: len(leaf.text))
        ids = list(previous.turn.prompt_ids + previous.turn.output_ids) + encode(tokenizer, prompt[len(previous.text):])
        return ids, previous
    return list(tokenizer.encode(prompt)), None
