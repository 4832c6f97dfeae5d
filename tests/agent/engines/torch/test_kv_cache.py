"""agent.kv_cache_type in the torch engine: a KV cache stored at 16 bits or in int8 (per position
and head) decodes what the fp32 one does, attention still running in fp32 on a CPU."""

from __future__ import annotations

import pytest
import torch

from deployer.agent.engines.torch.loader import kv_cache_layout, load_model
from deployer.agent.types import SamplingParams
from deployer.errors import AgentError

GREEDY = SamplingParams(max_tokens=16, temperature=0)


def _logits(directory, kv_cache_type, prompt, steps):
    """Prefill `prompt` in slot 1, then decode `steps` greedy tokens there while slot 0 decodes
    beside it (a batched, masked step over both slots): the logits of slot 1 at every step."""
    loaded = load_model(
        directory, device="cpu", dtype="fp32", max_context=64, slots=2, kv_cache_type=kv_cache_type
    )
    model, out = loaded.model, []
    with torch.inference_mode():
        model.prefill(torch.tensor([[3, 4]]), slot=0, start=0)
        logits = model.prefill(torch.tensor([prompt]), slot=1, start=0)[0, -1]
        tokens, pos = torch.tensor([5, int(logits.argmax())]), torch.tensor([2, len(prompt)])
        for _ in range(steps):
            out.append(logits)
            step = model.decode(tokens, pos, kv_len=int(pos.max()) + 1)
            logits = step[1]
            tokens, pos = step.argmax(-1), pos + 1
    return loaded, torch.stack(out)


@pytest.mark.parametrize("kv_cache_type", ["fp16", "bf16", "int8"])
def test_a_narrower_cache_decodes_what_fp32_does(varied_model_dir, kv_cache_type):
    prompt = [7, 12, 30, 41, 9, 18]
    _, reference = _logits(varied_model_dir, "fp32", prompt, 12)
    loaded, logits = _logits(varied_model_dir, kv_cache_type, prompt, 12)
    cache = loaded.model.model.layers[0].self_attn.kv_cache
    stored = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}[kv_cache_type]
    assert (cache.k.dtype, cache.v.dtype, loaded.model.kv_dtype) == (stored, stored, torch.float32)
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))  # the same greedy tokens
    # Each step's distribution stays close: int8 keeps about 2 significant digits of each value.
    spread = (reference.max(-1).values - reference.min(-1).values).mean()
    error = (logits - reference).abs().max() / spread
    assert error < {"fp16": 1e-3, "bf16": 1e-2, "int8": 3e-2}[kv_cache_type]
    assert error > 0  # the cache really was narrower


def test_int8_cache_quantizes_each_position_and_head_on_its_own_scale(varied_model_dir):
    loaded, _ = _logits(varied_model_dir, "int8", [7, 12, 30], 2)
    cache = loaded.model.model.layers[0].self_attn.kv_cache
    assert cache.k_scale is not None
    keys, _ = cache.read((slice(1, 2), slice(None), slice(0, 4)))
    stored = cache.k[1:2, :, :4]
    # Every position and head uses its whole int8 range, on a scale of its own.
    assert stored.abs().amax(-1).eq(127).all()
    assert len(set(cache.k_scale[1, :, :4].flatten().tolist())) == keys.shape[1] * 4
    assert keys.dtype == torch.float32


def test_prefix_copy_carries_an_int8_cache_scales(varied_model_dir):
    loaded, _ = _logits(varied_model_dir, "int8", [7, 12, 30, 41], 1)
    model = loaded.model
    model.copy_prefix(1, 0, 4)
    for layer in model.model.layers:
        cache = layer.self_attn.kv_cache
        copied, source = cache.read((0, slice(None), slice(0, 4))), cache.read((1, slice(None), slice(0, 4)))
        assert torch.equal(copied[0], source[0]) and torch.equal(copied[1], source[1])


def test_engine_streams_the_fp32_cache_greedy_text(varied_model_dir, engine_on):
    reference = engine_on(varied_model_dir)
    engine = engine_on(varied_model_dir, kv_cache_type="fp16")
    prompt = reference.encode("The capital of")
    assert [e.token_id for e in engine.stream(prompt, GREEDY)] == [
        e.token_id for e in reference.stream(prompt, GREEDY)
    ]
    assert engine.describe().extra["kv_cache"] == "fp16"


def test_int8_cache_keeps_every_clear_greedy_choice(varied_model_dir, engine_on):
    """int8 moves this wide random model's logits by up to about 0.2 (fp16: 0.015), so a step
    whose two best tokens lie closer may flip; every other step, and the first ones, agree."""
    reference = engine_on(varied_model_dir)
    engine = engine_on(varied_model_dir, kv_cache_type="int8")
    prompt = reference.encode("The capital of")
    expected = [e.token_id for e in reference.stream(prompt, GREEDY)]
    assert [e.token_id for e in engine.stream(prompt, GREEDY)][:3] == expected[:3]
    ids = prompt + expected
    exact, int8 = reference.logits(ids)[len(prompt) - 1 :], engine.logits(ids)[len(prompt) - 1 :]
    bound = 0.5
    assert 0 < (int8 - exact).abs().max() < bound
    top = exact.topk(2, dim=-1).values
    clear = top[:, 0] - top[:, 1] > bound
    assert clear.sum() >= len(expected) // 2
    assert torch.equal(int8.argmax(-1)[clear], exact.argmax(-1)[clear])
    assert engine.describe().extra["kv_cache"] == "int8"


def test_cache_layout_per_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert kv_cache_layout("auto", cpu, torch.bfloat16) == ("fp32", torch.float32)
    assert kv_cache_layout("int8", cpu, torch.bfloat16) == ("int8", torch.float32)
    assert kv_cache_layout("fp16", cpu, torch.float32) == ("fp16", torch.float32)
    # On CUDA attention runs in the cache's dtype, the model's unless told (as before the setting).
    assert kv_cache_layout("auto", cuda, torch.bfloat16) == ("bf16", torch.bfloat16)
    assert kv_cache_layout("fp16", cuda, torch.bfloat16) == ("fp16", torch.float16)
    with pytest.raises(AgentError, match="int8 is for CPU devices"):
        kv_cache_layout("int8", cuda, torch.bfloat16)
    with pytest.raises(AgentError, match="unknown kv_cache_type"):
        kv_cache_layout("q4", cpu, torch.float32)


def test_engines_refuse_a_kv_cache_type_they_cannot_store():
    from deployer.agent.engines import make_engine
    from deployer.agent.engines.torch.engine import TorchEngine

    with pytest.raises(AgentError, match="kv_cache_type int8 is the torch engine's"):
        make_engine("llama.cpp", kv_cache_type="int8")
    with pytest.raises(AgentError, match="kv_cache_type must be auto or one of"):
        TorchEngine(kv_cache_type="q4_0")
