"""The session recorder the driver starts in front of an engine that records no agent sessions (vLLM).

`stacx.trainer.session_recorder` starts it for `--agent` / `--agent-command` runs on a `sessions_through_recorder`
engine kind, but the trainer never imports the server process's package (`stacx.serving`): this launch module
gives it `stacx serve`'s HTTP server as the recorder's factory. `stacx train` installs it before every run
(`run_workload`); a Python caller of `stacx.trainer.run_training` calls `install_session_front()` first.
"""

from __future__ import annotations

from typing import Any

from stacx.trainer.session_recorder import set_session_front_factory


def engine_http_server(engine: Any, **settings: Any):
    """`stacx serve`'s HTTP server (`EngineHttpServer`, not started) over the driver's engine client: it renders each
    chat turn to ids, generates through `engine` and records the turn. `settings`: its keyword arguments."""
    # Imported here: the HTTP server's modules load only when an agent run needs a recorder (start-up time).
    from stacx.serving.server import EngineHttpServer

    return EngineHttpServer(engine, **settings)


def install_session_front() -> None:
    """Make `stacx serve`'s HTTP server the recorder in front of engines that record no sessions."""
    set_session_front_factory(engine_http_server)


__all__ = ["engine_http_server", "install_session_front"]
