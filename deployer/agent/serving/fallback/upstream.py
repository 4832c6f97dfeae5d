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
error message is scrubbed of it first, since a broken upstream may echo the request back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Literal

import httpx

from deployer.agent.chat import tool_call_frame
from deployer.agent.openai.schemas import ApiError
from deployer.agent.serving.generate import Cancelled, ServedBy, Started
from deployer.agent.types import EngineInfo, Logprob, TokenEvent, TokenLogprobs

__all__ = ["UPSTREAM_TOKEN", "FailureKind", "UpstreamClient", "UpstreamFailure", "UpstreamGeneration"]

UPSTREAM_TOKEN = -1  # the token id of an upstream chunk: a token, but not one of our vocabulary
FailureKind = Literal["connect", "timeout", "status", "malformed", "open"]  # open: the breaker said no
_ERROR_BODY_BYTES = 2048  # how much of an upstream's error body is quoted


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
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/") + "/",
            headers=headers,
            timeout=httpx.Timeout(read_timeout_s, connect=first_token_timeout_s),
            follow_redirects=False,  # a redirect would carry the key elsewhere
        )

    async def aclose(self) -> None:
        """Close the pooled connections."""
        await self._http.aclose()

    async def open(self, kind: Literal["chat", "completion"], body: dict[str, Any]) -> UpstreamGeneration:
        """Send the request and wait for the first token (or the end of a tokenless answer).

        Raises UpstreamFailure when none comes within the first-token timeout, the upstream answers
        with an error status, or what it sends is not an OpenAI stream."""
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
                generation = UpstreamGeneration(response, kind, self.scrub, self.model)
                await generation.prime()
        except TimeoutError:
            await _close(response)
            raise UpstreamFailure(
                "timeout", f"the upstream sent no token within {self._first_token_s:g} s"
            ) from None
        except httpx.HTTPError as exc:
            await _close(response)
            raise UpstreamFailure("connect", self.scrub(f"cannot reach the upstream: {exc}")) from None
        except BaseException:
            await _close(response)
            raise
        generation.latency_s = time.monotonic() - began
        return generation

    async def _status_failure(self, response: httpx.Response) -> UpstreamFailure:
        raw = b""
        async for chunk in response.aiter_bytes():
            raw += chunk
            if len(raw) >= _ERROR_BODY_BYTES:
                break
        text = raw[:_ERROR_BODY_BYTES].decode("utf-8", "replace")
        with contextlib.suppress(ValueError, KeyError, TypeError):
            text = json.loads(text)["error"]["message"]  # an OpenAI error body: its message
        message = f"the upstream answered {response.status_code}: {str(text).strip()[:300]}"
        return UpstreamFailure("status", self.scrub(message), response.status_code)

    def scrub(self, text: str) -> str:
        """`text` without the API key in it."""
        return text.replace(self._key, "[redacted]") if self._key else text


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


class UpstreamGeneration:
    """An upstream answer as a Generation: its SSE chunks as token events."""

    def __init__(
        self,
        response: httpx.Response,
        kind: Literal["chat", "completion"],
        scrub: Callable[[str], str],
        model: str,
    ) -> None:
        self._response = response
        self._kind = kind
        self._scrub = scrub
        self._lines = response.aiter_lines()
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
        """The next chunk's token events (none for a chunk without a token); sets _done at the end."""
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
                return []
            return self._parse(data)

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
            raise UpstreamFailure("status", self._scrub(f"the upstream failed: {message}"))
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
                    events = await self._next()
                except (UpstreamFailure, httpx.HTTPError, httpx.StreamError) as exc:
                    if self._cancelled:
                        raise Cancelled() from None
                    detail = exc.message if isinstance(exc, UpstreamFailure) else f"connection failed: {exc}"
                    message = self._scrub(f"the upstream failed mid-answer: {detail}")
                    raise ApiError(502, message, type_="server_error", code="upstream_error") from None
                for event in events:
                    yield event
        finally:
            await self._response.aclose()

    def usage(self) -> tuple[int, int] | None:
        """See Metered."""
        return self._usage

    def cancel(self) -> None:
        """See Generation.cancel: drop the connection (the upstream stops generating)."""
        self._cancelled = True
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(self._response.aclose())
