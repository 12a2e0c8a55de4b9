"""The `remote` backend: sessions on a sandbox server over HTTP (`stacx.sandbox.server`, or any
service answering its four routes: a Docker, Modal or cloud sandbox behind the same interface).

What it guarantees is what the server's backend guarantees; this side adds the run slots and an
HTTP timeout of the command's wall time plus REQUEST_MARGIN_S.
"""

from __future__ import annotations

import base64
from dataclasses import fields
from typing import Optional

import requests

from stacx.sandbox.limits import SandboxLimits
from stacx.sandbox.process import RunSlots
from stacx.sandbox.protocol import (ClosedOnExit, Command, RunResult, SandboxClosedError, SandboxServerError,
                                    SandboxUnavailableError, Source)
from stacx.sandbox.working_copy import pack_folder

RESULT_FIELDS = tuple(field.name for field in fields(RunResult))

REQUEST_MARGIN_S = 30.0
"""Seconds an HTTP call may take beyond the command's wall-time limit (upload, start-up, queueing)."""


class RemoteSession(ClosedOnExit):
    def __init__(self, sandbox: "RemoteSandbox", session_id: str):
        self._sandbox = sandbox
        self.session_id = session_id
        self._closed = False

    def run(self, command: Command, limits: Optional[SandboxLimits] = None, *,
            stdin: Optional[bytes] = None) -> RunResult:
        if self._closed:
            raise SandboxClosedError("this sandbox session is closed; create a new one")
        limits = limits or self._sandbox.default_limits
        body = {"command": command, "limits": limits.to_dict(),
                "stdin_base64": base64.b64encode(stdin).decode("ascii") if stdin is not None else None}
        with self._sandbox.slots.slot():
            answer = self._sandbox.request("POST", f"/sessions/{self.session_id}/run", json=body,
                                           timeout=float(limits.wall_time_s) + REQUEST_MARGIN_S)
        return RunResult(**{name: answer[name] for name in RESULT_FIELDS if name in answer})

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sandbox.request("DELETE", f"/sessions/{self.session_id}", timeout=REQUEST_MARGIN_S)
        except (SandboxUnavailableError, SandboxServerError):
            pass  # the server is gone or restarted: the session went with it


def read_api_key_file(path: str) -> str:
    """The bearer key in `path` (the server's generated key file), or SandboxUnavailableError naming the setting."""
    try:
        with open(path) as key_file:
            key = key_file.read().strip()
    except OSError as err:
        raise SandboxUnavailableError(f"sandbox.remote_api_key_file {path!r} cannot be read ({err}); give the path "
                                      "the sandbox server printed, or sandbox.remote_api_key") from None
    if not key:
        raise SandboxUnavailableError(f"sandbox.remote_api_key_file {path!r} is empty")
    return key


class RemoteSandbox:
    name = "remote"

    def __init__(self, url: str, *, default_limits: SandboxLimits, slots: RunSlots, api_key: Optional[str] = None,
                 api_key_file: Optional[str] = None):
        self.url = url.rstrip("/")
        self.default_limits = default_limits
        self.slots = slots
        self._http = requests.Session()
        if not api_key and api_key_file:
            api_key = read_api_key_file(api_key_file)
        if api_key:
            self._http.headers["Authorization"] = f"Bearer {api_key}"
        try:
            self._http.get(f"{self.url}/health", timeout=10).raise_for_status()
        except requests.RequestException as err:
            raise SandboxUnavailableError(f"sandbox backend 'remote' (setting sandbox.remote_url = {self.url!r}): the "
                                          f"server does not answer /health: {err}; start one with "
                                          "`python -m stacx.sandbox.server` or fix the URL") from None

    def request(self, method: str, path: str, **kwargs) -> dict:
        """The server's JSON answer. A server that does not answer raises SandboxUnavailableError, one that fails
        the request (5xx) or lost the session (404) SandboxServerError, a refused request ValueError (400) or
        RuntimeError (401, 403, ...)."""
        try:
            response = self._http.request(method, f"{self.url}{path}", **kwargs)
        except (requests.ConnectionError, requests.Timeout) as err:
            raise SandboxUnavailableError(f"sandbox server {self.url}: {method} {path} got no answer: "
                                          f"{type(err).__name__}: {err}") from None
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            error = ValueError if response.status_code == 400 else (
                SandboxServerError if response.status_code == 404 or response.status_code >= 500 else RuntimeError)
            raise error(f"sandbox server {self.url}: {method} {path} -> {response.status_code}: {detail}")
        return response.json()

    def create(self, source: Source) -> RemoteSession:
        answer = self.request("POST", "/sessions", data=pack_folder(source),
                              headers={"Content-Type": "application/octet-stream"}, timeout=REQUEST_MARGIN_S)
        return RemoteSession(self, answer["session_id"])
