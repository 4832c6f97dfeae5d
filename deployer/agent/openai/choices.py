"""A request's choices as their token events arrive, in OpenAI's shapes: text into content and
tool calls, logprobs into the chat or the completions form, and the response and chunk bodies.

The same `Choice` makes the streamed chunks and the whole answer, so the two always agree.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from deployer.agent.openai.tool_parser import ParsedCall, ToolCallParser
from deployer.agent.types import Logprob, TokenEvent, TokenLogprobs

__all__ = ["Choice", "Kind", "envelope"]

Kind = Literal["chat", "completion"]


def envelope(rid: str, kind: Kind, model: str, choices: list[dict], *, chunk: bool, **extra: Any) -> dict:
    """The body around choices: a chat completion (or its chunk) or a text completion."""
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if kind == "chat" else "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **extra,
    }


class Choice:
    """One choice: feed it events with `add`, end it with `close`, or take the whole `body`."""

    def __init__(
        self, index: int, kind: Kind, *, tools: set[str] | None, logprobs: bool, echo: str = ""
    ) -> None:
        """`tools`: the function names to parse calls of (None: all text is content); `echo`: text
        the answer starts with (the prompt, for /v1/completions `echo`)."""
        self.index = index
        self.kind = kind
        self._parser = ToolCallParser(tools) if tools else None
        self._logprobs = logprobs
        self._pending = echo  # text to send with the next chunk
        self.text = ""  # the content so far
        self.calls: list[ParsedCall] = []
        self._offset = len(echo)  # completions' text_offset of the next token

    def opening(self) -> dict:
        """The first stream choice of a chat answer: the role, before any token."""
        return {
            "index": self.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def add(self, event: TokenEvent) -> dict | None:
        """The stream choice for one event, or None when there is nothing to send yet."""
        text, calls = self._parse(event.text, final=False)
        return self._stream_choice(text, calls, [event.logprobs] if event.logprobs else [], None)

    def close(self, finish: str) -> dict:
        """The last stream choice: what was held back, and the finish reason."""
        text, calls = self._parse("", final=True)
        return self._stream_choice(text, calls, [], self.finish_reason(finish)) or {}

    def body(self, events: list[TokenEvent], finish: str) -> dict:
        """The non-streamed choice for all of its events."""
        for event in events:
            self._parse(event.text, final=False)
        self._parse("", final=True)
        finish = self.finish_reason(finish)
        logprobs = self._format([e.logprobs for e in events if e.logprobs]) if self._logprobs else None
        if self.kind == "completion":
            return {"index": self.index, "text": self.text, "logprobs": logprobs, "finish_reason": finish}
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.calls:
            message["content"] = self.text or None
            message["tool_calls"] = [_call(c) for c in self.calls]
        return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def finish_reason(self, finish: str) -> str:
        """OpenAI's reason: "tool_calls" when the answer ended in calls."""
        return "tool_calls" if self.calls and finish == "stop" else finish

    # -- helpers -----------------------------------------------------------------------------------

    def _parse(self, text: str, *, final: bool) -> tuple[str, list[ParsedCall]]:
        pending, self._pending = self._pending, ""
        if self._parser is None:
            content, calls = text, list[ParsedCall]()
        elif final:
            content, calls = self._parser.finish()
        else:
            content, calls = self._parser.feed(text)
        content = pending + content
        self.text += content
        self.calls += calls
        return content, calls

    def _stream_choice(
        self, text: str, calls: list[ParsedCall], logprobs: list[TokenLogprobs], finish: str | None
    ) -> dict | None:
        lp = self._format(logprobs) if self._logprobs and logprobs else None
        if self.kind == "completion":
            if not (text or lp or finish):
                return None
            return {"index": self.index, "text": text, "logprobs": lp, "finish_reason": finish}
        delta: dict[str, Any] = {}
        if text:
            delta["content"] = text
        if calls:
            first = len(self.calls) - len(calls)
            delta["tool_calls"] = [{"index": first + i, **_call(c)} for i, c in enumerate(calls)]
        if not (text or calls or lp or finish):
            return None
        return {"index": self.index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    def _format(self, entries: list[TokenLogprobs]) -> dict:
        if self.kind == "chat":
            return {
                "content": [
                    {**_chat_logprob(e.chosen), "top_logprobs": [_chat_logprob(t) for t in e.top]}
                    for e in entries
                ],
                "refusal": None,
            }
        offsets = []
        for e in entries:
            offsets.append(self._offset)
            self._offset += len(_text(e.chosen))
        return {
            "tokens": [_text(e.chosen) for e in entries],
            "token_logprobs": [e.chosen.logprob for e in entries],
            "top_logprobs": [{_text(t): t.logprob for t in e.top} for e in entries],
            "text_offset": offsets,
        }


def _text(entry: Logprob) -> str:
    return entry.token.decode("utf-8", errors="replace")


def _chat_logprob(entry: Logprob) -> dict:
    return {"token": _text(entry), "logprob": entry.logprob, "bytes": list(entry.token)}


def _call(call: ParsedCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
