"""Errors of the OpenAI-compatible endpoint in OpenAI's schema, so OpenAI clients show the message.

    {"error": {"message": "/v1/chat/completions: 'stop' may hold at most 4 strings, got 5",
               "type": "BadRequestError", "param": "stop", "code": 400}}

The shape is vLLM's OpenAI server's (`ErrorResponse` / `ErrorInfo`): `type` is the HTTP status's
name as an error class, `code` the HTTP status. The official `openai` client reads
`body["error"]["message"]` into its exception's text; a bare `{"error": "text"}` shows only
`Error code: 400`. Every path with a `/v1/` segment answers this way; Stacx's own endpoints keep
`{"error": "text"}`.
"""

from __future__ import annotations

import re
from typing import Optional

__all__ = ["is_openai_path", "openai_error_body"]

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 409: "ConflictError", 413: "RequestTooLargeError", 429: "RateLimitError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}
"""The `type` per HTTP status (vLLM's names where it has one); other statuses are "Error"."""
_PARAM = re.compile(r"^(?:\S+: )?'([A-Za-z_][A-Za-z0-9_]*)")
"""The request field a message starts by naming, after its endpoint: "/v1/completions: 'prompt' must ..."."""


def is_openai_path(path: str) -> bool:
    """True for `/v1/...` and `/sessions/<id>/v1/...`."""
    return path.startswith("/v1/") or "/v1/" in path and path.startswith("/sessions/")


def openai_error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    """`{"error": {"message", "type", "param", "code"}}`; `param` defaults to the field the message
    names first (Stacx's messages start with the quoted field, e.g. "'n' must be ...")."""
    if param is None:
        named = _PARAM.match(message)
        param = named.group(1) if named else None
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}
