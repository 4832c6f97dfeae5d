"""validate refuses a model the engines do not run, with the reason, before anything is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deployer.config import validate_file

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "architecture ['GPT2LMHeadModel']"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope scaling 'linear'"),
    ],
)
def test_validate_refuses_an_unsupported_model_with_the_reason(
    write_config, tmp_path: Path, edit: dict, reason: str
) -> None:
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(LLAMA | edit))
    (source / "model.safetensors").write_bytes(b"")
    path = write_config(replace=(("source: builtin:smollm2-135m-instruct", "source: model"),))
    [finding] = [f for f in validate_file(path, {}) if f.is_error]
    assert (finding.line, finding.column, finding.path) == (5, 11, "model.source")
    assert reason in finding.message and "not supported" in finding.message


@pytest.mark.parametrize(
    "edit",
    [
        {},
        {"rope_scaling": {"rope_type": "llama3"}},
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
    ],
)
def test_supported_models_pass(write_config, tmp_path: Path, edit: dict) -> None:
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(LLAMA | edit))
    (source / "model.safetensors").write_bytes(b"")
    path = write_config(replace=(("source: builtin:smollm2-135m-instruct", "source: model"),))
    assert not [f for f in validate_file(path, {}) if f.is_error]
