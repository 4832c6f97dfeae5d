"""The decoding controls of SamplingParams (grammar, logit_bias, penalties, logprobs), infill and
embeddings, on both engines: the tiny checkpoint in torch and as an fp32 GGUF in llama.cpp, which
compute the same logits, so they must pick the same tokens under the same controls."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
from llguidance import LLMatcher

from deployer.agent.engines import make_engine
from deployer.agent.openai.constraints import JSON_OPTIONS
from deployer.agent.types import ChatMessage, SamplingParams
from deployer.errors import AgentError
from tests.agent.engines.llamacpp.conftest import build_gguf, needs_llama_cpp

pytestmark = [
    needs_llama_cpp,
    # llguidance's llama.cpp vocabulary reader calls a function llama-cpp-python marks deprecated.
    pytest.mark.filterwarnings("ignore:llama_token_get_attr is deprecated:DeprecationWarning"),
]

SCHEMAS = [
    {"enum": ["red", "green", "blue"]},
    {"type": "boolean"},
    {"type": "integer", "minimum": -5, "maximum": 40},
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
        "required": ["ok", "level"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
]


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory):
    gguf = build_gguf(tiny_model_dir, tmp_path_factory.mktemp("fp32"), scheme="fp32")
    torch_engine = make_engine("torch", context_length=512, threads=1)
    torch_engine.load(tiny_model_dir)
    llama = make_engine("llama.cpp", context_length=512, threads=1)
    llama.load(gguf)
    return {"torch": torch_engine, "llama.cpp": llama}


def _generate(engine, **params):
    prompt = engine.chat_prompt([ChatMessage("user", "Answer in JSON.")])
    return list(engine.stream(prompt, SamplingParams(**{"max_tokens": 60, **params})))


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: s.get("type", "enum"))
def test_both_engines_write_json_that_validates_and_agree(engines, schema):
    grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    texts = {}
    for name, engine in engines.items():
        events = _generate(engine, temperature=0, grammar=grammar)
        texts[name] = "".join(e.text for e in events)
        assert events[-1].finish_reason == "stop", texts[name]
        jsonschema.validate(json.loads(texts[name]), schema)
    assert texts["torch"] == texts["llama.cpp"]


def test_sampled_grammar_output_validates(engines):
    schema = SCHEMAS[3]
    grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    for engine in engines.values():
        for seed in range(3):
            text = "".join(e.text for e in _generate(engine, temperature=1.0, seed=seed, grammar=grammar))
            jsonschema.validate(json.loads(text), schema)


def test_logprobs_agree_across_engines_and_rank_the_greedy_token_first(engines):
    runs = {name: _generate(e, temperature=0, logprobs=3, max_tokens=8) for name, e in engines.items()}
    for events in runs.values():
        for event in events:
            if event.logprobs is None:
                assert event.finish_reason == "stop"  # the end token has none
                continue
            assert event.logprobs.top[0].token_id == event.token_id == event.logprobs.chosen.token_id
            assert len(event.logprobs.top) == 3
            assert sum(math.exp(t.logprob) for t in event.logprobs.top) <= 1 + 1e-5
    pairs = zip(runs["torch"], runs["llama.cpp"], strict=True)
    for ours, theirs in pairs:
        assert ours.token_id == theirs.token_id
        if ours.logprobs:
            assert ours.logprobs.chosen.logprob == pytest.approx(theirs.logprobs.chosen.logprob, abs=1e-3)


def test_logit_bias_and_penalties_steer_both_engines(engines):
    for engine in engines.values():
        forced = engine.encode(" the")[-1]
        events = _generate(engine, temperature=0, max_tokens=5, logit_bias=((forced, 100.0),))
        assert [e.token_id for e in events] == [forced] * 5
        # With a big frequency penalty the forced token cannot win twice.
        events = _generate(
            engine, temperature=0, max_tokens=5, logit_bias=((forced, 10.0),), frequency_penalty=50.0
        )
        assert [e.token_id for e in events].count(forced) == 1


def test_embeddings_are_unit_vectors_and_agree(engines):
    # A long input (beyond the llama.cpp tokenizer context's 256 tokens, within a slot's 512) and
    # enough inputs for several pieces: each vector is the same as computed alone.
    texts = ["hello world", "edge devices", " ".join(["tiny models run at the edge"] * 25), "again"]
    found = {}
    for name, engine in engines.items():
        vectors, tokens = engine.embed(texts)
        assert tokens > 300 and len(vectors) == 4
        assert len(list(engine.embed_pieces(texts))) >= 2  # yields between pieces
        for text, v in zip(texts, vectors, strict=True):
            assert math.sqrt(sum(x * x for x in v)) == pytest.approx(1.0, abs=1e-4)
            assert engine.embed([text])[0][0] == pytest.approx(v, abs=1e-5)
        found[name] = vectors
    for ours, theirs in zip(found["torch"], found["llama.cpp"], strict=True):
        assert sum(a * b for a, b in zip(ours, theirs, strict=True)) > 0.999
    with pytest.raises(AgentError, match="empty"):
        engines["llama.cpp"].embed([""])


def test_infill_needs_fim_tokens(engines):
    for engine in engines.values():
        with pytest.raises(AgentError, match="fill-in-the-middle"):
            engine.infill_prompt("def f(", "):")
