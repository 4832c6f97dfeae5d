"""Picking the next token from logits: greedy, temperature, nucleus (top-p), seeded.

Sampling runs on the CPU in fp32 with a CPU `torch.Generator`, so the same seed gives the same
tokens whatever device produced the logits.
"""

from __future__ import annotations

import secrets

import torch

# Re-exported: the parameter checks live beside SamplingParams, free of torch (the llama.cpp engine
# uses them without importing torch).
from deployer.agent.engines.base import GREEDY_BELOW, SamplingParams

__all__ = ["new_generator", "pick_token"]


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
