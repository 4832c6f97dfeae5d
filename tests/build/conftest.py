"""Fixtures for the build tests: requests against the tiny checkpoint, and damaged copies."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from deployer.build.spec import BuildRequest, GateSpec, QuantSpec

EVAL_TEXT = Path(__file__).resolve().parents[2] / "examples" / "data" / "eval.txt"


def make_request(
    source: Path, store: Path, scheme: str = "int8", group_size: int = 128, **kwargs
) -> BuildRequest:
    """A build request for `source` into `store` (no gate unless `gate=` is given)."""
    return BuildRequest(
        source_dir=source,
        name="tiny",
        version="1.0.0",
        quant=QuantSpec(scheme, group_size),
        store_dir=store,
        **kwargs,
    )


def small_gate(**limits) -> GateSpec:
    """A gate on the first 128 tokens of the example eval text."""
    return GateSpec(eval_text=EVAL_TEXT, max_tokens=128, **limits)


@pytest.fixture
def tiny_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A writable copy of the tiny checkpoint, for tests that damage it."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def store_is_empty(store: Path) -> bool:
    """True when no artifact, cache entry or staging directory was left behind."""
    return not any(
        any((store / sub).iterdir()) for sub in ("artifacts", "cache", "tmp") if (store / sub).is_dir()
    )
