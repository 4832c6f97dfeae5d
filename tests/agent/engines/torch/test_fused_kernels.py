"""The CUDA decode step's fused Triton kernels (engines/torch/triton_fused.py) against torch's ops.

They run here in Triton's interpreter, on the CPU, in fp32 (the interpreter truncates casts to
bf16 where a GPU rounds them, so bf16 is checked on the card, by exact_ops._check at load).
Skipped where triton is not installed, as in CI (the CPU build of torch does not bring it):
the GPU bench then checks them end to end (bench/engine.py --device cuda: `=eager`, `=ref`).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (it comes with CUDA builds of torch)", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before triton_fused decorates its kernels

from deployer.agent.engines.torch import exact_ops, triton_fused

GEN = torch.Generator().manual_seed(0)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=GEN)


def test_add_rms_norm_is_the_add_and_the_norm():
    x, delta, weight = rand(3, 1, 576), rand(3, 1, 576), rand(576)
    got = triton_fused.add_rms_norm(x, delta, weight, 1e-5)
    want = exact_ops.torch_add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize("width", [1536, 1000])  # whole blocks, and a partial last block
def test_silu_mul_reads_the_halves_of_one_projection(width):
    gate, up = rand(5, 1, 2 * width).chunk(2, dim=-1)  # strided rows, as gate_up_proj gives them
    got = triton_fused.silu_mul(gate, up)
    assert got.is_contiguous() and got.shape == (5, 1, width)
    torch.testing.assert_close(got, exact_ops.torch_silu_mul(gate, up))


@pytest.mark.parametrize("keys", [257, 3000])  # one chunk, and three (the online max and sum)
def test_masked_softmax_hides_the_masked_keys(keys):
    scores = rand(3, 3, 3, keys) * 4 - 1000  # far below 0: exp(0 - top) would overflow
    positions, keep = torch.tensor([10, keys - 2, keys - 1]), torch.arange(keys)[None, :]
    visible = keep <= positions[:, None]
    visible[2, : keys - 200] = False  # a sliding window: the first chunks hide every key
    hidden = ~visible[:, None, None, :]
    got = triton_fused.masked_softmax(scores, hidden, 0.125)
    torch.testing.assert_close(got, exact_ops.torch_masked_softmax(scores, hidden, 0.125))
    assert torch.all(got.masked_select(hidden) == 0)
    torch.testing.assert_close(got.sum(-1), torch.ones(3, 3, 3))
