"""The reference sandbox server: a local backend behind HTTP, what the `remote` backend talks to.

    python -m stacx.sandbox.server --backend namespace --port 8700 [--max-concurrent-runs 8]

    GET    /health                   {"backend": "namespace"}
    POST   /sessions                 body: a .tar[.gz] of the working copy  -> {"session_id": "..."}
    POST   /sessions/{id}/run        {"command": str | [str], "limits": {...}, "stdin_base64": str | null} -> RunResult
    DELETE /sessions/{id}            kills the session's processes, deletes its working copy

A Docker, Modal or cloud sandbox service is served the same way by answering these four routes.

Every route but /health needs a bearer key: --api-key-env NAME reads it from that variable; without
it the server generates one, writes it to a mode-0600 file (--api-key-file, default
stacx-sandbox-PORT.key in $XDG_RUNTIME_DIR or a private stacx-UID folder of the temp folder), prints
the path, and removes the file when it stops; a client names it with sandbox.remote_api_key_file.
Request bodies are counted as they stream in (chunked ones included): past MAX_UPLOAD_BYTES the
request gets 413 and the rest is never read. A working-copy snapshot is checked against the
session bounds (SandboxLimits.max_disk_bytes, max_inodes) before it is unpacked.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import os
import secrets
import threading
import uuid
from typing import Optional, Union

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from stacx.network import private_file_path, write_private_file
from stacx.sandbox.config import SandboxConfig, build_sandbox
from stacx.sandbox.limits import SandboxLimits
from stacx.sandbox.protocol import Sandbox, SandboxClosedError, SandboxSession

MAX_UPLOAD_BYTES = 256 << 20
"""Largest request body the server reads (a working-copy tarball, a command with its stdin)."""


class BodyLimit:
    """ASGI middleware: a request whose body passes `max_bytes` gets 413, whether it declares a Content-Length
    or streams chunks; the bytes are counted as the app reads them, so nothing past the limit is ever read."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def too_large(self, size: str) -> HTTPException:
        # Connection: close makes the server drop the connection after answering instead of draining the rest.
        return HTTPException(413, f"request body of {size} bytes is over the server's {self.max_bytes}-byte limit "
                                  "(MAX_UPLOAD_BYTES); send a smaller working copy", headers={"Connection": "close"})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self.app(scope, self._refuse(self.too_large(declared.decode())), send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise self.too_large(f"more than {self.max_bytes}")
            return message

        await self.app(scope, counted, send)

    @staticmethod
    def _refuse(error: HTTPException):
        async def receive():
            raise error
        return receive


class RunRequest(BaseModel):
    command: Union[str, list[str]]
    limits: Optional[dict] = None
    stdin_base64: Optional[str] = None


def create_app(sandbox: Sandbox, *, api_key: Optional[str] = None, max_sessions: int = 64,
               max_upload_bytes: int = MAX_UPLOAD_BYTES) -> FastAPI:
    """The FastAPI app serving `sandbox`; at most `max_sessions` open sessions (429 past it), request bodies of at
    most `max_upload_bytes` (413 past it, counted as they stream in). `api_key` None serves without a key (for
    an app embedded in a process that guards it otherwise; `main` always has one)."""
    app = FastAPI(title="Stacx sandbox server")
    app.add_middleware(BodyLimit, max_bytes=max_upload_bytes)
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
        body = await request.body()  # BodyLimit counts it as it streams in
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


def server_api_key(args, parser) -> tuple[str, Optional[str]]:
    """(key, the generated key file or None): --api-key-env's variable, else a generated key written mode 0600."""
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            parser.error(f"--api-key-env {args.api_key_env}: that environment variable is empty or unset")
        return api_key, None
    api_key = secrets.token_urlsafe(32)
    try:
        path = args.api_key_file or private_file_path(f"stacx-sandbox-{args.port}.key")
        return api_key, write_private_file(path, api_key)
    except OSError as err:
        parser.error(f"cannot write the generated key ({err}); pass --api-key-file PATH in a folder you own, "
                     "or --api-key-env NAME")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stacx.sandbox.server", description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="namespace", choices=["namespace", "bubblewrap"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8700)
    parser.add_argument("--max-concurrent-runs", type=int, default=4)
    parser.add_argument("--max-sessions", type=int, default=64)
    parser.add_argument("--api-key-env", default=None,
                        help="name of the environment variable holding the bearer key; default: a generated key")
    parser.add_argument("--api-key-file", default=None,
                        help="where the generated key is written (mode 0600; removed when the server stops); default: "
                             "stacx-sandbox-PORT.key in $XDG_RUNTIME_DIR, else in a private stacx-UID folder of the "
                             "temp folder")
    bounds = SandboxLimits()
    parser.add_argument("--max-disk-bytes", type=int, default=bounds.max_disk_bytes,
                        help="bytes a session may hold; a larger snapshot is refused before it is unpacked "
                             "(SandboxLimits.max_disk_bytes, default: %(default)s)")
    parser.add_argument("--max-inodes", type=int, default=bounds.max_inodes,
                        help="files and folders a session may hold (SandboxLimits.max_inodes, default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        limits = SandboxLimits(max_disk_bytes=args.max_disk_bytes, max_inodes=args.max_inodes)
    except ValueError as err:
        parser.error(str(err))
    sandbox = build_sandbox(SandboxConfig(backend=args.backend, max_concurrent_runs=args.max_concurrent_runs,
                                          limits=limits))
    api_key, key_file = server_api_key(args, parser)
    if key_file is not None:
        print(f"stacx sandbox server: clients need the generated bearer key in {key_file} (mode 0600): set "
              f"sandbox.remote_api_key_file = {key_file}", flush=True)
    try:
        uvicorn.run(create_app(sandbox, api_key=api_key, max_sessions=args.max_sessions), host=args.host,
                    port=args.port, log_level="warning")
    finally:
        if key_file is not None and os.path.exists(key_file):
            os.unlink(key_file)


if __name__ == "__main__":
    main()
