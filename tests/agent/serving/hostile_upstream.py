"""An OpenAI-compatible upstream on loopback that misbehaves on purpose, for the fallback tests that
need an upstream to fail in one particular way (the well-behaved upstream is a second real agent).

Each mode is one way an upstream can be broken or hostile:

    500-echo       answers 500 quoting the Authorization header it was sent (after `pad` characters,
                   so that a quote cut to length can fall inside the key)
    error-echo     one token, then an SSE error event quoting the Authorization header the same way
    garbage        a 200 stream of non-JSON
    hang           never answers
    truncate       one token, then drops the connection
    endless-line   one SSE line that never ends (`line_bytes` of it, then silence)
    keep-alive     one token, then only SSE comments, every `pace_s`
    empty-chunks   one token, then only chunks without a token, every `pace_s`
    drip           one token, then a line that grows one byte every `pace_s` and never ends
    ignore-limits  streams every one of `tokens` (one chunk each) whatever the request asked

It answers HTTP/1.0 style (the body ends when the connection closes) from a thread per request;
writes to a client that went away end the answer quietly.
"""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODES = frozenset(
    {
        "500-echo",
        "error-echo",
        "garbage",
        "hang",
        "truncate",
        "endless-line",
        "keep-alive",
        "empty-chunks",
        "drip",
        "ignore-limits",
    }
)


def chunk(content: str | None = None, finish: str | None = None, **extra: object) -> bytes:
    """One SSE event of a chat completion stream."""
    choices = [] if content is None and finish is None else [{"index": 0, "delta": {"content": content}}]
    if choices:
        choices[0]["finish_reason"] = finish
    body = {"id": "x", "object": "chat.completion.chunk", "model": "hostile", "choices": choices, **extra}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class HostileUpstream:
    """The server; `requests` counts what it was asked, `authorization` keeps the headers it got,
    `bodies` the JSON requests."""

    def __init__(
        self,
        mode: str,
        *,
        pad: int = 0,
        line_bytes: int = 8 << 20,
        pace_s: float = 0.05,
        tokens: tuple[str, ...] = ("tok ",) * 3000,
    ) -> None:
        assert mode in MODES, mode
        self.mode, self.pad, self.line_bytes, self.pace_s, self.tokens = mode, pad, line_bytes, pace_s, tokens
        self.requests = 0
        self.authorization: list[str] = []
        self.bodies: list[dict] = []
        self.stop = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                outer.requests += 1
                outer.authorization.append(self.headers.get("Authorization", ""))
                outer.bodies.append(json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0)))))
                # The agent hanging up on it is what a hostile upstream's victim should do.
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    outer.answer(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        """The /v1 base URL to configure as the fallback's upstream."""
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def echo(self, handler: BaseHTTPRequestHandler) -> str:
        """What an echoing upstream says: `pad` characters, then the header with the key."""
        return "." * self.pad + f"bad auth {handler.headers.get('Authorization')}"

    def answer(self, handler: BaseHTTPRequestHandler) -> None:
        """Answer one request as the mode says."""
        if self.mode == "hang":
            self.stop.wait(60)
            return
        if self.mode == "500-echo":
            body = json.dumps({"error": {"message": self.echo(handler)}}).encode()
            handler.send_response(500)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
            return
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.end_headers()
        out = handler.wfile
        if self.mode == "garbage":
            out.write(b"data: {this is not json\n\n")
        elif self.mode == "endless-line":
            out.write(b"data: ")
            block = b"A" * (64 << 10)
            for _ in range(self.line_bytes // len(block)):
                out.write(block)
            self.stop.wait(60)
        elif self.mode == "ignore-limits":
            for token in self.tokens:
                out.write(chunk(token))
            out.write(chunk("", "length"))
            out.write(chunk(usage={"prompt_tokens": 5, "completion_tokens": len(self.tokens)}))
            out.write(b"data: [DONE]\n\n")
        else:
            out.write(chunk("UP"))
            out.flush()
            self._after_the_first_token(handler)
        out.flush()
        handler.close_connection = True

    def _after_the_first_token(self, handler: BaseHTTPRequestHandler) -> None:
        out = handler.wfile
        if self.mode == "error-echo":
            out.write(b"data: " + json.dumps({"error": {"message": self.echo(handler)}}).encode() + b"\n\n")
            return
        if self.mode == "truncate":
            return
        # Bytes that keep the connection busy and carry no token, until the agent hangs up.
        pieces = {
            "keep-alive": [b": keep-alive\n\n"],
            "empty-chunks": [chunk()],
            "drip": [b"data: ", b" "],  # a line that grows a byte at a time and never ends
        }[self.mode]
        while not self.stop.wait(self.pace_s):
            out.write(pieces[0])
            out.flush()
            pieces = pieces[1:] or pieces  # the last piece over and over

    def close(self) -> None:
        """Stop answering; hung answers end."""
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()
