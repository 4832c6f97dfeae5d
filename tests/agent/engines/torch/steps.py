"""Driving the torch engine's batched step interface in tests: one sequence in one slot."""

from __future__ import annotations

from deployer.agent.types import SamplingParams

GREEDY = SamplingParams(max_tokens=128, temperature=0)
PROMPTS = ("The capital of", "Edge devices run small language models.", "hello world 123")


def run(engine, slot, prompt, params, n):
    """`n` tokens of `prompt` in `slot` (the prefill's, then a step each); the slot is released."""
    tokens = [engine.prefill(slot, prompt, params)]
    tokens += [engine.step([slot])[0] for _ in range(n - 1)]
    engine.release(slot)
    return tokens
