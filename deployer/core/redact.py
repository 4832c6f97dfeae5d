"""The one redaction path: secrets are registered where they are learned and replaced by a label
in everything shown or written for people: CLI output, errors, plan and audit files, log lines.

Two halves:

* `Secret` holds a value that is only ever handed to the code that needs it (a signing or SSH key
  passphrase, an API key): its str(), repr() and format() are its label, so it cannot leak
  through an f-string, an exception message or a dataclass repr; `reveal()` is the one way in.
* The registry of every secret value seen in this process (each `Secret`'s, and each value a
  `${VAR}` in deploy.yaml or the inventory took from the environment, since those end up as plain
  strings in the config: a host, a path, a label). `redact()` replaces them in any text, so a
  third party's error text that echoes one (paramiko naming the host it could not reach) is
  redacted too. The outputs call it: `redacting_stdio()` around a command, `redacted_json()` for
  JSON written to stdout or a file, `RedactingFilter` on a log handler.

`redact_pieces()` is for one secret in a third party's text that may hold only part of it (a
server echoing the request back, cut to length): every piece of MIN_FRAGMENT characters or more
goes, not just the whole value.

The registry is process-wide (threads that report on devices share it); `redaction_scope()`
restores it afterwards, so one command (or test) does not redact with another's values.
Standard library only: the device agent uses it too.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import json
import logging
import re
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any, TextIO

__all__ = [
    "RedactingFilter",
    "Secret",
    "redact",
    "redact_data",
    "redact_pieces",
    "redacted_json",
    "redacting_stdio",
    "redaction_scope",
    "register",
]

# Shorter values would be replaced inside unrelated words and numbers of a message.
MIN_REDACTED_LENGTH = 3
# A piece of a secret this long is worth hiding: 8 characters of a random key are ~48 bits of it.
MIN_FRAGMENT = 8

_lock = threading.Lock()
_labels: dict[str, str] = {}  # secret value -> the label shown instead
_ordered: list[tuple[str, str]] = []  # longest value first, so a value inside another goes second


def register(value: str, label: str) -> None:
    """Redact `value` as `label` from now on (values shorter than 3 characters are ignored)."""
    if len(value) < MIN_REDACTED_LENGTH:
        return
    with _lock:
        if _labels.get(value) == label:
            return
        _labels[value] = label
        _reorder()


def redact(text: str) -> str:
    """`text` with every registered secret value replaced by its label."""
    for value, label in _ordered:
        if value in text:
            text = text.replace(value, label)
    return text


def redact_pieces(text: str, secret: str, label: str) -> str:
    """`text` with every run of it made of pieces of `secret` (MIN_FRAGMENT characters or longer,
    so the whole secret, its head or tail cut off by a truncation, or a piece inside) replaced by
    `label`. Cut text after this, never before: a cut can split the secret into pieces that no
    longer match it whole. Costs up to len(text) × len(secret): callers bound the text first (to a
    few KiB, comfortably more than they show)."""
    if not secret:
        return text
    if len(secret) < MIN_FRAGMENT:
        return text.replace(secret, label)
    hidden = bytearray(len(text))  # 1 where a character belongs to a piece of the secret
    for piece in {secret[i : i + MIN_FRAGMENT] for i in range(len(secret) - MIN_FRAGMENT + 1)}:
        found = text.find(piece)
        while found >= 0:
            hidden[found : found + MIN_FRAGMENT] = b"\x01" * MIN_FRAGMENT
            found = text.find(piece, found + 1)
    if not any(hidden):
        return text
    out, last = [], 0
    for run in re.finditer(rb"\x01+", hidden):
        out += [text[last : run.start()], label]
        last = run.end()
    return "".join([*out, text[last:]])


def redact_data(data: Any) -> Any:
    """A copy of JSON-like `data` (dicts, lists, strings, numbers) with every string redacted,
    keys included."""
    if isinstance(data, str):
        return redact(data)
    if isinstance(data, Mapping):
        return {redact_data(k): redact_data(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [redact_data(v) for v in data]
    return data


def redacted_json(data: Any, **dumps_args: Any) -> str:
    """`json.dumps` of `data` redacted before it is encoded (JSON escapes could hide a secret from
    a later `redact` of the text); objects JSON cannot encode are written as their redacted str()."""
    return json.dumps(redact_data(data), default=lambda o: redact(str(o)), **dumps_args)


@contextlib.contextmanager
def redaction_scope() -> Iterator[None]:
    """Run a block whose registrations are forgotten when it ends (the outer ones stay)."""
    with _lock:
        saved = dict(_labels)
    try:
        yield
    finally:
        with _lock:
            _labels.clear()
            _labels.update(saved)
            _reorder()


def _reorder() -> None:
    global _ordered
    _ordered = sorted(_labels.items(), key=lambda item: -len(item[0]))


class Secret:
    """A value never shown: str(), repr() and format() give its label; `reveal()` gives the value.

    Creating one registers the value, so wherever the revealed value ends up in text (a library's
    error message), `redact` still replaces it.
    """

    __slots__ = ("_value", "label")

    def __init__(self, value: str, label: str = "<secret>") -> None:
        self._value = value
        self.label = label
        register(value, label)

    @classmethod
    def from_env(cls, name: str, environ: Mapping[str, str]) -> Secret | None:
        """The value of environment variable `name` as a Secret labelled after it; None if unset."""
        value = environ.get(name)
        return None if value is None else cls(value, f"<value from ${{{name}}}>")

    def reveal(self) -> str:
        """The value itself: only for the call that uses it."""
        return self._value

    def encode(self) -> bytes:
        """The value as UTF-8 bytes (what `cryptography` and paramiko take as a passphrase)."""
        return self._value.encode("utf-8")

    def __len__(self) -> int:
        return len(self._value)

    def __str__(self) -> str:
        return self.label

    def __repr__(self) -> str:
        return f"Secret({self.label!r})"

    def __format__(self, spec: str) -> str:
        return format(self.label, spec)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and hmac.compare_digest(self.encode(), other.encode())

    def __hash__(self) -> int:
        return hash(self._value)

    def __reduce__(self) -> Any:
        raise TypeError("a Secret is not serialized")


class RedactingFilter(logging.Filter):
    """A handler filter that redacts each record's message (its arguments merged in first)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message or record.args:
            record.msg, record.args = cleaned, None
        if record.exc_info and record.exc_info[1] is not None:
            # The formatter would print the exception's own text; keep its redacted rendering.
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True


