"""RMSNorm, SiLU and softmax as custom ops, so a compiled decode step computes what the eager one does.

Inductor re-derives these three from their definitions and fuses them with their neighbours: its
reductions sum in another order and its exp is another implementation. In fp32 that moves a
logit by about 1e-6. In bf16 such a difference now and then rounds an activation to the next
bf16 value (1/128 apart), the difference spreads through the layers, and greedy decoding parts
from the eager path at the first near-tie: on random weights on an H100, the compiled step gave
the eager step's first 7 to 26 of 128 greedy tokens (SmolLM2 shape, four prompts), 1 to 33
(Qwen2.5-1.5B shape).

As custom ops they run torch's own kernels whether compiled or not, and inductor's
`emulate_precision_casts` (EMULATE_CASTS) rounds the elementwise ops it still fuses where eager
rounds them. The compiled step then gave the eager tokens, 128 of 128 for every prompt and both
shapes. What it costs is the fusions inductor no longer makes: 655 against 790 tok/s (SmolLM2
shape) and 385 against 424 (Qwen shape) at batch 1 on the H100, which is 0.89x and 0.93x of the
gpt-fast-style reference in bench/. A user gets the same tokens whether the graphs were captured,
the compile failed, or the engine runs eager, and so the compiled path can be checked against
the eager one token for token.

The engine turns them on where it compiles the decode layer, on CUDA
(`Transformer.use_exact_ops`). On a CPU the model computes in fp32, where reordered sums do not
flip real models' tokens, and the compiled CPU step keeps its fusions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The inductor option that rounds fused elementwise results to bf16 where eager rounds them.
EMULATE_CASTS = {"emulate_precision_casts": True}


@torch.library.custom_op("sits::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm over the last dimension, scaled by `weight`."""
    return F.rms_norm(x, weight.shape, weight, eps)


@rms_norm.register_fake
def _rms_norm_shape(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("sits::silu", mutates_args=())
def silu(x: torch.Tensor) -> torch.Tensor:
    """F.silu."""
    return F.silu(x)


@silu.register_fake
def _silu_shape(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("sits::softmax", mutates_args=())
def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, in x's dtype."""
    return x.softmax(dim=-1)


@softmax.register_fake
def _softmax_shape(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)
