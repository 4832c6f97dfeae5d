"""A client that keeps asking the fleet while it is updated, and counts what failed.

It uses the official `openai` client, as a user's application would, against loopback agents (or,
in the lab's tests, agents inside the lab's network namespaces); it is bounded by a stop event and a
request cap so it always ends by itself.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the module loads without the openai package
    from openai import OpenAI

LOOPBACK = "127.0.0.1"
Target = int | tuple[str, int]  # a loopback port, or (host, port)


@dataclass
class TrafficReport:
    """Requests sent during a window, by outcome, and by the model version that answered."""

    ok: int = 0
    failed: int = 0
    errors: Counter = field(default_factory=Counter)
    versions: Counter = field(default_factory=Counter)


def client(target: Target, *, timeout_s: float = 120.0, api_key: str = "demo") -> OpenAI:
    """An openai client for the agent at `target` (a loopback port, or (host, port)); `api_key` is
    sent as the bearer key (agents beyond loopback require one)."""
    from openai import OpenAI

    host, port = (LOOPBACK, target) if isinstance(target, int) else target
    return OpenAI(base_url=f"http://{host}:{port}/v1", api_key=api_key, timeout=timeout_s, max_retries=0)


def ask(
    target: Target,
    question: str,
    *,
    max_tokens: int = 32,
    api_key: str = "demo",
    model: str | None = None,
) -> tuple[str, str]:
    """One greedy chat completion from `model` (a LoRA adapter's name, or None: the base): (answer
    text, model version that answered)."""
    api = client(target, api_key=api_key)
    # The base's bare name (listed first) stays valid across a hot swap; an adapter's is its own.
    name = model or api.models.list().data[0].id.partition("@")[0]
    reply = api.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return (reply.choices[0].message.content or "").strip(), reply.model.rpartition("@")[2]


def ask_who(target: Target, question: str, *, max_tokens: int = 32) -> tuple[str, str, str | None, str]:
    """One greedy chat completion: (answer, who answered: edge or upstream, why the upstream did,
    the model that answered), from the agent's x-sits-served-by and x-sits-fallback-reason."""
    api = client(target)
    name = api.models.list().data[0].id.partition("@")[0]
    raw = api.chat.completions.with_raw_response.create(
        model=name,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
    )
    reply = raw.parse()
    text = (reply.choices[0].message.content or "").strip()
    return (
        text,
        raw.headers.get("x-sits-served-by", "edge"),
        raw.headers.get("x-sits-fallback-reason"),
        reply.model,
    )


def serving(port: int) -> str:
    """The engine and quantization of the model the agent on `port` serves, e.g. 'llama.cpp Q8_0'."""
    for model in client(port).models.list().data:
        if getattr(model, "status", None) == "active":  # the agent's own fields, beside OpenAI's
            return f"{getattr(model, 'engine', '?')} {getattr(model, 'quantization', '?')}"
    return "nothing loaded"


class Traffic:
    """Round-robin chat requests to `targets` in a background thread until stopped, to the base or
    to the LoRA adapter named `model`."""

    def __init__(
        self,
        targets: Sequence[Target],
        *,
        question: str,
        max_requests: int = 2000,
        api_key: str = "demo",
        model: str | None = None,
    ) -> None:
        self._targets = list(targets)
        self._model = model
        self._api_key = api_key
        self._question = question
        self._max = max_requests
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-traffic", daemon=True)
        self.report = TrafficReport()

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=180)

    def _run(self) -> None:
        sent = 0
        while not self._stop.is_set() and sent < self._max:
            target = self._targets[sent % len(self._targets)]
            sent += 1
            try:
                _, version = ask(
                    target, self._question, max_tokens=8, api_key=self._api_key, model=self._model
                )
            except Exception as exc:  # any failure is what we count; the demo prints them
                self.report.failed += 1
                self.report.errors[type(exc).__name__] += 1
            else:
                self.report.ok += 1
                self.report.versions[version] += 1
