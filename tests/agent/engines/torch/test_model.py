"""Our Llama-family model against transformers on the same weights, and the KV cache against
full recomputation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deployer.errors import AgentError, FormatError

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
PROMPT = "The capital of France is Paris. Edge devices run small language models."


def hf_logits(directory: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


def test_llama_logits_match_transformers(tiny_model_dir, tiny_engine):
    ids = tiny_engine.encode(PROMPT)
    assert len(ids) > 10
    torch.testing.assert_close(tiny_engine.logits(ids), hf_logits(tiny_model_dir, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        ("qwen2", {}),  # q/k/v biases
        ("mistral", {"sliding_window": 6}),  # a window shorter than the prompt
        ("llama", {"attention_bias": True, "head_dim": 32, "rope_theta": 500000.0}),
        # Llama 3's rope scaling, its three bands (kept, interpolated, stretched) all in use
        ("llama", {"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE}),
    ],
)
def test_other_architectures_match_transformers(
    kind, extra, tiny_model_dir, tmp_path, hf_checkpoint, engine_on
):
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        kind,
        vocab_size=json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"],
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        **extra,
    )
    directory = hf_checkpoint(tmp_path / kind, config, tiny_model_dir)
    engine = engine_on(directory)
    ids = engine.encode(PROMPT)
    if kind == "qwen2":
        assert any(n.endswith("q_proj.bias") for n in load_file(directory / "model.safetensors"))
    torch.testing.assert_close(engine.logits(ids), hf_logits(directory, ids), atol=1e-4, rtol=0)


def test_kv_cache_decode_equals_full_recompute(tiny_engine):
    ids = tiny_engine.encode(PROMPT)
    full = tiny_engine.logits(ids)
    model, split = tiny_engine._require().loaded.model, 5
    # prefill the first tokens, then decode one position at a time on the cache (batched path)
    with torch.inference_mode():
        stepwise = [model.prefill(torch.tensor([ids[:split]]), 0, 0)[0, -1]]
        for pos in range(split, len(ids)):
            stepwise.append(model.decode(torch.tensor([ids[pos]]), torch.tensor([pos]))[0])
    torch.testing.assert_close(torch.stack(stepwise), full[split - 1 :], atol=1e-5, rtol=0)


def test_fixed_shape_prefill_equals_eager_prefill(tiny_engine):
    # What a CUDA prefill graph runs: a padded chunk, the slot and positions as tensors.
    ids = tiny_engine.encode(PROMPT)
    full = tiny_engine.logits(ids)
    model, split, length = tiny_engine._require().loaded.model, 4, 32
    chunk = ids[split:]
    assert len(chunk) < length
    pad = length - len(chunk)
    with torch.inference_mode():
        model.prefill(torch.tensor([ids[:split]]), 2, 0)
        got = model.prefill_fixed(
            torch.tensor([chunk + [0] * pad]),
            torch.tensor([2]),
            torch.tensor(list(range(split, len(ids))) + [model.scratch_position] * pad),
            torch.tensor([len(chunk) - 1]),
        )[0]
        # the cache holds the chunk: the next position decodes as after a full prefill
        after = model.decode(
            torch.tensor([0, 0, ids[-1]]), torch.tensor([model.scratch_position] * 2 + [len(ids)])
        )
    torch.testing.assert_close(got, full[-1], atol=1e-5, rtol=0)
    want = tiny_engine.logits([*ids, ids[-1]])[-1]
    torch.testing.assert_close(after[2], want, atol=1e-5, rtol=0)


def _copy_with_config(src: Path, dest: Path, **changes: object) -> Path:
    shutil.copytree(src, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(changes)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope scaling ['linear']"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "llama3 rope scaling needs low_freq_factor",
        ),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope scaling ['yarn']"),
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_configs_are_refused_clearly(changes, message, tiny_model_dir, tmp_path, engine_on):
    directory = _copy_with_config(tiny_model_dir, tmp_path / "m", **changes)
    with pytest.raises((AgentError, FormatError), match=message.replace("[", r"\[").replace("]", r"\]")):
        engine_on(directory)


def test_rope_scaling_none_and_default_are_accepted(tiny_model_dir, tmp_path, engine_on):
    directory = _copy_with_config(
        tiny_model_dir, tmp_path / "m", rope_scaling=None, rope_parameters={"rope_type": "default"}
    )
    ids = engine_on(directory).encode(PROMPT)
    assert engine_on(directory).logits(ids).shape[0] == len(ids)


def test_missing_and_extra_tensors_are_format_errors(tiny_model_dir, tmp_path, engine_on):
    state = load_file(tiny_model_dir / "model.safetensors")
    missing = _copy_with_config(tiny_model_dir, tmp_path / "missing")
    save_file(
        {k: v for k, v in state.items() if "layers.1.mlp.up_proj" not in k}, missing / "model.safetensors"
    )
    with pytest.raises(FormatError, match=r"layers\.1\.mlp\.up_proj\.weight.*missing"):
        engine_on(missing)
    extra = _copy_with_config(tiny_model_dir, tmp_path / "extra")
    save_file({**state, "model.layers.9.foo.weight": torch.zeros(2)}, extra / "model.safetensors")
    with pytest.raises(FormatError, match=r"not used by the model: model\.layers\.9\.foo\.weight"):
        engine_on(extra)


def test_truncated_weights_are_refused(tiny_model_dir, tmp_path, engine_on):
    directory = _copy_with_config(tiny_model_dir, tmp_path / "cut")
    data = (directory / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(FormatError, match=r"truncated|past the end"):
        engine_on(directory)


def test_context_is_capped_by_constructor(tiny_model_dir, engine_on):
    engine = engine_on(tiny_model_dir, max_context=32)
    assert engine.describe().context_length == 32
    # the model itself allows 512
    assert json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"] == 512


def test_weights_that_contradict_config_are_refused(tiny_model_dir, tmp_path, engine_on):
    directory = _copy_with_config(tiny_model_dir, tmp_path / "m", intermediate_size=128)
    with pytest.raises(
        FormatError, match=r"gate_proj: weights are \[160, 64\] but config.json implies \[128, 64\]"
    ):
        engine_on(directory)
    untied = _copy_with_config(tiny_model_dir, tmp_path / "untied", tie_word_embeddings=False)
    with pytest.raises(FormatError, match=r"lm_head\.weight is missing"):
        engine_on(untied)
