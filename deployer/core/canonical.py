"""Canonical JSON: the one byte form that is hashed and signed, and a strict parser for it.

`canonical_json` is RFC 8785 (the JSON Canonicalization Scheme, through the `rfc8785` package)
followed by a newline, the framing every file we write has always had. RFC 8785 writes numbers as
ECMAScript does, so it differs from the encoder used before (`legacy_canonical_json`, Python's
`json.dumps` with sorted keys) for some floats only: `1.0` is `1`, `1e-05` is `0.00001`, `1e+16`
is `10000000000000000`; integers, strings and objects come out the same. Release manifests of
format_version 1 were signed over the legacy bytes, so they are still verified over them.

`parse_json` refuses NaN and Infinity (and the names `NaN`, `Infinity`, `-Infinity` that Python's
parser accepts by default) with FormatError, before anything reads the values.
"""

from __future__ import annotations

import json
from typing import Any

import rfc8785

from deployer.errors import FormatError

__all__ = ["canonical_json", "legacy_canonical_json", "parse_json"]


def canonical_json(obj: Any) -> bytes:
    """RFC 8785 bytes of `obj` plus a newline. Raises FormatError for NaN, Infinity or an integer
    outside ±(2**53 - 1), which JSON numbers cannot carry exactly."""
    try:
        return rfc8785.dumps(obj) + b"\n"
    except rfc8785.CanonicalizationError as exc:
        raise FormatError(f"cannot write canonical JSON: {exc}") from exc


def legacy_canonical_json(obj: Any) -> bytes:
    """The form before RFC 8785 (sorted keys, no whitespace, UTF-8, newline): only to verify what
    was signed over it (release format_version 1)."""
    try:
        text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError as exc:
        raise FormatError(f"cannot write canonical JSON: {exc}") from exc
    return (text + "\n").encode("utf-8")


def parse_json(data: bytes, where: str) -> Any:
    """Parse UTF-8 JSON; NaN and ±Infinity are refused. Raises FormatError naming `where`."""
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_refuse_constant, parse_float=_finite)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise FormatError(f"{where}: not valid JSON ({exc})") from exc
    except FormatError as exc:  # from the number hooks below, which cannot know `where`
        raise FormatError(f"{where}: {exc.message}") from exc


def _refuse_constant(name: str) -> float:
    raise FormatError(f"JSON number {name} is not allowed (only finite numbers are)")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):  # e.g. 1e999 overflows to infinity
        raise FormatError(f"JSON number {text[:40]} is out of range (only finite numbers are)")
    return value
