"""`EndpointHost`: what the OpenAI- and Anthropic-compatible endpoints need from the server that mounts them.

The endpoints depend on this protocol, not on `stacx.serving.server`: the server builds the endpoints,
and `EngineHttpServer` is one host among any that give these members (a test may give a fake).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:  # annotations only
    from fastapi import Request


class EndpointHost(Protocol):
    """The served engine, its tokenizer and the one generation path that every endpoint shares."""

    engine: Any
    """The engine generating (an `InferenceEngine`); the endpoints read its `context_length` when it has one."""
    tokenizer: Any
    """The served model's tokenizer (None: the endpoints that need one answer 400)."""
    model_path: Optional[str]
    """The served checkpoint's folder: its name is the model's id in `/v1/models`."""
    api_key: Optional[str]
    """The bearer token that opening a session requires (None: none)."""
    max_text_chars: int
    """The longest text a request may carry."""

    async def run_engine(self, request: "Request", requests: list) -> list:
        """Generate `requests` through the server's admission, pause gate, abort book and batcher."""
        ...
