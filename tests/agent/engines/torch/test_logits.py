"""The logit processing both engines share (engines/logits.py): bias, penalties, grammar masks and
logprobs, on the tiny checkpoint's real tokenizer and hand-made logit rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
from llguidance import LLMatcher, LLTokenizer

from deployer.agent.chat import TextCodec
from deployer.agent.engines.logits import TokenProcessor, Vocabulary
from deployer.agent.types import SamplingParams
from deployer.errors import AgentError, GrammarError
from tests.grammars import dead_end_grammar


@pytest.fixture(scope="module")
def vocab(tiny_model_dir):
    codec = TextCodec.from_dir(tiny_model_dir)
    size = codec.tokenizer.get_vocab_size()
    eos = codec.token_id("<|im_end|>")
    return Vocabulary(lambda: LLTokenizer(codec.to_json(), n_vocab=size, eos_token=[eos]), size)


def _row(vocab, seed=0):
    return np.random.default_rng(seed).normal(size=vocab.n_logits).astype(np.float32)


def test_logit_bias_adds_to_the_named_ids(vocab):
    row = _row(vocab)
    out = TokenProcessor(SamplingParams(logit_bias=((5, 3.0), (7, -100.0))), vocab).process(row)
    expected = row.copy()
    expected[5] += 3
    expected[7] -= 100
    np.testing.assert_array_equal(out, expected)


def test_penalties_count_generated_tokens(vocab):
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repeat_penalty=2.0)
    processor = TokenProcessor(params, vocab)
    row = np.zeros(vocab.n_logits, dtype=np.float32)
    row[[3, 4]] = [4.0, -4.0]
    np.testing.assert_array_equal(processor.process(row), row)  # nothing generated yet
    for token in (3, 3, 4):
        processor.process(row)
        processor.accept(token)
    out = processor.process(row)
    # token 3: positive logit divided by 2, then 2 occurrences; token 4: negative, multiplied.
    assert out[3] == pytest.approx(4.0 / 2 - 0.25 * 2 - 0.5)
    assert out[4] == pytest.approx(-4.0 * 2 - 0.25 * 1 - 0.5)
    untouched = np.delete(np.arange(vocab.n_logits), [3, 4])
    np.testing.assert_array_equal(out[untouched], row[untouched])


def test_a_grammar_masks_every_token_that_leaves_it(vocab):
    grammar = LLMatcher.grammar_from_json_schema({"enum": ["yes", "no"]})
    processor = TokenProcessor(SamplingParams(grammar=grammar), vocab)
    out = processor.process(_row(vocab))
    pieces = {vocab.piece(int(i)) for i in np.flatnonzero(np.isfinite(out))}
    assert b'"' in pieces
    assert pieces <= {b'"', b'"y', b'"n', b'"ye', b'"yes', b'"no', b'"yes"', b'"no"'}


def test_a_refused_token_and_a_broken_grammar_are_errors(vocab):
    grammar = LLMatcher.grammar_from_json_schema({"type": "integer"})
    processor = TokenProcessor(SamplingParams(grammar=grammar), vocab)
    processor.process(_row(vocab))
    letter = next(i for i in range(vocab.n_logits) if vocab.piece(i) == b"a")
    with pytest.raises(AgentError, match="the grammar refused"):
        processor.accept(letter)
    with pytest.raises(AgentError, match="grammar cannot be used"):
        TokenProcessor(SamplingParams(grammar=LLMatcher.grammar_from_lark("start: x")), vocab)
    with pytest.raises(AgentError, match="outside the vocabulary"):
        TokenProcessor(SamplingParams(logit_bias=((vocab.n_logits, 1.0),)), vocab)


def test_a_grammar_at_a_dead_end_is_an_error_not_an_end_of_text(vocab):
    processor = TokenProcessor(SamplingParams(grammar=dead_end_grammar()), vocab)
    written = b""
    with pytest.raises(GrammarError, match="allows no token here after 5 generated tokens"):
        while True:
            # The first token allowed, until the dead end (where a matcher in error allows just the
            # end of text, which would have ended the answer "stop" on `{"a":`).
            token = int(np.flatnonzero(np.isfinite(processor.process(_row(vocab))))[0])
            processor.accept(token)
            written += vocab.piece(token)
    assert written == b'{"a":'


def test_logprobs_are_normalised_and_ranked(vocab):
    processor = TokenProcessor(SamplingParams(logprobs=3), vocab)
    row = _row(vocab, seed=1)
    processor.process(row)
    chosen = int(np.argsort(row)[-2])  # the second most likely
    lp = processor.accept(chosen)
    log_z = math.log(np.exp(row.astype(np.float64)).sum())
    assert lp.chosen.token_id == chosen and lp.chosen.token == vocab.piece(chosen)
    assert lp.chosen.logprob == pytest.approx(float(row[chosen]) - log_z, abs=1e-4)
    assert [t.token_id for t in lp.top] == [int(i) for i in np.argsort(row)[::-1][:3]]
    assert lp.top[1] == lp.chosen
    assert processor.accept(0) is None  # only a processed step has logprobs
