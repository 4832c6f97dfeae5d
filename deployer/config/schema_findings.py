"""Pydantic validation errors turned into findings at the right line and column.

Pydantic reports an error ``loc`` such as ``("fleet", "devices", 2, "port")``; the source map
gives that field's position. Messages are rephrased for people: unknown fields get a
"did you mean" for near misses, literal choices get the closest valid value, numbers where text
is expected get a hint to quote them. A value that came from ``${VAR}`` is never echoed.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Mapping, Set
from typing import Any

from pydantic import BaseModel, ValidationError

from deployer.config.findings import FieldPath, Finding
from deployer.config.sourcemap import SourceMap


def validation_findings(
    exc: ValidationError,
    model: type[BaseModel],
    positions: SourceMap,
    sources: Mapping[FieldPath, str],
    unresolved: Set[FieldPath] = frozenset(),
) -> list[Finding]:
    """One finding per pydantic error of validating ``model``.

    ``sources`` labels values that came from ${VAR} (never echoed); errors at ``unresolved``
    fields, whose ${VAR} was not set, are left out: that is reported already.
    """
    return [
        _finding(error, model, positions, sources)
        for error in exc.errors()
        if tuple(error["loc"]) not in unresolved
    ]


def _finding(
    error: Any, model: type[BaseModel], positions: SourceMap, sources: Mapping[FieldPath, str]
) -> Finding:
    loc: FieldPath = tuple(error["loc"])
    at_key = bool(loc) and loc[-1] == "[key]"
    if at_key:
        loc = loc[:-1]
    kind, value = error["type"], error.get("input")
    shown = sources.get(loc) or repr(value)
    if kind == "extra_forbidden":
        return positions.finding(loc, f"unknown field '{loc[-1]}'", _field_hint(model, loc), key=True)
    if kind == "missing":
        return positions.finding(loc, f"missing required field '{loc[-1]}'")
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", error["ctx"]["expected"])
        hint = _did_you_mean(value, choices) if loc not in sources else None
        message = f"unknown value {shown}; expected {error['ctx']['expected']}"
        return positions.finding(loc, message, hint, key=at_key)
    message = str(error["msg"]).removeprefix("Value error, ")
    if kind.endswith("_type"):
        message = f"{message}, got {_type_name(value)}"
    hint = None
    if kind == "string_type" and isinstance(value, bool | int | float) and loc not in sources:
        hint = _semver_hint(value) if loc[-1] == "version" else f'quote it to make it text: "{value}"'
    return positions.finding(loc, message, hint, key=at_key)


def _semver_hint(value: Any) -> str:
    """`version: 1.0` reads as a number; the fix is a semantic version, not just quotes."""
    parts = [*str(value).split("."), "0", "0"][:3]
    return f"write a semantic version MAJOR.MINOR.PATCH, e.g. {'.'.join(parts)}"


def _type_name(value: Any) -> str:
    names = {dict: "a mapping", list: "a list", str: "text", bool: "a boolean", type(None): "null"}
    names |= {int: "a number", float: "a number"}
    return names.get(type(value), type(value).__name__)


def _did_you_mean(value: Any, choices: list[str]) -> str | None:
    if not isinstance(value, str):
        return None
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else None


def _field_hint(model: type[BaseModel], loc: FieldPath) -> str:
    allowed = _field_names(model, loc[:-1])
    guess = _did_you_mean(str(loc[-1]), allowed)
    if guess:
        return guess
    return "allowed here: " + ", ".join(allowed) if allowed else "remove it"


def _field_names(model: type[BaseModel], loc: FieldPath) -> list[str]:
    """The field names (as written in YAML) that the model at ``loc`` accepts."""
    target = _model_at(model, loc)
    if target is None:
        return []
    return sorted(info.alias or name for name, info in target.model_fields.items())


def _model_at(annotation: Any, loc: FieldPath) -> type[BaseModel] | None:
    annotation = _unwrap(annotation)
    is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
    if not loc:
        return annotation if is_model else None
    head, rest = loc[0], loc[1:]
    if is_model:
        for name, info in annotation.model_fields.items():
            if head in (name, info.alias):
                return _model_at(info.annotation, rest)
        return None
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list:
        return _model_at(args[0], rest)
    if origin is dict:
        return _model_at(args[1], rest)
    return None


def _unwrap(annotation: Any) -> Any:
    """Strip Annotated[...] and the None of Optional[...]: the type a value is checked against."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            members = [a for a in typing.get_args(annotation) if a is not type(None)]
            annotation = members[0]
        else:
            return annotation
