"""From generated token ids to streamed text: incremental detokenization and stop strings.

Engine-neutral (no torch): any engine that yields token ids one at a time can use it.

* `IncrementalDecoder` emits a token's text only once it decodes to whole characters, so a
  multi-byte character split over several tokens is never sent as a replacement character;
  concatenating every delta plus `flush()` equals decoding all ids at once.
* `StopMatcher` holds back text that might be the start of a stop string, cuts the output
  before the first stop string to complete, and never emits any part of it.
* `token_events` puts both to work on a stream of token ids and decides how generation ends.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence

from deployer.agent.types import TokenEvent, TokenLogprobs

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Turn ids into text deltas, one id at a time.

    Decodes a short window of recent ids rather than the whole sequence, so each step costs
    O(window); the window restarts after every emitted delta (the approach of HF's TextStreamer
    and vLLM's detokenizer, which also keeps word-boundary spaces right).
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # ids before this are fully emitted and no longer decoded
        self._read = 0  # ids before this have their text emitted

    def push(self, token_id: int) -> str:
        """Add one id; return the new complete text (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) > len(prefix_text) and not text.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text) :]


class StopMatcher:
    """Watch streamed text for stop strings."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""  # received but not yet released: could begin a stop string

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was reached).

        After a stop the matcher is done: the text returned ends just before the stop string.
        """
        self._pending += delta
        # The stop that completes first wins (the longest of those ending together), so the
        # result does not depend on how the text was split into deltas.
        hits = [(i + len(s), i) for s in self._stops if (i := self._pending.find(s)) >= 0]
        if hits:
            out, self._pending = self._pending[: min(hits)[1]], ""
            return out, True
        keep = self._held_back()
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        """The held-back text at the end of generation (it never completed a stop string)."""
        out, self._pending = self._pending, ""
        return out

    def _held_back(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of a stop."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:k]):
                    longest = k
                    break
        return longest


def final_text(decoder: IncrementalDecoder, stopper: StopMatcher) -> str:
    """Everything still held back when generation ends (EOS or length): the decoder's tail,
    passed through the stop matcher, then the matcher's own held-back text."""
    text, stopped = stopper.feed(decoder.flush())
    return text if stopped else text + stopper.flush()


def token_events(
    tokens: Iterable[int],
    decode: Callable[[list[int]], str],
    *,
    stops: Sequence[str],
    end_ids: Collection[int],
    budget: int,
    logprobs: Callable[[], TokenLogprobs | None] | None = None,
) -> Iterator[TokenEvent]:
    """Turn generated token ids into events: text deltas, the last one with its finish reason.

    An end-of-generation id or a completed stop string ends with "stop", the `budget`-th token
    with "length". Stops pulling from `tokens` as soon as it ends, so no token is computed in vain.
    `logprobs`, called after each token is pulled, gives that token's log-probabilities (an end id,
    which is no part of the text, gets none).
    """
    decoder, stopper = IncrementalDecoder(decode), StopMatcher(stops)
    for step, token in enumerate(tokens):
        if token in end_ids:
            yield TokenEvent(token, final_text(decoder, stopper), "stop")
            return
        lp = logprobs() if logprobs is not None else None
        text, stopped = stopper.feed(decoder.push(token))
        if stopped:
            yield TokenEvent(token, text, "stop", lp)
            return
        if step == budget - 1:
            yield TokenEvent(token, text + final_text(decoder, stopper), "length", lp)
            return
        yield TokenEvent(token, text, logprobs=lp)
