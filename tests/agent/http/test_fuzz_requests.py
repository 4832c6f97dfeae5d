"""Fuzzing the request schemas against a running agent on the tiny model: chat completions,
completions and embeddings bodies with random shapes and values in every field the schemas know
(and some they do not). Whatever comes in: never a 5xx, never a wait past the request deadline,
and a 400 always names the field (`param`) it refuses."""

from __future__ import annotations

import json
from http.client import HTTPConnection

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REQUEST_TIMEOUT_S = 20.0
JUNK = 12
FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Any JSON value (no NaN: a body with one is not JSON, refused before any field is read).
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


def field(*plausible: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: mostly plausible, so that a body gets past its first field to the later
    checks and to the engine; one time in JUNK any JSON at all."""
    return st.integers(1, JUNK).flatmap(lambda i: json_values if i == 1 else st.one_of(*plausible))


# Plausible values are mostly valid (the agent's max_tokens is 8); junk covers the rest.
budget = st.integers(1, 10)
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)  # lone surrogates: junk
schema_values = st.sampled_from(
    [
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        {"type": "array", "items": {"type": "integer", "minimum": 0}},
        {"type": "string", "pattern": "^[a-z]+$"},
        {"$ref": "#/$defs/x", "$defs": {"x": {"$ref": "#/$defs/x"}}},
        {"type": "objec"},
        {"enum": []},
    ]
)
message = st.fixed_dictionaries(
    {
        "role": field(st.sampled_from(["system", "developer", "user", "assistant", "tool"])),
        "content": field(texts),
    },
    optional={
        "name": field(texts),
        "tool_call_id": field(texts),
        "tool_calls": json_values,
    },
)
tool = st.fixed_dictionaries(
    {
        "type": field(st.just("function")),
        "function": field(
            st.fixed_dictionaries(
                {"name": field(st.from_regex(r"[a-z_]{1,8}", fullmatch=True))},
                optional={"parameters": field(schema_values), "description": texts, "strict": st.booleans()},
            )
        ),
    }
)
sampling = {
    "max_tokens": field(budget),
    "temperature": field(st.floats(0, 2)),
    "top_p": field(st.floats(0.01, 1)),
    "top_k": field(st.integers(0, 50)),
    "n": field(st.integers(1, 3)),
    "stop": field(texts, st.lists(texts, max_size=4)),
    "seed": field(st.integers(-(2**65), 2**65)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": field(st.booleans())})),
    "presence_penalty": field(st.floats(-2, 2)),
    "frequency_penalty": field(st.floats(-2, 2)),
    "repeat_penalty": field(st.floats(0.5, 2)),
    "logit_bias": field(st.dictionaries(st.integers(0, 500).map(str), st.floats(-100, 100), max_size=5)),
    "user": field(texts),
    "unknown_field": json_values,
}
chat_fields = {
    **sampling,
    "max_completion_tokens": field(budget),
    "logprobs": field(st.booleans()),
    "top_logprobs": field(st.integers(0, 5)),
    "tools": field(st.lists(tool, max_size=3)),
    "tool_choice": field(
        st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}])
    ),
    "parallel_tool_calls": field(st.booleans()),
    "response_format": field(
        st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "image"}]),
        st.builds(
            lambda s, strict: {
                "type": "json_schema",
                "json_schema": {"name": "r", "schema": s, "strict": strict},
            },
            schema_values,
            st.booleans(),
        ),
    ),
    "modalities": field(st.just(["text"])),
}
completion_fields = {
    **sampling,
    "logprobs": field(st.integers(0, 5)),
    "echo": field(st.booleans()),
    "suffix": field(texts),
    "best_of": field(st.integers(1, 3)),
}


def bodies(model: str) -> st.SearchStrategy[tuple[str, dict]]:
    """(path, body) for the three endpoints; the model name is usually right."""
    model_field = field(st.just(model), st.just(model), st.just(model), texts)
    chat = st.fixed_dictionaries(
        {"model": model_field, "messages": field(st.lists(message, min_size=0, max_size=3))},
        optional=chat_fields,
    )
    completion = st.fixed_dictionaries(
        {"model": model_field, "prompt": field(texts, st.lists(texts, max_size=2))},
        optional=completion_fields,
    )
    embedding = st.fixed_dictionaries(
        {"model": model_field, "input": field(texts, st.lists(texts, max_size=3))},
        optional={
            "encoding_format": field(st.sampled_from(["float", "base64"])),
            "dimensions": field(st.integers(1, 100)),
            "user": field(texts),
        },
    )
    return st.one_of(
        st.tuples(st.just("/v1/chat/completions"), chat),
        st.tuples(st.just("/v1/completions"), completion),
        st.tuples(st.just("/v1/embeddings"), embedding),
    )


@pytest.fixture
def agent(start_agent):
    return start_agent(max_tokens=8, request_timeout_s=REQUEST_TIMEOUT_S, max_concurrent=2)


def test_random_request_bodies_never_get_a_5xx_a_hang_or_an_unnamed_400(agent, model_name):
    @FUZZ
    @given(request=bodies(model_name))
    def check(request: tuple[str, dict]) -> None:
        path, body = request
        # A client that waits longer than the agent's own deadline: a hang shows as a timeout here.
        conn = HTTPConnection("127.0.0.1", agent.port, timeout=REQUEST_TIMEOUT_S + 10)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        assert response.status < 500, (response.status, data[:500])
        if response.status >= 400:
            error = json.loads(data)["error"]
            assert set(error) == {"message", "type", "param", "code"}
            if response.status == 400:
                assert isinstance(error["param"], str) and error["param"], error

    check()
