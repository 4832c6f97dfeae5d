"""Speculative decoding for a lone greedy sequence: a small draft model proposes tokens, the
model checks them all in one pass, and every proposal it agrees with is a token gained.

A decode step of one sequence reads every weight once, so on a CPU it runs at the speed of the
memory (docs/torch-engine.md: fp32 SmolLM2 at 63-89% of the read bound). Checking several
tokens reads those same weights once too, so each agreed proposal is a token at about the
draft's cost. The draft is the model's own weights in int4 (`loader.load_draft`), about a
sixth of fp32's bytes. Only the model's own choices are ever emitted: the text is the model's
greedy text whatever the draft proposes; a poor draft costs speed, never words.

Hand-written: llama.cpp's server does this with a second model file, and transformers'
assisted generation with a second model in `generate`; neither drives our slots and KV cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from deployer.agent.engines.base import common_prefix
from deployer.agent.engines.torch.loader import LoadedModel

# Tokens the draft proposes per round at most, and the probability below which it stops
# proposing (llama.cpp's --draft-max and --draft-p-min): an unsure proposal is seldom accepted,
# and its draft step is lost. A sweep on SmolLM2 fp32 with its int4 draft (2 threads of the
# 2-core AMD EPYC, compiled, 64 tokens, best of 3; plain compiled steps 19.6 tok/s) gave 1.52-1.61x
# plain steps at 4-6 proposals with no threshold, 1.45-1.72x at 0.3, 1.19-1.41x at 0.5, and
# 1.11-1.22x at 0.7 (most rounds then propose nothing); 5 and 0.3 gave 1.71x.
DRAFT_TOKENS = 5
DRAFT_P_MIN = 0.3

DecodeFn = Callable[[torch.Tensor, torch.Tensor, int | None], torch.Tensor]


@dataclass
class DraftStats:
    """How speculation went since load: rounds run, tokens proposed and accepted."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0

    def describe(self) -> str:
        """A line for /v1/models: the acceptance and the tokens a round yields."""
        if not self.rounds:
            return "no rounds yet"
        rate = self.accepted / self.proposed  # a round proposes at least one token
        per_round = (self.accepted + self.rounds) / self.rounds
        accepted = f"{self.accepted} of {self.proposed} proposals accepted ({rate:.0%})"
        return f"{accepted}, {per_round:.2f} tokens a round"


@dataclass
class Drafter:
    """The draft model and the tokens its cache holds (`held`). It drafts for one sequence at a
    time, so its cache has one slot (`loader.load_draft`): a sequence of another slot
    than the last one drafted for re-runs what the two do not share."""

    loaded: LoadedModel
    step: DecodeFn | None = None  # its compiled decode step (CPU), else its eager decode
    note: str = "eager"  # how it decodes, for /v1/models
    held: list[int] = field(default_factory=list)
    stats: DraftStats = field(default_factory=DraftStats)

    def propose(self, held: Sequence[int], last: int, count: int) -> list[int]:
        """The draft's greedy tokens after `held` + [last]: `count` at most, up to the first it
        gives less than DRAFT_P_MIN probability.

        The draft's cache catches up first with whatever of `held` it lacks (the prompt, steps the
        engine ran batched without it), from the longest prefix it already holds.
        """
        model, device = self.loaded.model, self.loaded.device
        common = common_prefix(self.held, held)
        if common < len(held):
            model.prefill(torch.tensor([list(held[common:])], dtype=torch.long, device=device), 0, common)
        tokens = torch.zeros(1, dtype=torch.long, device=device)
        positions = torch.zeros(1, dtype=torch.long, device=device)
        step = self.step or model.decode
        proposed: list[int] = []
        fed = [last]
        for i in range(count):
            tokens[0], positions[0] = fed[-1], len(held) + i
            best, token = step(tokens, positions, len(held) + i + 1)[0].softmax(dim=-1).max(dim=-1)
            if float(best) < DRAFT_P_MIN:
                break
            proposed.append(int(token))
            if i + 1 < count:
                fed.append(proposed[-1])
        self.held = [*held, *fed]
        return proposed


def accepted_run(proposed: Sequence[int], checked: Sequence[int]) -> list[int]:
    """The tokens a round yields: the model's own picks `checked` (one more than `proposed`, the
    pick after each prefix of them) up to and including its first disagreement with the draft."""
    agree = common_prefix(proposed, checked)
    return list(checked[: agree + 1])
