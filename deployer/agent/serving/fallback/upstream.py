"""The upstream model: an OpenAI-compatible API asked over HTTP(S) with httpx's async client.

httpx rather than our own HTTP code: it is what the official openai client runs on, it pools
connections to the upstream, and it streams responses on the agent's event loop with per-read
timeouts. Every request is streamed (`stream: true`), so that the answer can be committed to as soon
as the upstream's first token is in hand: `UpstreamClient.open` returns only then, and raises
UpstreamFailure for anything short of that (unreachable, too slow, an error status, a body that is
not an OpenAI stream), before any of it reaches the client.

The upstream is sent the client's request (source._upstream_body says which fields are set here), so
its answer can hold tool calls and logprobs: tool calls become the text the device's own model
writes for them, which the routes parse the same way; logprobs become this agent's TokenLogprobs.

The API key travels only in the Authorization header; every text taken from the upstream into an
error message is scrubbed of it (and of any piece of it, core/redact.redact_pieces) before it is
cut to length, since a broken upstream may echo the request back.

The upstream is not trusted to behave (docs/security-model.md#the-fallback-upstream): its stream is
read raw (no content encoding, so no decompression bomb) in lines of at most _MAX_LINE_BYTES and
_MAX_BODY_BYTES in all, which httpx's own line reader does not bound; the answer is held to the
request's own max_tokens and stop strings, whatever the upstream does with them; and
`read_timeout_s` runs between tokens, so keep-alive comments or tokenless chunks cannot hold a
stream open.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Literal

import httpx

from deployer.agent.chat import tool_call_frame
from deployer.agent.engines.textstream import StopMatcher
from deployer.agent.openai.schemas import ApiError
from deployer.agent.serving.generate import Cancelled, ServedBy, Started
from deployer.agent.types import EngineInfo, Logprob, TokenEvent, TokenLogprobs
from deployer.core.redact import redact_pieces

__all__ = ["UPSTREAM_TOKEN", "FailureKind", "UpstreamClient", "UpstreamFailure", "UpstreamGeneration"]

UPSTREAM_TOKEN = -1  # the token id of an upstream chunk: a token, but not one of our vocabulary
FailureKind = Literal["connect", "timeout", "status", "malformed", "open"]  # open: the breaker said no
_ERROR_BODY_BYTES = 2048  # how much of an upstream's error text is read (and scrubbed)
_QUOTED_CHARS = 300  # how much of it an error message quotes
# An SSE line holds one chunk: a token with its logprobs (20 alternatives at most) is a few KiB.
_MAX_LINE_BYTES = 1 << 20
_MAX_BODY_BYTES = 64 << 20  # a whole answer: max_tokens chunks of logprobs fit many times over
# The most text one token may carry: an upstream that packs its whole answer into one chunk still
# gets no more than max_tokens of these.
_TOKEN_CHARS = 64


class UpstreamFailure(Exception):
    """The upstream did not start a usable answer. `kind` is the metric label; `status` its HTTP
    status when it sent one."""

    def __init__(self, kind: FailureKind, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.status = status


class UpstreamClient:
    """Streams chat and text completions from one upstream. Use on one event loop."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None,
        *,
        first_token_timeout_s: float,
        read_timeout_s: float,
    ) -> None:
        self.model = model
        self._key = api_key
        self._first_token_s = first_token_timeout_s
        self._token_s = read_timeout_s
        headers = {"Accept-Encoding": "identity"}  # read raw: bounded bytes are bounded memory
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/") + "/",
            headers=headers,
            timeout=httpx.Timeout(read_timeout_s, connect=first_token_timeout_s),
            follow_redirects=False,  # a redirect would carry the key elsewhere
        )

    async def aclose(self) -> None:
        """Close the pooled connections."""
        await self._http.aclose()

    async def open(
        self,
        kind: Literal["chat", "completion"],
        body: dict[str, Any],
        *,
        max_tokens: int,
        stop: Sequence[str] = (),
    ) -> UpstreamGeneration:
        """Send the request and wait for the first token (or the end of a tokenless answer). The
        answer ends at `max_tokens` tokens or the first of the `stop` strings, as the device's own
        would, even where the upstream goes on.

        Raises UpstreamFailure when none comes within the first-token timeout, the upstream answers
        with an error status, or what it sends is not an OpenAI stream (or passes the size limits)."""
        path = "chat/completions" if kind == "chat" else "completions"
        body = {**body, "model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        began = time.monotonic()
        response: httpx.Response | None = None
        try:
            async with asyncio.timeout(self._first_token_s):
                request = self._http.build_request("POST", path, json=body)
                response = await self._http.send(request, stream=True)
                if response.status_code != 200:
                    raise await self._status_failure(response)
                if response.headers.get("content-encoding", "identity").lower() != "identity":
                    raise UpstreamFailure("malformed", "the upstream compressed its stream, unasked")
                limits = _Limits(max_tokens, stop)
                generation = UpstreamGeneration(response, kind, self.quote, self.model, limits, self._token_s)
                await generation.prime()
        except TimeoutError:
            await _close(response)
            raise UpstreamFailure(
                "timeout", f"the upstream sent no token within {self._first_token_s:g} s"
            ) from None
        except httpx.HTTPError as exc:
            await _close(response)
            raise UpstreamFailure("connect", f"cannot reach the upstream: {self.quote(exc)}") from None
        except BaseException:
            await _close(response)
            raise
        generation.latency_s = time.monotonic() - began
        return generation

    async def _status_failure(self, response: httpx.Response) -> UpstreamFailure:
        raw = b""
        async for chunk in response.aiter_raw():
            raw += chunk
            if len(raw) >= _ERROR_BODY_BYTES:
                break
        text = raw[:_ERROR_BODY_BYTES].decode("utf-8", "replace")
        with contextlib.suppress(ValueError, KeyError, TypeError):
            text = json.loads(text)["error"]["message"]  # an OpenAI error body: its message
        message = f"the upstream answered {response.status_code}: {self.quote(text)}"
        return UpstreamFailure("status", message, response.status_code)

    def quote(self, text: object) -> str:
        """The start of an upstream's text for an error message, without the API key or any piece of
        it long enough to matter: scrubbed, then cut (a cut first could leave a piece of the key too
        short to be recognised as one)."""
        text = str(text)[:_ERROR_BODY_BYTES]
        return (redact_pieces(text, self._key, "[redacted]") if self._key else text).strip()[:_QUOTED_CHARS]


async def _close(response: httpx.Response | None) -> None:
    if response is not None:
        await response.aclose()


class _ToolCallText:
    """An upstream's streamed tool calls (OpenAI's `delta.tool_calls`) as the text the device's own
    model writes for them (chat.tool_call_frame), so that the one parser (openai/tool_parser.py) turns
    both into the answer's `tool_calls`, streamed or whole: a fallback answer to a tool-calling
    request is still a tool call. The calls get this agent's ids, as the device's own do."""

    def __init__(self) -> None:
        self._open: int | None = None  # the index of the call being written
        self._arguments = False  # it has some

    def text(self, content: str, calls: Sequence[dict[str, Any]], *, final: bool) -> str:
        """The text for one delta's content and tool-call fragments; `final` closes an open call."""
        out = self._close() + content if content else ""
        for call in calls:
            function = call.get("function") or {}
            index = int(call.get("index", 0))
            if index != self._open:
                out += self._close() + tool_call_frame(str(function.get("name") or ""))[0]
                self._open = index
            arguments = str(function.get("arguments") or "")
            self._arguments = self._arguments or bool(arguments.strip())
            out += arguments
        return out + (self._close() if final else "")

    def _close(self) -> str:
        if self._open is None:
            return ""
        text = ("" if self._arguments else "{}") + tool_call_frame("")[1]
        self._open, self._arguments = None, False
        return text


def _logprobs(kind: Literal["chat", "completion"], data: Any) -> list[TokenLogprobs]:
    """The tokens a chunk's `logprobs` lists (chat's or completions' form) in this agent's terms; the
    ids are no ids of ours (UPSTREAM_TOKEN)."""
    if not data:
        return []
    if kind == "chat":
        return [
            TokenLogprobs(_logprob(e), tuple(_logprob(t) for t in e.get("top_logprobs") or ()))
            for e in data.get("content") or ()
        ]
    tops = data.get("top_logprobs") or []
    return [
        TokenLogprobs(
            Logprob(UPSTREAM_TOKEN, str(token).encode(), float(value)),
            tuple(
                Logprob(UPSTREAM_TOKEN, t.encode(), float(v))
                for t, v in (tops[i] if i < len(tops) else {}).items()
            ),
        )
        for i, (token, value) in enumerate(zip(data["tokens"], data["token_logprobs"], strict=True))
    ]


def _logprob(entry: dict[str, Any]) -> Logprob:
    raw = entry.get("bytes")
    token = bytes(raw) if raw is not None else str(entry["token"]).encode()
    return Logprob(UPSTREAM_TOKEN, token, float(entry["logprob"]))


class _Limits:
    """The request's own max_tokens and stop strings, applied to an upstream's events as the device's
    engines apply them to theirs (engines/textstream.token_events): text that may begin a stop
    string is held back, the answer ends before a stop string with "stop" and at max_tokens tokens
    (or their worth of text, _TOKEN_CHARS each) with "length". A well-behaved upstream stops there
    too, and its usage still comes; one that sends another token `overran`: it is not read further."""

    def __init__(self, max_tokens: int, stop: Sequence[str]) -> None:
        self._tokens_left = max_tokens
        self._chars_left = max_tokens * _TOKEN_CHARS
        self._stopper = StopMatcher(stop)
        self.finished = False  # the answer has its finish reason: whatever follows is dropped
        self.overran = False  # a token came after it: the upstream ignores the limits
        self.tokens = 0

    def apply(self, events: list[TokenEvent]) -> list[TokenEvent]:
        """`events` up to the one that finishes the answer, their text through the stop strings and
        the budget, with the finish reason a limit gives."""
        out: list[TokenEvent] = []
        for event in events:
            if self.finished:
                self.overran = self.overran or event.token_id is not None or bool(event.text)
                break
            out.append(self._one(event))
        return out

    def _one(self, event: TokenEvent) -> TokenEvent:
        text, stopped = self._stopper.feed(event.text)
        finish = "stop" if stopped else event.finish_reason
        if event.token_id is not None:
            self.tokens += 1
            self._tokens_left -= 1
            if self._tokens_left <= 0 and not stopped:
                finish = "length"
        if finish is not None and not stopped:
            text += self._stopper.flush()  # the end: what was held back never completed a stop
        if len(text) > self._chars_left:
            text, finish = text[: self._chars_left], "length"
        self._chars_left -= len(text)
        self.finished = finish is not None
        return dataclasses.replace(event, text=text, finish_reason=finish)

    def rest(self) -> str:
        """What is still held back when the upstream's stream ends without a finish reason."""
        return self._stopper.flush()[: self._chars_left]


async def _lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of an SSE body (ended by CRLF, LF or CR) as text; UpstreamFailure("malformed") for a
    line longer than _MAX_LINE_BYTES or a body past _MAX_BODY_BYTES, before either is held in memory."""
    buffer = bytearray()
    total = 0
    async for chunk in chunks:
        total += len(chunk)
        if total > _MAX_BODY_BYTES:
            raise UpstreamFailure("malformed", f"the upstream's stream passed {_MAX_BODY_BYTES} bytes")
        buffer += chunk
        start = 0
        while (end := _EOL.search(buffer, start)) is not None:
            if end.group() == b"\r" and end.end() == len(buffer):
                break  # maybe the first half of a CRLF
            yield buffer[start : end.start()].decode("utf-8", "replace")
            start = end.end()
        del buffer[:start]
        if len(buffer) > _MAX_LINE_BYTES:
            raise UpstreamFailure(
                "malformed", f"the upstream sent a line longer than {_MAX_LINE_BYTES} bytes"
            )
    if buffer:
        yield buffer.rstrip(b"\r").decode("utf-8", "replace")


_EOL = re.compile(rb"\r\n|\r|\n")


class UpstreamGeneration:
    """An upstream answer as a Generation: its SSE chunks as token events, within the request's
    limits."""

    def __init__(
        self,
        response: httpx.Response,
        kind: Literal["chat", "completion"],
        quote: Callable[[object], str],
        model: str,
        limits: _Limits,
        token_timeout_s: float,
    ) -> None:
        self._response = response
        self._kind = kind
        self._quote = quote
        self._lines = _lines(response.aiter_raw())
        self._limits = limits
        self._token_timeout_s = token_timeout_s
        self._head: list[TokenEvent] = []
        self._calls = _ToolCallText()
        self._usage: tuple[int, int] | None = None
        self._finished = False  # a chunk with a finish_reason came
        self._done = False
        self._cancelled = False
        self.model = model  # what the upstream calls itself in its chunks, once it has said
        self.latency_s = 0.0
        self.started: Started

    def served(self, reason: str, detail: str) -> None:
        """Set `started` once the fallback has decided to answer with this generation (the prompt's
        length is known only from the upstream's usage, at the end)."""
        info = EngineInfo("upstream", self.model, "", "", "", "remote", 0)
        self.started = Started(info, 0, ServedBy("upstream", reason, detail, self.model))

    async def prime(self) -> None:
        """Read up to the first token (or the end); raises UpstreamFailure("malformed") for anything
        that is not an OpenAI stream, and UpstreamFailure("status") for an error event."""
        while not self._head and not self._done:
            self._head = await self._next()

    async def _next(self) -> list[TokenEvent]:
        """The next chunk's token events (none for a chunk without a token), within the limits; sets
        _done at the end."""
        while True:
            try:
                line = await self._lines.__anext__()
            except StopAsyncIteration:
                if self._finished:  # some servers close after the last chunk without [DONE]
                    self._done = True
                    return []
                raise UpstreamFailure("malformed", "the upstream's stream ended without [DONE]") from None
            if not line.startswith("data:"):
                continue  # blank lines between events, comments (":"), event names
            data = line[5:].strip()
            if data == "[DONE]":
                self._done = True
                rest = "" if self._limits.finished else self._limits.rest()
                return [TokenEvent(None, rest)] if rest else []
            events = self._limits.apply(self._parse(data))
            self._done = self._limits.overran  # the answer is complete: the rest is not read
            return events

    def _parse(self, data: str) -> list[TokenEvent]:
        try:
            chunk = json.loads(data)
        except ValueError:
            raise UpstreamFailure("malformed", "the upstream sent an event that is not JSON") from None
        if not isinstance(chunk, dict):
            raise UpstreamFailure("malformed", "the upstream sent an event that is not a JSON object")
        if "error" in chunk:
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise UpstreamFailure("status", f"the upstream failed: {self._quote(message)}")
        try:
            self.model = str(chunk.get("model") or self.model)
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                self._usage = (int(usage["prompt_tokens"]), int(usage["completion_tokens"]))
            choices = chunk["choices"]
            if not choices:
                return []
            choice = choices[0]
            finish = choice.get("finish_reason")
            if self._kind == "chat":
                delta = choice["delta"]
                content = str(delta.get("content") or "")
                text = self._calls.text(content, delta.get("tool_calls") or (), final=finish is not None)
            else:
                text = str(choice["text"] or "")
            logprobs = _logprobs(self._kind, choice.get("logprobs"))
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            raise UpstreamFailure("malformed", "the upstream sent a chunk not shaped like OpenAI's") from None
        self._finished = self._finished or finish is not None
        if not text and finish is None and not logprobs:
            return []  # the role chunk
        # One event per token the chunk's logprobs list (a chunk may hold several): the chunk's text
        # on the first, its finish reason on the last.
        events = [TokenEvent(UPSTREAM_TOKEN, "", None, lp) for lp in logprobs]
        events = events or [TokenEvent(UPSTREAM_TOKEN if text else None, "")]
        events[0] = dataclasses.replace(events[0], text=text)
        events[-1] = dataclasses.replace(events[-1], finish_reason=finish)
        return events

    async def events(self) -> AsyncIterator[TokenEvent]:
        """See Generation.events; an upstream failing mid-answer ends it with ApiError 502."""
        try:
            for head in self._head:
                yield head
            self._head = []
            while not self._done:
                try:
                    events = await self._next_token()
                except (UpstreamFailure, httpx.HTTPError, httpx.StreamError) as exc:
                    if self._cancelled:
                        raise Cancelled() from None
                    if self._limits.finished:
                        return  # the answer is complete: only its usage is missing
                    detail = (
                        exc.message
                        if isinstance(exc, UpstreamFailure)
                        else f"connection failed: {self._quote(exc)}"
                    )
                    message = f"the upstream failed mid-answer: {detail}"
                    raise ApiError(502, message, type_="server_error", code="upstream_error") from None
                for event in events:
                    yield event
        finally:
            await self._response.aclose()

    async def _next_token(self) -> list[TokenEvent]:
        """The next events that hold a token (or the end), within `read_timeout_s`: bytes that
        carry none (comments, tokenless chunks) do not restart the clock."""
        try:
            async with asyncio.timeout(self._token_timeout_s):
                events: list[TokenEvent] = []
                while not events and not self._done:
                    events = await self._next()
                return events
        except TimeoutError:
            raise UpstreamFailure(
                "timeout", f"the upstream sent no token for {self._token_timeout_s:g} s"
            ) from None

    def usage(self) -> tuple[int, int] | None:
        """See Metered. An answer the upstream overran counts the tokens passed on, not those the
        upstream says it made (its own count, if it came, is of more)."""
        if self._limits.overran:
            return None if self._usage is None else (self._usage[0], self._limits.tokens)
        return self._usage

    def cancel(self) -> None:
        """See Generation.cancel: drop the connection (the upstream stops generating)."""
        self._cancelled = True
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(self._response.aclose())
