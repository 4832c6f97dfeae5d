"""Measured mixed precision (`scheme: auto`): the greedy choice within the budget, the build's
manifest records it and the measurements, the build is byte-reproducible, and a budget below the
smallest choice is refused with the minimum, the same minimum validate reports."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from deployer.build import mixed
from deployer.build.awq import read_calibration
from deployer.build.pipeline import build_artifact
from deployer.build.source import open_source
from deployer.build.spec import AwqSpec, BuildRequest, QuantSpec
from deployer.config.estimate import ModelShape, auto_size_bounds
from deployer.config.models import Quantization
from deployer.core.memory import linear_bytes
from deployer.core.safetensors_io import DTYPE_SIZES
from deployer.errors import BuildError


def _bounds(source_dir: Path) -> tuple[int, int]:
    """(all int4-g128, all int8) stored bytes of the tiny model, as the build counts them."""
    source = open_source(source_dir)
    tied = source.tied_embeddings
    shapes = {t.name: t.entry.shape for t in source.tensors if not (tied and t.name == "lm_head.weight")}
    spec = QuantSpec("auto", max_size=1)
    modules = mixed.candidates(spec, shapes)
    fixed = mixed.fixed_bytes(spec, shapes, set(modules))
    costs = [[linear_bytes(s, g, *shapes[f"{m}.weight"]) for s, g, _ in mixed.CHOICES] for m in modules]
    return fixed + sum(c[0] for c in costs), fixed + sum(c[-1] for c in costs)


def _request(source: Path, store: Path, max_size: int, **kwargs) -> BuildRequest:
    return BuildRequest(source, "tiny", "1.0.0", QuantSpec("auto", max_size=max_size), store, **kwargs)


def test_greedy_takes_the_most_kl_per_byte_within_the_budget():
    sensitivity = {
        "a": {"int4-g128": 1.0, "int4-g32": 0.1, "int8": 0.0},  # g32 removes 0.9 for 10 bytes
        "b": {"int4-g128": 0.5, "int4-g32": 0.5, "int8": 0.0},  # only int8 helps: 0.5 for 30 bytes
        "c": {"int4-g128": 0.01, "int4-g32": 0.0, "int8": 0.0},
    }
    costs = {m: [100, 110, 130] for m in sensitivity}
    assert mixed.greedy(sensitivity, costs, 300) == ({"a": 0, "b": 0, "c": 0}, 300)
    assert mixed.greedy(sensitivity, costs, 310) == ({"a": 1, "b": 0, "c": 0}, 310)
    assert mixed.greedy(sensitivity, costs, 345) == ({"a": 1, "b": 2, "c": 0}, 340)
    # Everything fits: each module at its least sensitive choice, the cheapest among equals.
    assert mixed.greedy(sensitivity, costs, 10**6) == ({"a": 2, "b": 2, "c": 1}, 370)


def test_the_build_chooses_within_max_size_and_records_it(tiny_model_dir, tmp_path):
    low, high = _bounds(tiny_model_dir)
    budget = (low + high) // 2
    result = build_artifact(_request(tiny_model_dir, tmp_path / "store", budget))
    manifest = json.loads((result.artifact_dir / "sits-manifest.json").read_text())
    assert manifest["format_version"] == 2
    spec, modules = manifest["quantization"]["spec"], manifest["quantization"]["modules"]
    assert spec["scheme"] == "auto" and spec["max_size"] == budget
    auto = spec["auto"]
    assert auto["calibration_sha256"] == read_calibration(AwqSpec()).sha256
    stored = sum(DTYPE_SIZES[t["dtype"]] * math.prod(t["shape"]) for t in manifest["tensors"].values())
    assert auto["size"] == stored <= budget
    chosen = {m: r["choice"] for m, r in auto["modules"].items()}
    assert len(chosen) == 14  # 2 layers x 7 linears
    assert len(set(chosen.values())) >= 2  # halfway to int8: a mix, not one precision
    for module, label in chosen.items():
        record = modules[module]
        assert label == ("int8" if record["scheme"] == "int8" else f"int4-g{record['group_size']}")
        assert set(auto["modules"][module]["kl"]) == {"int4-g128", "int4-g32", "int8"}
    assert modules["model.embed_tokens"]["scheme"] == "fp16"
    again = build_artifact(_request(tiny_model_dir, tmp_path / "store2", budget))
    assert again.artifact_id == result.artifact_id  # byte-reproducible
    # Another budget is another artifact (the cache key holds max_size).
    other = build_artifact(_request(tiny_model_dir, tmp_path / "store", high))
    assert other.artifact_id != result.artifact_id


def test_validate_s_bounds_are_the_build_s(tiny_model_dir):
    shape = ModelShape.from_config_json(tiny_model_dir / "config.json")
    assert auto_size_bounds(shape, Quantization(scheme="auto", max_size=1)) == _bounds(tiny_model_dir)


def test_a_budget_below_the_smallest_choice_is_refused_with_the_minimum(tiny_model_dir, tmp_path):
    low, _ = _bounds(tiny_model_dir)
    with pytest.raises(BuildError, match=rf"max_size: {low - 1} bytes is below .* {low} bytes"):
        build_artifact(_request(tiny_model_dir, tmp_path / "store", low - 1))
    with pytest.raises(BuildError, match="scheme auto needs a size budget"):
        QuantSpec("int4", max_size=low)
    with pytest.raises(BuildError, match="not GGUF types"):
        _request(tiny_model_dir, tmp_path / "store", low, format="gguf")
