"""Fixtures every test area shares: the seeded tiny checkpoint and the real demo model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from deployer.build.demo_model import make_tiny_checkpoint, prepare_smollm2
from deployer.core.kernel_cache import KERNEL_CACHE_VARIABLE, shared_kernel_cache
from deployer.core.redact import redaction_scope
from tests.checkpoints import hf_random_checkpoint

# Our CPU kernel (engines/torch/native.py) is built once per machine into the project's cache, not once
# per agent store a test makes (an agent points the variable at its store only when it is unset).
os.environ.setdefault(KERNEL_CACHE_VARIABLE, str(shared_kernel_cache()))

# The device lab (session-scoped, one per machine): loaded once here for every test folder.
pytest_plugins = ["tests.lab.fixtures"]


@pytest.fixture(autouse=True)
def _own_secrets() -> Iterator[None]:
    """Secrets a test registers (a config's ${VAR} values) are forgotten after it, so another
    test's output is never redacted with them."""
    with redaction_scope():
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded 2-layer Llama checkpoint (fp32 safetensors + BPE tokenizer). Treat as read-only."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture as `tiny_model_dir`, other weights (seed 1): a 'v2'. Read-only."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model-b"), seed=1)


@pytest.fixture(scope="session")
def varied_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A seeded random transformers Llama whose wide initialisation (std 0.3) makes greedy
    decoding wander over many tokens with clear margins (the trained-looking tiny checkpoint
    repeats one token), so 128-token comparisons mean something."""
    import json

    from transformers import AutoConfig

    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    config = AutoConfig.for_model(
        "llama",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    return hf_random_checkpoint(tmp_path_factory.mktemp("varied-model"), config, tiny_model_dir)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct in HF layout, prepared once and cached under ~/.cache/sits-deployer."""
    return prepare_smollm2()


# What a fixture implies about a test's cost, applied as markers at collection, so that a new test
# that takes the real model, the lab or nginx is never counted in the fast tier (scripts/test.sh
# --fast deselects these markers and `long`, which costly tests say themselves).
_MARKER_OF_FIXTURE = {"smollm2_dir": "slow", "lab": "lab", "nginx": "nginx"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test by the costly fixtures it uses, directly or through other fixtures."""
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for fixture, marker in _MARKER_OF_FIXTURE.items():
            if fixture in used:
                item.add_marker(marker)
