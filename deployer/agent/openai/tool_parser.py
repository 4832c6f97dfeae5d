"""Generated text into content and tool calls, as it streams: Hermes-format calls
(`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, the frame chat.py and constraints.py
use) become OpenAI `tool_calls`; everything else is content.

Text that may be the start of an opening tag is held back until it is known not to be one, and
whitespace next to calls is dropped, so a streamed answer is the same as the whole one. A call
whose JSON does not parse, or names no known tool, stays content (in `auto` nothing forces a
model to follow the format).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from deployer.agent.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

__all__ = ["ParsedCall", "ToolCallParser"]


@dataclass(frozen=True)
class ParsedCall:
    """One call in OpenAI's terms: `arguments` is JSON text."""

    id: str
    name: str
    arguments: str


class ToolCallParser:
    """Feed generated text; get back the content safe to send and the calls completed so far."""

    def __init__(self, names: set[str]) -> None:
        self._names = names
        self._buffer = ""  # text not yet classified
        self._inside = False  # after an opening tag
        self._space = ""  # whitespace held back: it is dropped if a call follows
        self.calls: list[ParsedCall] = []

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Add text; (content to send now, calls completed by it)."""
        self._buffer += text
        content, done = "", list[ParsedCall]()
        while True:
            if self._inside:
                end = self._buffer.find(TOOL_CALL_CLOSE)
                if end < 0:
                    return content, done
                body, self._buffer = self._buffer[:end], self._buffer[end + len(TOOL_CALL_CLOSE) :]
                self._inside = False
                call = self._call(body)
                if call is None:
                    content += self._content(TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE)
                else:
                    done.append(call)
                continue
            start = self._buffer.find(TOOL_CALL_OPEN)
            if start >= 0:
                content += self._content(self._buffer[:start])
                self._space = ""  # whitespace before a call is no content
                self._buffer = self._buffer[start + len(TOOL_CALL_OPEN) :]
                self._inside = True
                continue
            keep = _partial_suffix(self._buffer, TOOL_CALL_OPEN)
            ready, self._buffer = (
                self._buffer[: len(self._buffer) - keep],
                self._buffer[len(self._buffer) - keep :],
            )
            return content + self._content(ready), done

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The end of the text: what was held back (an unclosed call counts if its JSON is whole)."""
        rest, self._buffer = self._buffer, ""
        if self._inside:
            self._inside = False
            call = self._call(rest)
            if call is not None:
                return "", [call]
            rest = TOOL_CALL_OPEN + rest
        content = self._content(rest)
        if not self.calls:
            content += self._space
        self._space = ""
        return content, []

    def _content(self, text: str) -> str:
        """Content to send, its trailing whitespace held back (a call may follow it); once there
        are calls, whitespace next to them is dropped."""
        body = text.rstrip()
        if not body:
            self._space += text
            return ""
        lead = self._space
        if self.calls:
            lead, body = "", body.lstrip()
        self._space = text[len(text.rstrip()) :]
        return lead + body

    def _call(self, body: str) -> ParsedCall | None:
        try:
            data = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(data, dict) or data.get("name") not in self._names:
            return None
        arguments = data.get("arguments", data.get("parameters", {}))
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        call = ParsedCall(id=f"call_{secrets.token_hex(12)}", name=data["name"], arguments=text)
        self.calls.append(call)
        return call


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
