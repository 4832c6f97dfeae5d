"""RMSNorm, SiLU and softmax as custom ops, so a compiled decode step computes what the eager one does.

Inductor re-derives these three from their definitions and fuses them with their neighbours: its
reductions sum in another order and its exp is another implementation. In fp32 that moves a
logit by about 1e-6. In bf16 such a difference now and then rounds an activation to the next
bf16 value (1/128 apart), the difference spreads through the layers, and greedy decoding parts
from the eager path at the first near-tie: on random weights on an H100, the compiled step gave
the eager step's first 7 to 26 of 128 greedy tokens (SmolLM2 shape, four prompts), 1 to 33
(Qwen2.5-1.5B shape).

As custom ops they run the same kernels whether compiled or not, and inductor's
`emulate_precision_casts` (EMULATE_CASTS) rounds the elementwise ops it still fuses where eager
rounds them. The compiled step then gave the eager tokens, 128 of 128 for every prompt and both
shapes. What that cost is the fusions inductor no longer made (0.73-0.89x of the gpt-fast-style
reference in bench/ at batch 1, SmolLM2 shape, H100), so on CUDA the ops make those fusions
themselves, in Triton (triton_fused): the residual add with the RMSNorm after it, silu(gate) * up,
and the decode softmax with its scale, mask and cast. Elsewhere they run torch's ops
(`torch_*` here, which the engine calls directly when the ops are off). A user gets the same
tokens whether the graphs were captured, the compile failed, or the engine runs eager, and so
the compiled path can be checked against the eager one token for token.

The engine turns them on for every CUDA model, compiled or eager (`Transformer.use_exact_ops`):
the Triton kernels round once where torch rounds after each op, so eager steps must call them too.
On a CPU the model computes in fp32, where reordered sums do not flip real models' tokens, and
the compiled CPU step keeps its fusions.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

# The inductor option that rounds fused elementwise results to bf16 where eager rounds them.
EMULATE_CASTS = {"emulate_precision_casts": True}


def torch_add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, RMSNorm(h) * weight) with h = x + delta, in torch's ops."""
    h = x + delta
    return h, F.rms_norm(h, weight.shape, weight, eps)


def torch_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, in torch's ops."""
    return F.silu(gate) * up


def torch_masked_softmax(scores: torch.Tensor, hidden: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scores * scale) over the last dimension, in fp32, with the keys where `hidden` is
    True left out; in scores' dtype, in torch's ops."""
    return (scores * scale).float().masked_fill(hidden, float("-inf")).softmax(dim=-1).to(scores.dtype)


def fused_kernels(device: torch.device) -> str:
    """What the ops run on `device`, for describe(): on CUDA the Triton kernels, built and checked
    against torch's ops here (call it before a CUDA graph capture), else torch's ops and why."""
    if device.type != "cuda":
        return "torch (fused kernels are for CUDA)"
    return _fused_kernels()[1]


def _fused() -> ModuleType | None:
    return _fused_kernels()[0]


@functools.cache
def _fused_kernels() -> tuple[ModuleType | None, str]:
    """triton_fused and a note, or None and why not: triton is missing (a CPU build of torch), or
    a kernel fails to build or disagrees with torch's ops on this card."""
    try:
        from deployer.agent.engines.torch import triton_fused

        _check(triton_fused)
    except Exception as exc:  # anything triton raises: serve with torch's ops, and say why
        first = (str(exc).splitlines() or [""])[0]
        return None, f"torch (fused kernels unavailable: {type(exc).__name__}: {first})"
    return triton_fused, "triton (add+rms_norm, silu*mul, masked softmax)"


def _check(fused: ModuleType) -> None:
    """Raise unless each kernel agrees with torch's ops within bf16 rounding on a small input."""
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    generator = torch.Generator(cuda).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=cuda).to(bf16)

    x, delta, weight, gate_up = rand(3, 1, 96), rand(3, 1, 96), rand(96), rand(3, 1, 2 * 80)
    scores = rand(2, 2, 3, 1500) * 4  # longer than one chunk of the softmax kernel
    hidden = torch.rand((2, 1, 1, 1500), generator=generator, device=cuda) < 0.5
    pairs = [
        (fused.add_rms_norm(x, delta, weight, 1e-6), torch_add_rms_norm(x, delta, weight, 1e-6)),
        (fused.silu_mul(*gate_up.chunk(2, -1)), torch_silu_mul(*gate_up.chunk(2, -1))),
        (fused.masked_softmax(scores, hidden, 0.125), torch_masked_softmax(scores, hidden, 0.125)),
    ]
    for got, want in pairs:
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1.6e-2)


@torch.library.custom_op("sits::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_add_rms_norm: one Triton kernel on CUDA."""
    fused = _fused() if x.is_cuda else None
    if fused is None:
        return torch_add_rms_norm(x, delta, weight, eps)
    return fused.add_rms_norm(x, delta, weight, eps)


@add_rms_norm.register_fake
def _add_rms_norm_shape(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("sits::silu_mul", mutates_args=())
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """torch_silu_mul: one Triton kernel on CUDA."""
    fused = _fused() if gate.is_cuda else None
    return torch_silu_mul(gate, up) if fused is None else fused.silu_mul(gate, up)


@silu_mul.register_fake
def _silu_mul_shape(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@torch.library.custom_op("sits::masked_softmax", mutates_args=())
def masked_softmax(scores: torch.Tensor, hidden: torch.Tensor, scale: float) -> torch.Tensor:
    """torch_masked_softmax: one Triton kernel on CUDA."""
    fused = _fused() if scores.is_cuda else None
    if fused is None:
        return torch_masked_softmax(scores, hidden, scale)
    return fused.masked_softmax(scores, hidden, scale)


@masked_softmax.register_fake
def _masked_softmax_shape(scores: torch.Tensor, hidden: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty(scores.shape, dtype=scores.dtype, device=scores.device)
