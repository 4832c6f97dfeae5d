"""Fixtures for the torch engine: tiny checkpoints of each architecture, built artifacts, and
fp32 checkpoints of an artifact's dequantized weights (the reference for quantized kernels)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deployer.agent.engines.torch import native
from deployer.agent.engines.torch.engine import TorchEngine
from deployer.agent.engines.torch.qlinear import (
    KERNEL_INT4_AVX2,
    KERNEL_INT4_CPU,
    KERNEL_INT8,
    KERNEL_INT8_AVX2,
)
from deployer.build.artifact import load_state_dict
from deployer.build.demo_model import make_tiny_checkpoint
from deployer.build.pipeline import build_artifact
from deployer.build.spec import BuildRequest, QuantSpec
from tests.checkpoints import TOKENIZER_FILES, hf_random_checkpoint


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> None:
    # The CI machine has two cores for everything; the tiny model gains nothing from more.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def odd_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose MLP width (72) no packed int4 kernel takes and no int8 kernel's K
    constraint allows, so some layers must fall back to dequant+linear."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("odd-model"), intermediate_size=72)


@pytest.fixture(scope="session")
def build(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """build(source_dir, scheme, group_size=128) -> artifact dir, through the real builder."""
    store = tmp_path_factory.mktemp("store")

    def run(source: Path, scheme: str, group_size: int = 128) -> Path:
        request = BuildRequest(source, "tiny", "1.0.0", QuantSpec(scheme, group_size), store)
        return build_artifact(request).artifact_dir

    return run


@pytest.fixture(scope="session")
def dequantized(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], Path]:
    """dequantized(artifact) -> an fp32 HF checkpoint holding exactly the artifact's weights."""

    def run(artifact: Path) -> Path:
        dest = tmp_path_factory.mktemp("dequantized")
        state = {k: v.contiguous() for k, v in load_state_dict(artifact).items()}
        save_file(state, str(dest / "model.safetensors"))
        for name in ("config.json", *TOKENIZER_FILES):
            shutil.copy(artifact / name, dest / name)
        return dest

    return run


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: Path) -> TorchEngine:
    """The fp32 engine on the tiny checkpoint (shared: generation tests must not leave it busy)."""
    return _engine_on(tiny_model_dir)


@pytest.fixture
def hf_checkpoint() -> Callable[..., Path]:
    """hf_checkpoint(dest, config, tokenizer_dir): save a random transformers model of `config`
    with the tiny tokenizer."""
    return hf_random_checkpoint


def _engine_on(directory: Path, **kwargs: object) -> TorchEngine:
    engine = TorchEngine(**{"dtype": "fp32", "max_context": 256, **kwargs})
    engine.load(directory)
    return engine


@pytest.fixture(scope="session")
def engine_on() -> Callable[..., TorchEngine]:
    """engine_on(dir, **kwargs): a loaded TorchEngine (fp32, 256 positions unless told otherwise)."""
    return _engine_on


@pytest.fixture(scope="session")
def cpu_kernel() -> dict[str, str]:
    """The kernel each quantized scheme runs on this CPU: ours on an AVX2 CPU without AVX-512 and
    with a C++ compiler, else torch's (CI's machines have been of both kinds)."""
    if native.cpu_kernels()[0] is not None:
        return {"int4": KERNEL_INT4_AVX2, "int8": KERNEL_INT8_AVX2}
    return {"int4": KERNEL_INT4_CPU, "int8": KERNEL_INT8}


@pytest.fixture
def torch_kernels_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantized layers built in the test never consider our kernels (tests of torch's)."""
    monkeypatch.setattr(native, "cpu_kernels", lambda: (None, "left out by the test"))
