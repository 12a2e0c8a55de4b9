"""Where an agent run's sessions are recorded: the engine's own endpoint, or `stacx serve`'s recorder in front of it.

An `--agent` / `--agent-command` run trains on its agent's conversations recorded token-exact: the prompt ids,
the ids the engine generated and their log-probs. `stacx serve` records them itself (engine kinds with
`records_sessions`). An engine that takes and returns token ids with per-token log-probs but records no
sessions (`sessions_through_recorder`: vLLM) gets the same recorder in front of it, in the driver: a
*session front* over the driver's engine client, with the checkpoint's tokenizer and chat template. It renders
each chat turn to ids, generates through the client (ids in, ids and log-probs out) and records the turn; weights
keep going straight to the engine, so the front takes none (`weight_updates=False`), and its sessions need a fresh
secret of their own.

The front is `stacx serve`'s HTTP server, which the trainer does not import (`stacx.serving` is the server
process's package): the launch layer gives its factory with `set_session_front_factory` before a run starts
(`stacx.launch.session_front`, installed by `stacx train` for every run), and tests give a fake the same way
or through `session_endpoint(front_factory=...)`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:  # the launch layer imports this module: it stays light (no engine client)
    from stacx.rollout.engines.registry import EngineKind


@dataclass(frozen=True, kw_only=True)
class SessionEndpoint:
    """The server an agent run opens its sessions on."""

    url: str
    """Base URL of the session-recording server."""
    api_key: Optional[str] = field(default=None, repr=False)
    """The secret that opens a session there (None: the server takes none)."""


class SessionFront(Protocol):
    """A started session recorder in front of an engine client (`stacx serve`'s `EngineHttpServer`)."""

    url: str
    api_key: Optional[str]

    def start(self) -> Any: ...

    def stop(self) -> None: ...


class SessionFrontFactory(Protocol):
    """Builds the (not yet started) session recorder in front of `engine`."""

    def __call__(self, engine: Any, *, tokenizer: Any, model_path: str, weight_updates: bool,
                 api_key: str) -> SessionFront: ...


_session_front_factory: Optional[SessionFrontFactory] = None


def set_session_front_factory(factory: Optional[SessionFrontFactory]) -> Optional[SessionFrontFactory]:
    """Give the factory of the recorder started in front of `sessions_through_recorder` engines (the launch layer
    does, before a run starts; None removes it). Returns the factory it replaces (tests put it back)."""
    global _session_front_factory
    previous, _session_front_factory = _session_front_factory, factory
    return previous


def session_front_factory() -> Optional[SessionFrontFactory]:
    """The factory `set_session_front_factory` gave (None: none given)."""
    return _session_front_factory


def session_endpoint(kind: EngineKind, rollout: Any, *, model_path: str,
                     front_factory: Optional[SessionFrontFactory] = None) -> SessionEndpoint:
    """The endpoint an agent run records on: the engine's own when `kind` records sessions, else a recorder started
    in front of `rollout.engine` (`rollout`: the RolloutService; the front is stopped when it closes). A kind that
    does neither is refused naming the trait (the preflight refuses it first). `front_factory`: the recorder's
    factory (default: the one the launch layer gave, `set_session_front_factory`)."""
    if kind.records_sessions:
        return SessionEndpoint(url=rollout.url, api_key=rollout.api_key)
    if not kind.sessions_through_recorder:
        raise ValueError(f"--rollout-engine {kind.name!r} records no agent sessions and takes no recorder in front "
                         "(register it with records_sessions=True or sessions_through_recorder=True)")
    front_factory = front_factory or _session_front_factory
    if front_factory is None:
        raise RuntimeError(f"--rollout-engine {kind.name!r}: an agent run on this engine records its sessions with "
                           "`stacx serve`'s recorder in front of it, and no recorder was given; run it with `stacx "
                           "train`, or call stacx.launch.session_front.install_session_front() before "
                           "stacx.trainer.run_training")
    front = front_factory(rollout.engine, tokenizer=rollout.tokenizer, model_path=model_path,
                          weight_updates=False, api_key=secrets.token_urlsafe(32))
    front.start()
    rollout.close_first(front.stop)
    return SessionEndpoint(url=front.url, api_key=front.api_key)
