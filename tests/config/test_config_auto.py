"""`model.quantization.scheme: auto` in deploy.yaml: it needs `max_size`, nothing else uses one, a
budget below its smallest choice is refused at the field with the minimum, it is for the torch
engine, and the memory estimate counts at most its budget."""

from __future__ import annotations

from deployer.config import validate_file
from deployer.config.estimate import SMOLLM2_SHAPE, auto_size_bounds, weight_bytes
from deployer.config.models import Quantization

LOW, HIGH = auto_size_bounds(SMOLLM2_SHAPE, Quantization(scheme="auto", max_size=1))


def _findings(write_config, quant: str, engine: str = "torch") -> list[tuple[str, int, int, str]]:
    path = write_config(
        replace=(("  version: 1.0.0\n", "  version: 1.0.0\n  quantization:\n" + quant),),
        append=f"agent:\n  engine: {engine}\n",
    )
    return [(f.path, f.line, f.column, f.message) for f in validate_file(path, environ={}) if f.is_error]


def test_auto_within_a_budget_passes(write_config):
    assert _findings(write_config, "    scheme: auto\n    max_size: 120M\n") == []


def test_a_budget_below_the_smallest_choice_is_refused_with_the_minimum(write_config):
    ((path, line, column, message),) = _findings(write_config, "    scheme: auto\n    max_size: 50M\n")
    assert (path, line, column) == ("model.quantization.max_size", 7, 15)
    assert f"max_size 50,000,000 bytes is below the smallest choice of scheme auto: {LOW:,} bytes" in message


def test_max_size_needs_auto_and_auto_needs_max_size(write_config):
    ((path, line, _, message),) = _findings(write_config, "    scheme: int4\n    max_size: 120M\n")
    assert (path, line, message) == (
        "model.quantization.max_size",
        7,
        "max_size is used only with scheme auto, not int4",
    )
    ((path, line, _, message),) = _findings(write_config, "    scheme: auto\n")
    assert (path, line) == ("model.quantization.scheme", 6)
    assert "scheme auto needs max_size" in message


def test_auto_is_for_the_torch_engine(write_config):
    findings = _findings(write_config, "    scheme: auto\n    max_size: 120M\n", engine="llama.cpp")
    assert [f[:2] for f in findings] == [("model.quantization.scheme", 6)]


def test_the_estimate_counts_the_budget_or_all_int8_when_that_is_less():
    assert LOW < 120_000_000 < HIGH
    assert weight_bytes(SMOLLM2_SHAPE, Quantization(scheme="auto", max_size=120_000_000)) == 120_000_000
    assert weight_bytes(SMOLLM2_SHAPE, Quantization(scheme="auto", max_size=10**12)) == HIGH
