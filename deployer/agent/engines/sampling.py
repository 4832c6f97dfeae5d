"""Picking the next token from logits: greedy, temperature, nucleus (top-p), seeded.

Sampling runs on the CPU in fp32 with a CPU `torch.Generator`, so the same seed gives the same
tokens whatever device produced the logits.
"""

from __future__ import annotations

import math
import secrets

import torch

from deployer.agent.engines.base import SamplingParams
from deployer.errors import AgentError

# Below this temperature sampling is greedy (dividing by ~0 would overflow anyway).
GREEDY_BELOW = 1e-5


def check_params(params: SamplingParams) -> None:
    """Raise AgentError for parameters no sampler can honour."""
    if params.max_tokens < 1:
        raise AgentError(f"max_tokens must be at least 1, got {params.max_tokens}")
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise AgentError(f"temperature must be a finite number >= 0, got {params.temperature}")
    if not (0 < params.top_p <= 1):
        raise AgentError(f"top_p must be in (0, 1], got {params.top_p}")


def new_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with `seed`, or with fresh randomness when None."""
    return torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)


def pick_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Choose one token id from logits [V] under `params`."""
    if params.temperature < GREEDY_BELOW:
        return int(logits.argmax())
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
    if params.top_p >= 1:
        return int(torch.multinomial(probs, 1, generator=generator))
    sorted_probs, order = probs.sort(descending=True)
    # Keep the smallest prefix whose mass reaches top_p (the most likely token always stays).
    before = sorted_probs.cumsum(0) - sorted_probs
    kept = torch.where(before < params.top_p, sorted_probs, torch.zeros_like(sorted_probs))
    return int(order[torch.multinomial(kept, 1, generator=generator)])
