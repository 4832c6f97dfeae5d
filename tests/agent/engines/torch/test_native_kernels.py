"""Our AVX2 int4, int8 and fp32 kernels (engines/torch/native.py): their answers against the dequantized
weights, the layers that may use them, the input they refuse, a compiled graph calling them, and
what happens where they cannot be built."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deployer.agent.engines.torch import native
from deployer.agent.engines.torch.qlinear import (
    KERNEL_FP32_AVX2,
    KERNEL_INT4_AVX2,
    KERNEL_INT4_CPU,
    KERNEL_INT8_AVX2,
    Int4Avx2Linear,
    LinearWeights,
    build_linear,
)
from deployer.core.quant_layout import (
    ModuleQuant,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernels() -> Iterator[native.CpuKernels]:
    """The kernels, built on any CPU with AVX2 (AVX-512 ones too, where the layers would otherwise
    keep torch's) and chosen by the layers built in the test; a skip naming why on a CPU without
    AVX2 or without a compiler: a machine that has both and fails the build fails the test."""
    found, why = native.built_kernels()
    if found is None and (not _has_avx2() or "no C++ compiler" in why):
        pytest.skip(why)
    assert found is not None, why
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "cpu_kernels", native.built_kernels)
        yield found


def _has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _int4(out: int, n_in: int, group: int) -> tuple[LinearWeights, ModuleQuant, torch.Tensor]:
    torch.manual_seed(0)
    packed, scale, zero = quantize_int4(torch.randn(out, n_in), group)
    layout = ModuleQuant("int4", group, n_in, packed.shape[1] * 2, out)
    return LinearWeights(packed, scale=scale, zero=zero), layout, dequantize_int4(packed, scale, zero, n_in)


def _int8(out: int, n_in: int) -> tuple[LinearWeights, ModuleQuant, torch.Tensor]:
    torch.manual_seed(0)
    q, scale = quantize_int8(torch.randn(out, n_in))
    layout = ModuleQuant("int8", None, n_in, n_in, out)
    return LinearWeights(q, scale=scale), layout, dequantize_int8(q, scale)


def _fp32(out: int, n_in: int) -> tuple[LinearWeights, None, torch.Tensor]:
    torch.manual_seed(0)
    weight = torch.randn(out, n_in)
    return LinearWeights(weight), None, weight


_WEIGHTS = {
    "int4": _int4,
    "int8": lambda out, n_in, group: _int8(out, n_in),
    "fp32": lambda out, n_in, group: _fp32(out, n_in),
}
KERNELS = {"int4": KERNEL_INT4_AVX2, "int8": KERNEL_INT8_AVX2, "fp32": KERNEL_FP32_AVX2}


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


CASES = [
    ("int4", 64, 64, 32),
    ("int4", 96, 128, 64),
    ("int4", 48, 256, 128),
    ("int4", 8, 40, 32),  # 40 columns padded to 64
    ("int8", 64, 64, None),
    ("int8", 100, 256, None),
    ("fp32", 64, 64, None),
    ("fp32", 100, 256, None),
]


# fp32 weights in a bf16 model are cast to bf16 and run F.linear: no bf16 case for them.
DTYPED = [
    (*case, dtype)
    for case in CASES
    for dtype in (torch.float32, torch.bfloat16)
    if case[0] != "fp32" or dtype == torch.float32
]


@pytest.mark.parametrize(("scheme", "out", "n_in", "group", "dtype"), DTYPED)
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_the_kernels_match_the_dequantized_weights(kernels, scheme, out, n_in, group, dtype, rows):
    weights, layout, dense = _WEIGHTS[scheme](out, n_in, group)
    layer, kernel = build_linear("x", weights, layout, CPU, dtype)
    assert kernel == KERNELS[scheme]
    x = torch.randn(rows, n_in).to(dtype)
    got = layer(x)
    assert got.dtype == dtype  # the kernel answers in the model's dtype, as torch's kernels do
    # Only the activations' int16 rounding (per 32 columns) and bf16's own separate them (fp32:
    # the order of the sums).
    assert _relative_error(got.float(), x.float() @ dense.t()) < (2e-2 if dtype == torch.bfloat16 else 1e-3)
    # Rows are independent: a batch gives each row what it gets alone.
    torch.testing.assert_close(layer(x)[-1:], layer(x[-1:]), rtol=0, atol=0)


def test_a_layer_the_kernel_cannot_take_keeps_torchs(kernels):
    weights, layout, _ = _int4(18, 64, 32)  # 18 output rows: not a multiple of the 4 it packs
    with pytest.raises(NotImplementedError, match="int4 18x64"):
        Int4Avx2Linear(weights, layout, torch.float32, kernels)
    assert build_linear("x", weights, layout, CPU, torch.float32)[1] != KERNEL_INT4_AVX2
    weights, layout, _ = _int8(64, 72)  # 72 columns: not whole blocks of 32
    assert build_linear("x", weights, layout, CPU, torch.float32)[1] != KERNEL_INT8_AVX2
    weights, _, _ = _fp32(64, 72)
    assert build_linear("x", weights, None, CPU, torch.float32)[1] != KERNEL_FP32_AVX2


def test_the_ops_refuse_weights_that_do_not_match_their_input(kernels):
    weights, _, _ = _int4(64, 64, 32)
    packed = native.pack_int4(weights.weight, weights.scale, weights.zero, 32)
    with pytest.raises(RuntimeError, match="packed weights do not match"):
        kernels.int4(torch.randn(1, 64), packed, 128)
    with pytest.raises(RuntimeError, match="contiguous 2-D float32 or bfloat16"):
        kernels.int4(torch.randn(1, 64, dtype=torch.float16), packed, 64)
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        kernels.int4(torch.randn(1, 48), packed, 64)
    weights, _, _ = _int8(64, 64)
    with pytest.raises(RuntimeError, match="scale must be n contiguous float32"):
        kernels.int8(torch.randn(1, 64), native.pack_int8(weights.weight), torch.ones(3), 64)


@pytest.mark.parametrize("scheme", ["int4", "int8", "fp32"])
def test_the_ops_compile_into_a_graph(kernels, scheme):
    weights, layout, _ = _WEIGHTS[scheme](64, 64, 32)
    layer, _ = build_linear("x", weights, layout, CPU, torch.float32)
    x = torch.randn(2, 64)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)


def test_without_a_compiler_layers_keep_torchs_kernels_and_say_why(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("SITS_KERNEL_CACHE_DIR", str(tmp_path / "kernels"))
    found, why = native._load()
    if not _has_avx2():
        pytest.skip(why)
    assert found is None
    assert "did not build or load" in why and "no-such-c++" in why
    monkeypatch.setattr(native, "cpu_kernels", lambda: (None, why))
    weights, layout, _ = _int4(64, 64, 32)
    assert build_linear("x", weights, layout, CPU, torch.float32)[1] == KERNEL_INT4_CPU


def _native_main(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m deployer.agent.engines.torch.native` with `cache` as its kernel cache and no C++
    compiler to be found (a PATH without one, no CXX): what a device usually is."""
    env = {k: v for k, v in os.environ.items() if k != "CXX"} | {
        "SITS_KERNEL_CACHE_DIR": str(cache),
        "PATH": str(cache / "no-bin"),
    }
    argv = [sys.executable, "-m", "deployer.agent.engines.torch.native", *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)


def test_a_library_built_elsewhere_loads_where_there_is_no_compiler(kernels, tmp_path):
    # Its name is the key: a controller's build serves a device without a compiler (push/bootstrap.py).
    empty = _native_main(tmp_path / "empty")
    assert "not built: no C++ compiler" in empty.stdout, empty.stdout + empty.stderr
    assert _native_main(tmp_path / "empty", "--library").returncode == 1
    given = tmp_path / "given"
    given.mkdir()
    library = native.library_path()  # the one this process loaded, from the machine's cache
    shutil.copy(library, given / library.name)
    loaded = _native_main(given)
    assert f"built in {given}" in loaded.stdout, loaded.stdout + loaded.stderr
    assert _native_main(given, "--library").stdout.strip() == str(given / library.name)
