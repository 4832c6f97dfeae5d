"""Incremental detokenization and stop strings (pure text logic), and the token sampler."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deployer.agent.chat import TextCodec
from deployer.agent.engines.textstream import REPLACEMENT, IncrementalDecoder, StopMatcher
from deployer.agent.engines.torch.sampling import new_generator, pick_token
from deployer.agent.types import SamplingParams


def test_multibyte_characters_are_never_split(tiny_model_dir):
    codec = TextCodec.from_dir(tiny_model_dir)
    text = "Paris é€ 😀 naïve 東京"
    ids = codec.encode(text, add_special_tokens=False)
    # the tiny BPE never saw these characters, so each is several byte-level tokens
    assert len(ids) > len(text)
    decoder = IncrementalDecoder(codec.decode)
    deltas = [decoder.push(i) for i in ids]
    assert not any(REPLACEMENT in d for d in deltas)
    assert "" in deltas  # some tokens completed no character
    assert "".join(deltas) + decoder.flush() == text


def test_flush_returns_an_incomplete_tail(tiny_model_dir):
    codec = TextCodec.from_dir(tiny_model_dir)
    ids = codec.encode("ok 😀", add_special_tokens=False)
    decoder = IncrementalDecoder(codec.decode)
    emitted = "".join(decoder.push(i) for i in ids[:-1])  # stop one byte short of the emoji
    assert emitted == "ok "
    assert decoder.flush() == codec.decode(ids[:-1])[len("ok ") :]


def _reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """Cut `text` before the stop string that completes first (longest among ties)."""
    ends = [(text.find(s) + len(s), -len(s)) for s in stops if s and s in text]
    if not ends:
        return text, False
    end, neg_len = min(ends)
    return text[: end + neg_len], True


def _stream(chunks: list[str], stops: list[str]) -> tuple[str, bool]:
    matcher, out = StopMatcher(stops), []
    for chunk in chunks:
        text, stopped = matcher.feed(chunk)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


@pytest.mark.parametrize(
    ("chunks", "stops", "expected"),
    [
        (["Hello wor", "ld. Bye"], ["world"], ("Hello ", True)),
        (["a", "b", "c", "d"], ["abcd", "bc"], ("a", True)),  # "bc" completes first
        (["ab", "x"], ["abc"], ("abx", False)),  # held back, then released
        (["abc"], [""], ("abc", False)),  # empty stop strings are ignored
        (["x</s", ">y"], ["</s>"], ("x", True)),
    ],
)
def test_stop_matcher_cases(chunks, stops, expected):
    assert _stream(chunks, stops) == expected


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab c", max_size=30),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=8),
)
def test_stop_matcher_is_independent_of_chunking(text, stops, cuts):
    points = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in itertools.pairwise(points)]
    assert _stream(chunks, stops) == _reference(text, stops)


def test_greedy_and_tiny_top_p_pick_the_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert pick_token(logits, SamplingParams(temperature=0), new_generator(0)) == 1
    # top_p so small only the most likely token survives
    for seed in range(20):
        assert pick_token(logits, SamplingParams(temperature=1.0, top_p=0.01), new_generator(seed)) == 1


def test_top_p_never_picks_outside_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    picks = {
        pick_token(logits, SamplingParams(temperature=1.0, top_p=0.7), new_generator(seed))
        for seed in range(200)
    }
    assert picks == {0, 1}  # 0.5 + 0.3 reach 0.7; 0.15 and 0.05 are cut


def test_same_seed_same_draws_and_temperature_flattens():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    params = SamplingParams(temperature=5.0, seed=11)
    gen_a, gen_b = new_generator(11), new_generator(11)
    a = [pick_token(logits, params, gen_a) for _ in range(50)]
    b = [pick_token(logits, params, gen_b) for _ in range(50)]
    assert a == b
    assert len(set(a)) >= 3  # a hot temperature reaches unlikely tokens


def test_top_k_keeps_only_the_k_most_likely():
    logits = torch.tensor([1.0, 4.0, 3.0, 0.0, 3.5])
    picks = {
        pick_token(logits, SamplingParams(temperature=2.0, top_k=2), new_generator(s)) for s in range(200)
    }
    assert picks == {1, 4}
    # top-p inside the top k: 0.6 of the renormalised top 3 is reached by the first two
    both = SamplingParams(temperature=1.0, top_k=3, top_p=0.6)
    assert {
        pick_token(torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1])), both, new_generator(s)) for s in range(200)
    } == {0, 1}


def test_a_nucleus_wider_than_the_candidates_is_still_exact():
    # 1800 equally likely tokens make up 0.9 of the mass: more than the 1024 topk candidates
    logits = torch.full((2000,), -30.0)
    logits[:1800] = 0.0
    gen = new_generator(0)
    picks = [pick_token(logits, SamplingParams(temperature=1.0, top_p=0.9), gen) for _ in range(3000)]
    assert max(picks) < 1800
    assert len(set(picks)) > 1024
