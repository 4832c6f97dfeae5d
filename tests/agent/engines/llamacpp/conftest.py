"""Fixtures for the GGUF and llama.cpp tests: GGUF artifacts built from the seeded tiny checkpoints."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from deployer.build.pipeline import build_artifact
from deployer.build.spec import BuildRequest, QuantSpec

# Engine tests skip (with this reason) where the optional extra is not installed.
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install 'sits-deployer[llamacpp]')",
)


def build_gguf(
    source: Path, store: Path, scheme: str = "int8", group_size: int = 32, version: str = "1.0.0"
) -> Path:
    """Build a GGUF artifact of `source` into `store`; returns the artifact directory."""
    request = BuildRequest(
        source_dir=source,
        name="tiny",
        version=version,
        quant=QuantSpec(scheme, group_size),
        store_dir=store,
        use_cache=False,
        format="gguf",
    )
    return build_artifact(request).artifact_dir


@pytest.fixture(scope="session")
def gguf_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One artifact store for the session's GGUF artifacts."""
    return tmp_path_factory.mktemp("gguf-store")


@pytest.fixture(scope="session")
def tiny_gguf_dir(tiny_model_dir: Path, gguf_store: Path) -> Path:
    """The tiny checkpoint as a Q8_0 GGUF artifact (version 1.0.0). Read-only."""
    return build_gguf(tiny_model_dir, gguf_store)


@pytest.fixture(scope="session")
def tiny_gguf_dir_b(tiny_model_dir_b: Path, gguf_store: Path) -> Path:
    """The other tiny checkpoint (seed 1) as a Q8_0 GGUF artifact (version 2.0.0). Read-only."""
    return build_gguf(tiny_model_dir_b, gguf_store, version="2.0.0")


@pytest.fixture(scope="session")
def smollm2_gguf_dir(smollm2_dir: Path, gguf_store: Path) -> Path:
    """SmolLM2-135M-Instruct as a Q4_1 GGUF artifact (int4, group size 32). Read-only."""
    return build_gguf(smollm2_dir, gguf_store, scheme="int4")


def build_gguf_adapter(
    source: Path,
    base: Path,
    store: Path,
    *,
    name: str,
    seed: int,
    version: str = "1.0.0",
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj"),
    b_std: float = 0.5,
) -> Path:
    """A real PEFT adapter of `source` (seeded), built as an adapter artifact for the GGUF artifact
    `base` of it (so with its adapter.gguf) into `store`; returns the adapter artifact directory."""
    from deployer.build.adapter import AdapterBuildRequest, build_adapter
    from deployer.core.hashing import sha256_file
    from tests.agent.lora_helpers import make_peft_adapter

    peft = make_peft_adapter(source, store / f"peft-{name}-{seed}", seed=seed, targets=targets, b_std=b_std)
    request = AdapterBuildRequest(
        name=name,
        version=version,
        peft_dir=peft,
        scale=1.0,
        base_artifact_dir=base,
        base_artifact_id=sha256_file(base / "sits-manifest.json"),
        base_source_dir=source,
        store_dir=store,
    )
    return build_adapter(request).artifact_dir
