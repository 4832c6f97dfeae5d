"""The engine on the real SmolLM2-135M-Instruct: logits equal transformers', and the answers of
the fp32, int8 and int4 artifacts are right."""

from __future__ import annotations

import pytest
import torch

from deployer.agent.engines.torch.qlinear import (
    KERNEL_FP32_AVX2,
    KERNEL_INT4_AVX2,
    KERNEL_INT4_CPU,
    KERNEL_INT8,
    KERNEL_INT8_AVX2,
    KERNEL_LINEAR,
    KERNEL_ONEDNN,
)
from deployer.agent.types import ChatMessage, SamplingParams

pytestmark = pytest.mark.slow

QUESTION = [ChatMessage("user", "What is the capital of France?")]


def test_fp32_logits_match_transformers(smollm2_dir, engine_on):
    from transformers import AutoModelForCausalLM

    engine = engine_on(smollm2_dir)
    ids = engine.chat_prompt(QUESTION)
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    with torch.inference_mode():
        want = reference(torch.tensor([ids])).logits[0]
    # Our fp32 layers may run oneDNN's linear (where the load timed it faster), transformers' run
    # MKL's: the sums differ in the last bits, which 30 layers grow to about 1.1e-4 at logits of
    # up to 30 (a real bug shows as 1e-2 or more).
    torch.testing.assert_close(engine.logits(ids), want, atol=3e-4, rtol=0)


# fp32 on a CPU: ours on an AVX2-only CPU, else oneDNN's or F.linear, whichever the load timed faster.
FP32_KERNELS = {KERNEL_ONEDNN, KERNEL_LINEAR, KERNEL_FP32_AVX2}


@pytest.mark.parametrize(
    ("scheme", "group_size", "kernels", "finish"),
    [
        ("fp32", 128, FP32_KERNELS, "stop"),  # one sentence, then <|im_end|>
        ("int8", 128, {KERNEL_INT8_AVX2, KERNEL_INT8}, "stop"),
        # A longer (still right) answer may hit the limit. Ours where it builds, else torch's.
        ("int4", 32, {KERNEL_INT4_AVX2, KERNEL_INT4_CPU}, None),
    ],
)
def test_greedy_answer_mentions_paris(scheme, group_size, kernels, finish, smollm2_dir, build, engine_on):
    directory = smollm2_dir if scheme == "fp32" else build(smollm2_dir, scheme, group_size)
    engine = engine_on(directory, dtype="auto", max_context=512)
    assert set(engine.describe().kernel.split("+")) <= kernels
    events = list(engine.stream(engine.chat_prompt(QUESTION), SamplingParams(max_tokens=32, temperature=0)))
    text = "".join(e.text for e in events)
    assert "Paris" in text
    assert events[-1].finish_reason == (finish or events[-1].finish_reason)


def test_greedy_128_tokens_equal_transformers_generate(smollm2_dir, engine_on):
    from transformers import AutoModelForCausalLM

    engine = engine_on(smollm2_dir, max_context=512)
    prompt = engine.chat_prompt(
        [ChatMessage("user", "Write a long story about a robot who learns to paint.")]
    )
    tokens = [engine.prefill(0, prompt, SamplingParams(temperature=0))]
    tokens += [engine.step([0])[0] for _ in range(127)]
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # all 128 tokens, as the steps above
    ids = torch.tensor([prompt])
    # An explicit mask: the chat prompt holds <|im_end|> (id 2), which is also SmolLM2's pad id.
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, do_sample=False)
    assert tokens == out[0, len(prompt) :].tolist()
