"""A loopback HTTP server answering fixed JSON routes, for checks of clients and preflights against a fake server.

    server, url, posted = serve_json_routes({"/health": (200, {})}, {"/v1/completions": (200, ANSWER)})
    ...
    server.shutdown()

GET and POST paths map to (status, JSON body); an unknown path is a 404 `{"detail": "Not Found"}` (as FastAPI
answers); every POST's path and parsed body are appended to `posted`.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NOT_FOUND = (404, {"detail": "Not Found"})


def answer_json(handler: BaseHTTPRequestHandler, status: int, body) -> None:
    """Send `body` as a JSON answer with `status` from a request handler (the fakes' one way to answer)."""
    payload = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(payload)))
    handler.end_headers()
    handler.wfile.write(payload)


def serve_json_routes(get_routes: dict, post_routes: dict | None = None):
    """Start the server on a free loopback port in a daemon thread; returns (server, base URL, posted)."""
    posted: list[tuple[str, object]] = []
    post_routes = post_routes or {}

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status, body):
            answer_json(self, status, body)

        def do_GET(self):
            self._answer(*get_routes.get(self.path, NOT_FOUND))

        def do_POST(self):
            posted.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            self._answer(*post_routes.get(self.path, NOT_FOUND))

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", posted


def answer_event_stream(handler: BaseHTTPRequestHandler, frames: list[bytes], cut: int | None = None) -> None:
    """Send server-sent events, one chunk per frame (`b"data: ..."`), from a request handler; with `cut`, only the
    first `cut` frames before the connection drops (a server killed mid-answer)."""
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream; charset=utf-8")
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    for number, frame in enumerate(frames):
        if cut is not None and number == cut:
            handler.wfile.flush()
            handler.connection.shutdown(socket.SHUT_RDWR)
            handler.close_connection = True
            return
        data = frame + b"\n\n"
        handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        handler.wfile.flush()
    handler.wfile.write(b"0\r\n\r\n")


class ReplayServer:
    """A loopback server of `handler_class` whose handlers read `server.answer` and append each POST's body to
    `server.bodies` (the streamed-answer fakes)."""

    def __init__(self, handler_class, answer):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler_class)
        self.httpd.answer, self.httpd.bodies = answer, []
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()

    @property
    def bodies(self) -> list[dict]:
        return self.httpd.bodies

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
