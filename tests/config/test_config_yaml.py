"""YAML loading with positions, and the unit-bearing values (quantities, durations, percentages)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from deployer.config.quantity import (
    format_bytes,
    format_duration,
    parse_cpu,
    parse_duration,
    parse_memory,
    parse_percent,
)
from deployer.config.yamlpos import MAX_NODES, load_yaml


def test_positions_of_keys_and_values():
    doc = load_yaml("a:\n  b: [x, {c: 1}]\n", "f.yaml")
    assert doc.data == {"a": {"b": ["x", {"c": 1}]}}
    key, _ = doc.positions.locate(("a", "b"), key=True)
    value, _ = doc.positions.locate(("a", "b", 1, "c"))
    assert (key.line, key.column) == (2, 3)
    assert (value.line, value.column) == (2, 14)


def test_missing_field_is_located_at_its_parent_key():
    doc = load_yaml("top:\n  inner: {x: 1}\n", "f.yaml")
    finding = doc.positions.finding(("top", "inner", "missing"), "gone")
    assert (finding.line, finding.column, finding.path) == (2, 3, "top.inner.missing")


def test_merge_keys_and_overrides_are_not_duplicates():
    doc = load_yaml("d: &d {a: 1, b: 2}\ne: {<<: *d, a: 5}\nf: *d\n", "f.yaml")
    assert doc.findings == []
    assert doc.data["e"] == {"a": 5, "b": 2}
    assert doc.data["f"] == {"a": 1, "b": 2}


def test_every_duplicate_key_is_reported():
    doc = load_yaml("a: 1\nb:\n  c: 1\n  c: 2\na: 3\n", "f.yaml")
    assert sorted((f.line, f.column, f.path) for f in doc.findings) == [(4, 3, "b.c"), (5, 1, "a")]


def test_every_tab_indented_line_is_reported():
    doc = load_yaml("a:\n\tb: 1\n  c:\n  \td: 2\n", "f.yaml")
    assert doc.data is None
    assert [(f.line, f.column) for f in doc.findings] == [(2, 1), (4, 3)]


@pytest.mark.parametrize(
    ("text", "line", "column", "message"),
    [
        ("a: &x 1\nb: &x 2\n", 2, 4, "duplicate anchor &x (first defined at line 1)"),
        ("a: 1\n---\nb: 2\n", 2, 1, "more than one YAML document"),
        ("a: !!python/object:os.system x\n", 1, 4, "unsupported YAML tag"),
        ("a: [1,\n", 2, 1, "invalid YAML"),
        ("? [k]\n: 1\n", 1, 3, "a mapping key must be a plain value"),
    ],
)
def test_malformed_yaml(text, line, column, message):
    doc = load_yaml(text, "f.yaml")
    assert doc.data is None
    (finding,) = doc.findings
    assert (finding.line, finding.column) == (line, column)
    assert message in finding.message


def test_alias_bomb_is_refused():
    lines = ["a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for prev, name in zip("abcde", "bcdef", strict=True):
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]")
    doc = load_yaml("\n".join(lines) + "\n", "f.yaml")
    assert doc.data is None
    assert str(MAX_NODES) in doc.findings[0].message


@pytest.mark.parametrize(
    ("text", "millicores"), [("4000m", 4000), ("4", 4000), ("0.5", 500), (2, 2000), ("1.5k", 1_500_000)]
)
def test_parse_cpu(text, millicores):
    assert parse_cpu(text) == millicores


@pytest.mark.parametrize(
    ("text", "size"),
    [("8Gi", 8 * 2**30), ("512Mi", 512 * 2**20), ("1G", 10**9), ("1e3", 1000), (1024, 1024)],
)
def test_parse_memory(text, size):
    assert parse_memory(text) == size


@pytest.mark.parametrize("bad", ["8GB", "Gi", "-1Gi", "1.5", "8 Gi", True, [1]])
def test_bad_memory_is_rejected(bad):
    with pytest.raises(ValueError, match="memory quantity"):
        parse_memory(bad)


@pytest.mark.parametrize(
    ("text", "seconds"), [("30s", 30), ("5m", 300), ("1h30m", 5400), ("30d", 2592000), (90, 90)]
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("seconds", [0, 0.25, 1, 59, 60, 61, 3600, 86400 * 30, 604800])
def test_duration_round_trips(seconds):
    value = timedelta(seconds=seconds)
    assert parse_duration(format_duration(value)) == value


@pytest.mark.parametrize("bad", ["30", "5 m", "1y", "", "m5"])
def test_bad_duration_is_rejected(bad):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(bad)


def test_percent_bounds():
    assert parse_percent("25%") == 25.0
    for bad in ("0%", "101%", "25", "x%"):
        with pytest.raises(ValueError, match="percentage"):
            parse_percent(bad)


def test_format_bytes():
    assert [format_bytes(n) for n in (5, 2048, 8 * 2**30)] == ["5 B", "2.0 KiB", "8.0 GiB"]
