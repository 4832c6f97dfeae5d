"""Per-request logit processing, the same for both engines: logit_bias, the presence, frequency and
repetition penalties, a grammar the output must match (constrained decoding), and log-probabilities.

It works on one numpy row of logits per step: llama.cpp hands its logits to a processor as numpy
anyway, and the torch engine copies out only the rows of requests that need processing (the rest
keep the on-device sampler). The token is then picked by the engine's own sampler from the row
returned here, so temperature, top-p and seeds behave as without processing.

Grammars run on llguidance (the Rust library behind OpenAI-style structured output in vLLM, SGLang
and llama.cpp): it compiles JSON schemas and Lark grammars lazily (no per-schema index to build up
front), computes a token mask in well under a millisecond for a 49k vocabulary, and reads both
engines' tokenizers (tokenizer.json for torch, the GGUF's vocabulary through llama.cpp), so the
two engines enforce the same grammar the same way.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
from llguidance import LLMatcher, LLTokenizer

from deployer.agent.types import Logprob, SamplingParams, TokenLogprobs
from deployer.errors import AgentError, GrammarError

__all__ = ["TokenProcessor", "Vocabulary"]

_COMPILED_GRAMMARS = 16  # per model: requests repeating a schema skip compiling it


class Vocabulary:
    """A model's tokens as llguidance sees them, built on first use (0.3 s for 49k tokens), and the
    grammars compiled against them."""

    def __init__(self, build: Callable[[], LLTokenizer], n_logits: int) -> None:
        """`build` makes the LLTokenizer (its end-of-generation ids are those the engine stops on);
        `n_logits` is the length of the model's logit rows."""
        self._build = build
        self.n_logits = n_logits
        self._tokenizer: LLTokenizer | None = None
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> LLTokenizer:
        """The llguidance tokenizer (built now if it was not yet)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._build()
            return self._tokenizer

    def piece(self, token_id: int) -> bytes:
        """The bytes of one token (b"" for ids past the tokenizer's, such as padding rows)."""
        tokenizer = self.tokenizer
        return tokenizer.decode_bytes([token_id]) if token_id < tokenizer.vocab_size else b""

    def matcher(self, grammar: str) -> LLMatcher:
        """A fresh matcher for `grammar`; AgentError when llguidance refuses the grammar."""
        tokenizer = self.tokenizer
        with self._lock:
            compiled = self._compiled.pop(grammar, None)
        if compiled is None:
            compiled = LLMatcher(tokenizer, grammar, log_level=0)
            if compiled.is_error():
                raise AgentError(f"the grammar cannot be used: {compiled.get_error()}")
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > _COMPILED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()


class TokenProcessor:
    """One sequence's logit processing: `process` each step's logits, then `accept` the token the
    engine picked from them."""

    def __init__(self, params: SamplingParams, vocab: Vocabulary) -> None:
        """Raises AgentError for a logit_bias id outside the vocabulary or a refused grammar."""
        self._params = params
        self._vocab = vocab
        n = vocab.n_logits
        bad = [i for i, _ in params.logit_bias if not 0 <= i < n]
        if bad:
            shown = ", ".join(map(str, bad[:8])) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
            raise AgentError(
                f"logit_bias names token ids outside the vocabulary (0..{n - 1}): {shown}",
                param="logit_bias",
            )
        self._bias_ids = np.array([i for i, _ in params.logit_bias], dtype=np.int64)
        self._bias = np.array([b for _, b in params.logit_bias], dtype=np.float32)
        self._seen: dict[int, int] = {}  # generated token id -> how often
        self._matcher = vocab.matcher(params.grammar) if params.grammar is not None else None
        words = (vocab.tokenizer.vocab_size + 31) // 32 if self._matcher is not None else 0
        self._bitmask = np.zeros(words, dtype=np.int32)
        self._last: np.ndarray | None = None

    def process(self, logits: np.ndarray) -> np.ndarray:
        """The logits [V] after bias, penalties and grammar (a new float32 array).

        Raises GrammarError when the grammar allows no token here (the output could never match)."""
        x = np.array(logits, dtype=np.float32)
        if self._bias_ids.size:
            x[self._bias_ids] += self._bias
        if self._seen:
            self._penalise(x)
        if self._matcher is not None:
            self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
            # A matcher in error allows only the end of text: picking it would end with "stop" on
            # output that does not match (a schema with a value no text can be, a $ref cycle).
            if self._matcher.is_error():
                raise self._refused("allows no token here")
            allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little").view(bool)
            x[: allowed.size][~allowed[: x.size]] = -np.inf
            x[allowed.size :] = -np.inf  # logit rows past the tokenizer's ids (padding)
            if not np.isfinite(x).any():  # nothing left to sample (a sampler would draw from NaNs)
                raise self._refused("allows none of the model's tokens here")
        if self._params.logprobs is not None:
            self._last = x
        return x

    def _penalise(self, x: np.ndarray) -> None:
        p = self._params
        ids = np.fromiter(self._seen, dtype=np.int64, count=len(self._seen))
        counts = np.fromiter(self._seen.values(), dtype=np.float32, count=len(self._seen))
        values = x[ids]
        if p.repeat_penalty != 1.0:
            values = np.where(values > 0, values / p.repeat_penalty, values * p.repeat_penalty)
        x[ids] = values - p.frequency_penalty * counts - p.presence_penalty

    def accept(self, token: int) -> TokenLogprobs | None:
        """Record the picked token; its log-probabilities when they were asked for.

        Raises GrammarError when the grammar refuses the token (a sampler that ignored the
        processed logits picked it, or llguidance found the dead end only on consuming it)."""
        logprobs = self._logprobs(token) if self._last is not None else None
        self._last = None
        if self._matcher is not None and not self._matcher.consume_token(token):
            raise self._refused(f"refused token {token}")
        self._seen[token] = self._seen.get(token, 0) + 1
        return logprobs

    def _refused(self, what: str) -> GrammarError:
        assert self._matcher is not None
        # llguidance's message: its first line says why; the rest is a dump of its parser state.
        why = (self._matcher.get_error() or "").strip().splitlines()
        return GrammarError(
            f"the grammar {what} after {sum(self._seen.values())} generated tokens"
            + (f" ({why[0]})" if why else ""),
            hint="a value the schema allows no text for (e.g. a $ref to itself) leaves nothing to "
            "write; fix that part of response_format or the tool's parameters",
        )

    def _logprobs(self, token: int) -> TokenLogprobs:
        x = self._last
        assert x is not None and self._params.logprobs is not None
        finite = np.isfinite(x)
        peak = float(x[finite].max()) if finite.any() else 0.0
        log_z = peak + float(np.log(np.exp(x[finite] - peak).sum()))
        k = min(self._params.logprobs, int(finite.sum()))
        top = np.argpartition(-x, k - 1)[:k] if k else np.zeros(0, dtype=np.int64)
        top = top[np.argsort(-x[top], kind="stable")]
        return TokenLogprobs(
            chosen=self._entry(token, float(x[token]) - log_z),
            top=tuple(self._entry(int(i), float(x[i]) - log_z) for i in top),
        )

    def _entry(self, token: int, logprob: float) -> Logprob:
        # A token the grammar forbade has -inf; JSON has no infinity, OpenAI reports -9999 there.
        return Logprob(token, self._vocab.piece(token), logprob if np.isfinite(logprob) else -9999.0)
