"""Where an agent run's sessions are recorded: the engine's own endpoint, or `stacx serve`'s recorder in front of it.

An `--agent` / `--agent-command` run trains on its agent's conversations recorded token-exact: the prompt ids,
the ids the engine generated and their log-probs. `stacx serve` records them itself (engine kinds with
`records_sessions`). An engine that takes and returns token ids with per-token log-probs but records no
sessions (`sessions_through_recorder`: vLLM) gets the same recorder in front of it, in the driver:
`stacx serve`'s HTTP server (`EngineHttpServer`) over the driver's engine client, with the checkpoint's
tokenizer and chat template. It renders each chat turn to ids, generates through the client (ids in, ids and
log-probs out) and records the turn; weights keep going straight to the engine, so the front takes none
(`weight_updates=False`), and its sessions need a fresh secret of their own.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from stacx.rollout.engines.registry import EngineKind


@dataclass(frozen=True, kw_only=True)
class SessionEndpoint:
    """The server an agent run opens its sessions on."""

    url: str
    """Base URL of the session-recording server."""
    api_key: Optional[str] = field(default=None, repr=False)
    """The secret that opens a session there (None: the server takes none)."""


def session_endpoint(kind: EngineKind, rollout: Any, *, model_path: str,
                     front_factory: Optional[Callable[..., Any]] = None) -> SessionEndpoint:
    """The endpoint an agent run records on: the engine's own when `kind` records sessions, else a recorder started
    in front of `rollout.engine` (`rollout`: the RolloutService; the front is stopped when it closes). A kind that
    does neither is refused naming the trait (the preflight refuses it first). `front_factory`: the
    `EngineHttpServer` class (tests pass a fake)."""
    if kind.records_sessions:
        return SessionEndpoint(url=rollout.url, api_key=rollout.api_key)
    if not kind.sessions_through_recorder:
        raise ValueError(f"--rollout-engine {kind.name!r} records no agent sessions and takes no recorder in front "
                         "(register it with records_sessions=True or sessions_through_recorder=True)")
    if front_factory is None:
        from stacx.serving.server import EngineHttpServer  # the HTTP server's imports only for agent runs

        front_factory = EngineHttpServer
    front = front_factory(rollout.engine, tokenizer=rollout.tokenizer, model_path=model_path,
                          weight_updates=False, api_key=secrets.token_urlsafe(32))
    front.start()
    rollout.close_first(front.stop)
    return SessionEndpoint(url=front.url, api_key=front.api_key)
