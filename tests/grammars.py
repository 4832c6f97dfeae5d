"""A grammar that refuses mid-generation, deterministically, for the tests of what it does to its
own request and to the requests beside it."""

from __future__ import annotations

from llguidance import LLMatcher

# An object whose one required property has a value that is a $ref to itself: no JSON can be
# written there, but llguidance compiles it (and validates it) and finds the dead end only when
# the value is due, after the model has written `{"a":` over a few tokens.
DEAD_END_SCHEMA = {
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/never"}},
    "required": ["a"],
    "$defs": {"never": {"$ref": "#/$defs/never"}},
}


def dead_end_grammar() -> str:
    """DEAD_END_SCHEMA as an llguidance grammar without optional whitespace: the dead end comes
    after the same few tokens whatever the model prefers."""
    strict = {**DEAD_END_SCHEMA, "x-guidance": {"whitespace_flexible": False}}
    return LLMatcher.grammar_from_json_schema(strict)
