"""Picking the next token from logits on the device that made them: greedy, temperature, top-k,
nucleus (top-p), each request with its own seeded generator.

A request with logit processing (bias, penalties, a grammar, logprobs: engines/logits.py) has its
row copied to the host, processed, and put back before the pick; the other rows never leave the
device.

Nothing sorts the whole vocabulary: top-p looks at the `TOP_P_CANDIDATES` most likely tokens
(found with `topk`), and only when their mass falls short of top_p, which real distributions
almost never do, at the rest. Only the chosen ids cross to the host, once per step for a batch.
The same seed gives the same tokens on the same device (CPU and CUDA generators differ).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Re-exported: the parameter checks live beside SamplingParams, free of torch (the llama.cpp engine
# uses them without importing torch).
from deployer.agent.engines.base import token_of
from deployer.agent.engines.logits import TokenProcessor
from deployer.agent.types import GREEDY_BELOW, SamplingParams, TokenLogprobs

__all__ = ["Sampler", "choose", "new_generator", "pick_token"]

# How many of the most likely tokens a nucleus is looked for in before the whole vocabulary.
TOP_P_CANDIDATES = 1024


def new_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device` seeded with `seed`, or with fresh randomness when None."""
    return torch.Generator(device=device).manual_seed(secrets.randbits(63) if seed is None else seed)


@dataclass
class Sampler:
    """One request's sampling: its parameters, its own generator, its logit processing (None when
    it has none) and the logprobs of the token it picked last."""

    params: SamplingParams
    generator: torch.Generator
    processor: TokenProcessor | None = None
    logprobs: TokenLogprobs | None = None

    @property
    def greedy(self) -> bool:
        """True when the most likely token is always taken."""
        return self.params.temperature < GREEDY_BELOW


def _draw(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A token id (0-d) from logits [V], and whether the candidates held the whole nucleus."""
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if not top_k and params.top_p >= 1:
        token = torch.multinomial(torch.softmax(x, dim=-1), 1, generator=generator)[0]
        return token, torch.ones((), dtype=torch.bool, device=x.device)
    values, ids = torch.topk(x, top_k or min(vocab, TOP_P_CANDIDATES))  # sorted, most likely first
    # With top_k, top-p is taken within the top k; without, on the candidates' true probabilities.
    probs = torch.softmax(values, dim=-1) if top_k else torch.exp(values - torch.logsumexp(x, dim=-1))
    covered = torch.ones((), dtype=torch.bool, device=x.device)
    if params.top_p < 1:
        # Keep the smallest prefix whose mass reaches top_p (the most likely token always stays).
        before = probs.cumsum(0) - probs
        probs = torch.where(before < params.top_p, probs, torch.zeros_like(probs))
        if not top_k:
            covered = probs.sum() >= params.top_p - 1e-6
    return ids[torch.multinomial(probs, 1, generator=generator)[0]], covered


def _draw_sorted(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The exact nucleus over the whole vocabulary (a full sort): for the rare wide nucleus."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(0) - sorted_probs
    kept = torch.where(before < params.top_p, sorted_probs, torch.zeros_like(sorted_probs))
    return int(order[torch.multinomial(kept, 1, generator=generator)])


def choose(logits: torch.Tensor, samplers: Sequence[Sampler]) -> list[int | Exception]:
    """One token id per row of logits [B, V], row i under samplers[i]; one transfer to the host
    (plus one per processed row).

    A row whose processing fails (its grammar allows no token, or refuses the one picked) gets the
    exception in its place; the other rows are picked as without it."""
    processed = [(i, s.processor) for i, s in enumerate(samplers) if s.processor is not None]
    failed: dict[int, Exception] = {}
    if processed:
        # Rows are replaced in place: these logits are this step's alone (a copy unless fp32).
        logits = logits.float()
        for i, processor in processed:
            try:
                row = processor.process(logits[i].cpu().numpy())
            except Exception as exc:  # that row's request alone; its raw row is picked and dropped
                failed[i] = exc
                continue
            logits[i] = torch.from_numpy(row).to(logits.device)
    out: list[int | Exception] = list(_pick(logits, samplers))
    for i, processor in processed:
        if i in failed:
            out[i] = failed[i]
            continue
        try:
            samplers[i].logprobs = processor.accept(token_of(out[i]))
        except Exception as exc:
            out[i] = exc
    return out


def _pick(logits: torch.Tensor, samplers: Sequence[Sampler]) -> list[int]:
    ids = logits.argmax(dim=-1)
    sampled = [(i, s) for i, s in enumerate(samplers) if not s.greedy]
    if not sampled:
        return ids.tolist()
    drawn = [_draw(logits[i], s.params, s.generator) for i, s in sampled]
    tokens = torch.stack([t for t, _ in drawn])
    covered = torch.stack([c for _, c in drawn]).to(tokens.dtype)
    host = torch.cat((ids, tokens, covered)).tolist()
    n = len(samplers)
    out, picks, flags = host[:n], host[n : n + len(sampled)], host[n + len(sampled) :]
    for (i, s), token, ok in zip(sampled, picks, flags, strict=True):
        out[i] = token if ok else _draw_sorted(logits[i], s.params, s.generator)
    return out


def pick_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Choose one token id from logits [V] under `params`."""
    return token_of(choose(logits[None], [Sampler(params, generator)])[0])
