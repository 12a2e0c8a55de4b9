"""The reference sandbox server: a local backend behind HTTP, what the `remote` backend talks to.

    python -m stacx.sandbox.server --backend namespace --port 8700 [--max-concurrent-runs 8]

    GET    /health                   {"backend": "namespace"}
    POST   /sessions                 body: a .tar[.gz] of the working copy  -> {"session_id": "..."}
    POST   /sessions/{id}/run        {"command": str | [str], "limits": {...}, "stdin_base64": str | null} -> RunResult
    DELETE /sessions/{id}            kills the session's processes, deletes its working copy

A Docker, Modal or cloud sandbox service is served the same way by answering these four routes.
A non-loopback address needs a bearer key (--api-key-env NAME: the key is read from that variable).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import os
import threading
import uuid
from typing import Optional, Union

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from stacx.network import is_loopback_host
from stacx.sandbox.config import SandboxConfig, build_sandbox
from stacx.sandbox.limits import SandboxLimits
from stacx.sandbox.protocol import Sandbox, SandboxClosedError, SandboxSession

MAX_UPLOAD_BYTES = 256 << 20
"""Largest working-copy tarball the server accepts."""


class RunRequest(BaseModel):
    command: Union[str, list[str]]
    limits: Optional[dict] = None
    stdin_base64: Optional[str] = None


def create_app(sandbox: Sandbox, *, api_key: Optional[str] = None, max_sessions: int = 64) -> FastAPI:
    """The FastAPI app serving `sandbox`; at most `max_sessions` open sessions (429 past it)."""
    app = FastAPI(title="Stacx sandbox server")
    sessions: dict[str, SandboxSession] = {}
    lock = threading.Lock()

    def authorize(authorization: Optional[str] = Header(default=None)) -> None:
        if api_key is not None and authorization != f"Bearer {api_key}":
            raise HTTPException(401, "missing or wrong bearer key (Authorization: Bearer KEY)")

    def session_of(session_id: str) -> SandboxSession:
        with lock:
            session = sessions.get(session_id)
        if session is None:
            raise HTTPException(404, f"no open sandbox session {session_id!r}")
        return session

    @app.get("/health")
    def health() -> dict:
        return {"backend": sandbox.name}

    @app.post("/sessions", dependencies=[Depends(authorize)])
    async def create_session(request: Request) -> dict:
        length = int(request.headers.get("content-length") or 0)
        if length > MAX_UPLOAD_BYTES:
            raise HTTPException(413, f"working-copy tarball of {length} bytes is over the {MAX_UPLOAD_BYTES}-byte limit")
        body = await request.body()
        with lock:
            if len(sessions) >= max_sessions:
                raise HTTPException(429, f"{max_sessions} sandbox sessions are open; close one first")
            session_id = uuid.uuid4().hex
            sessions[session_id] = None  # reserved while the copy is made
        try:
            session = await run_in_threadpool(sandbox.create, body)  # copying is blocking work
        except ValueError as err:
            with lock:
                sessions.pop(session_id, None)
            raise HTTPException(400, str(err)) from None
        with lock:
            sessions[session_id] = session
        return {"session_id": session_id}

    @app.post("/sessions/{session_id}/run", dependencies=[Depends(authorize)])
    def run(session_id: str, body: RunRequest) -> dict:  # sync: FastAPI runs it in a worker thread
        session = session_of(session_id)
        try:
            limits = SandboxLimits.from_dict(body.limits) if body.limits is not None else None
            stdin = base64.b64decode(body.stdin_base64, validate=True) if body.stdin_base64 is not None else None
            return session.run(body.command, limits, stdin=stdin).to_dict()
        except (ValueError, binascii.Error) as err:
            raise HTTPException(400, str(err)) from None
        except SandboxClosedError:
            raise HTTPException(404, f"sandbox session {session_id!r} was closed") from None

    @app.delete("/sessions/{session_id}", dependencies=[Depends(authorize)])
    def close(session_id: str) -> dict:
        session = session_of(session_id)
        with lock:
            sessions.pop(session_id, None)
        session.close()
        return {"closed": session_id}

    @app.on_event("shutdown")
    def close_all() -> None:
        with lock:
            open_sessions = [s for s in sessions.values() if s is not None]
            sessions.clear()
        for session in open_sessions:
            session.close()

    return app


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stacx.sandbox.server", description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="namespace", choices=["namespace", "bubblewrap"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8700)
    parser.add_argument("--max-concurrent-runs", type=int, default=4)
    parser.add_argument("--max-sessions", type=int, default=64)
    parser.add_argument("--api-key-env", default=None, help="name of the environment variable holding the bearer key")
    args = parser.parse_args(argv)
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    if args.api_key_env and not api_key:
        parser.error(f"--api-key-env {args.api_key_env}: that environment variable is empty or unset")
    if not is_loopback_host(args.host) and api_key is None:
        parser.error(f"--host {args.host} is reachable from other machines; give a bearer key with --api-key-env NAME")
    sandbox = build_sandbox(SandboxConfig(backend=args.backend, max_concurrent_runs=args.max_concurrent_runs))
    uvicorn.run(create_app(sandbox, api_key=api_key, max_sessions=args.max_sessions), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
