"""Streaming generation on the tiny model: finish reasons, stop strings, EOS, seeds, limits."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deployer.agent.types import ChatMessage, SamplingParams
from deployer.errors import AgentError

GREEDY = SamplingParams(max_tokens=24, temperature=0)


def run(engine, prompt, params):
    events = list(engine.stream(prompt, params))
    return events, "".join(e.text for e in events)


@pytest.fixture
def prompt(tiny_engine):
    return tiny_engine.encode("The capital of")


def test_greedy_is_the_argmax_of_each_step(tiny_engine, prompt):
    events, _ = run(tiny_engine, prompt, GREEDY)
    ids = list(prompt)
    for event in events:
        assert event.token_id == int(tiny_engine.logits(ids)[-1].argmax())
        ids.append(event.token_id)


def test_max_tokens_ends_with_length_and_text_is_the_decoded_ids(tiny_engine, prompt):
    events, text = run(tiny_engine, prompt, SamplingParams(max_tokens=7, temperature=0.8, seed=3))
    assert len(events) == 7
    assert [e.finish_reason for e in events] == [None] * 6 + ["length"]
    assert text == tiny_engine.decode([e.token_id for e in events])


def test_seeded_sampling_is_repeatable(tiny_engine, prompt):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=42)
    first = [e.token_id for e in tiny_engine.stream(prompt, params)]
    second = [e.token_id for e in tiny_engine.stream(prompt, params)]
    other = [e.token_id for e in tiny_engine.stream(prompt, SamplingParams(max_tokens=16, seed=7))]
    assert first == second
    assert first != other


def test_stop_string_ends_generation_and_is_not_emitted(tiny_engine, prompt):
    _, full = run(tiny_engine, prompt, GREEDY)
    # a stop string that starts inside one token and ends inside the next
    stop = full[2:5]
    cut = full.find(stop)
    assert len(stop) == 3 and cut > 0
    events, text = run(tiny_engine, prompt, SamplingParams(max_tokens=24, temperature=0, stop=("zzz", stop)))
    assert text == full[:cut]
    assert events[-1].finish_reason == "stop"
    assert all(e.finish_reason is None for e in events[:-1])


def test_eos_token_stops_with_reason_stop_and_no_text(tiny_engine, prompt, monkeypatch):
    assert tiny_engine.encode("<|im_end|>")[0] in tiny_engine.end_ids  # from config/tokenizer_config
    forced = SamplingParams(max_tokens=5, temperature=0)
    first = next(iter(tiny_engine.stream(prompt, forced))).token_id
    attached = tiny_engine._require()
    forced_end = replace(attached.text, end_ids=frozenset({first}))  # the greedy first token ends it
    monkeypatch.setattr(tiny_engine, "_attached", replace(attached, text=forced_end))
    events, text = run(tiny_engine, prompt, forced)
    assert len(events) == 1 and events[0].finish_reason == "stop" and text == ""


def test_prompt_longer_than_the_context_is_refused(tiny_model_dir, engine_on):
    engine = engine_on(tiny_model_dir, max_context=16)
    with pytest.raises(AgentError, match="context holds 16"):
        engine.stream(list(range(5, 21)), GREEDY)
    events = list(engine.stream(list(range(5, 15)), GREEDY))
    # 10 prompt tokens in 16 positions leave room for 6
    assert len(events) == 6 and events[-1].finish_reason == "length"


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=0),
        SamplingParams(temperature=-1),
        SamplingParams(top_p=0),
        SamplingParams(temperature=float("nan")),
    ],
)
def test_bad_sampling_parameters_are_refused(tiny_engine, prompt, params):
    with pytest.raises(AgentError):
        tiny_engine.stream(prompt, params)


def test_second_concurrent_stream_is_refused_and_closing_releases(tiny_engine, prompt):
    first = tiny_engine.stream(prompt, GREEDY)
    next(first)
    with pytest.raises(AgentError, match="already generating"):
        next(tiny_engine.stream(prompt, GREEDY))
    first.close()  # a client that went away
    assert len(list(tiny_engine.stream(prompt, SamplingParams(max_tokens=2, temperature=0)))) == 2


def test_chat_prompt_and_warmup(tiny_engine):
    ids = tiny_engine.chat_prompt([ChatMessage("user", "Hello")])
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert tiny_engine.decode(ids) == f"system\n{system}\nuser\nHello\nassistant\n"
    tiny_engine.warmup()


def test_unload_frees_and_refuses_further_use(tiny_model_dir, engine_on):
    engine = engine_on(tiny_model_dir)
    engine.unload()
    with pytest.raises(AgentError, match="no model is loaded"):
        engine.encode("x")