class _RedactingWriter(io.TextIOBase):
    """A text stream that redacts what passes through it, a line at a time (a secret split across
    two write calls within a line is still caught); flush() passes on a partial line."""

    def __init__(self, inner: TextIO) -> None:
        self._inner = inner
        self._pending = ""

    def write(self, text: str) -> int:
        self._pending += text
        head, newline, self._pending = self._pending.rpartition("\n")
        if newline:
            self._inner.write(redact(head + newline))
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._inner.write(redact(self._pending))
            self._pending = ""
        self._inner.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._inner.isatty()

    def fileno(self) -> int:
        return self._inner.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._inner, "encoding", None) or "utf-8"

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return getattr(self._inner, "errors", None)


@contextlib.contextmanager
def redacting_stdio() -> Iterator[None]:
    """Redact everything written to sys.stdout and sys.stderr inside the block, in a fresh
    `redaction_scope`; the streams are flushed and put back at the end. Inside another such block
    it does nothing: the outer one's scope keeps what the inner block registers."""
    stdout, stderr = sys.stdout, sys.stderr
    if isinstance(stdout, _RedactingWriter) and isinstance(stderr, _RedactingWriter):
        yield
        return
    out, err = _RedactingWriter(stdout), _RedactingWriter(stderr)
    with redaction_scope():
        sys.stdout, sys.stderr = out, err
        try:
            yield
        finally:
            for stream in (out, err):
                with contextlib.suppress(ValueError, OSError):  # closed underneath us
                    stream.flush()
            sys.stdout, sys.stderr = stdout, stderr
