"""`model.adapters` in deploy.yaml: each PEFT adapter is checked against its base, and every problem
is a finding at the adapter's line and column, naming the file and tensor at fault."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deployer.build.demo_model import make_tiny_checkpoint
from deployer.config import validate_file
from tests.agent.lora_helpers import make_peft_adapter

# `source:` of the first adapter sits on line 9, its value at column 15 (see _config).
AT = (9, 15, "model.adapters[0].source")


@pytest.fixture(scope="module")
def peft_adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank-4 q/v LoRA adapter of the tiny model, made by peft."""
    return make_peft_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapter") / "summarise", seed=0)


@pytest.fixture(scope="module")
def narrow_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An adapter of another base: the tiny model's layout with hidden size 32, not 64."""
    base = make_tiny_checkpoint(tmp_path_factory.mktemp("narrow-base"), hidden_size=32)
    return make_peft_adapter(base, tmp_path_factory.mktemp("narrow") / "narrow", seed=0)


def _config(tmp_path: Path, base: Path, adapters: list[tuple[str, Path]]) -> Path:
    lines = [
        "application: demo",
        "model:",
        "  name: m",
        "  version: 1.0.0",
        f"  source: {base}",
        "  adapters:",
    ]
    for name, source in adapters:
        lines += [f"    - name: {name}", "      version: 1.0.0", f"      source: {source}"]
    lines += ["fleet:", "  devices:", "    - {name: d1, transport: local, root: ./d1}", ""]
    path = tmp_path / "deploy.yaml"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def _errors(path: Path) -> list:
    return [f for f in validate_file(path, environ={}) if f.is_error]


def _copy(adapter: Path, tmp_path: Path, **config_changes: object) -> Path:
    copy = Path(shutil.copytree(adapter, tmp_path / "copy"))
    config = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**config, **config_changes}))
    return copy


def test_an_adapter_of_this_base_validates(tmp_path, tiny_model_dir, peft_adapter):
    assert _errors(_config(tmp_path, tiny_model_dir, [("summarise", peft_adapter)])) == []


def test_an_adapter_trained_on_another_base_is_refused(tmp_path, tiny_model_dir, peft_adapter):
    adapter = _copy(peft_adapter, tmp_path, base_model_name_or_path="meta-llama/Meta-Llama-3-8B")
    [found] = _errors(_config(tmp_path, tiny_model_dir, [("summarise", adapter)]))
    assert (found.line, found.column, found.path) == AT
    assert "was trained on 'meta-llama/Meta-Llama-3-8B', not on this base" in found.message


def test_a_rank_that_does_not_match_the_tensors_names_the_tensor(tmp_path, tiny_model_dir, peft_adapter):
    adapter = _copy(peft_adapter, tmp_path, r=8)
    found = _errors(_config(tmp_path, tiny_model_dir, [("summarise", adapter)]))
    assert {(f.line, f.column, f.path) for f in found} == {AT}
    assert (
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight has shape [4, 64], "
        "expected [8, 64]" in found[0].message
    )


def test_an_adapter_of_another_shape_is_refused(tmp_path, tiny_model_dir, narrow_adapter):
    adapter = _copy(narrow_adapter, tmp_path, base_model_name_or_path=str(tiny_model_dir))
    found = _errors(_config(tmp_path, tiny_model_dir, [("narrow", adapter)]))
    assert found and {(f.line, f.column) for f in found} == {AT[:2]}
    assert "lora_A.weight has shape [4, 32], expected [4, 64]" in found[0].message


def test_a_module_the_base_lacks_is_named(tmp_path, tiny_model_dir, peft_adapter):
    from safetensors.torch import load_file, save_file

    adapter = _copy(peft_adapter, tmp_path)
    tensors = load_file(adapter / "adapter_model.safetensors")
    renamed = {
        k.replace("layers.1.self_attn.q_proj", "layers.7.self_attn.q_proj"): v for k, v in tensors.items()
    }
    save_file(renamed, adapter / "adapter_model.safetensors")
    [found] = _errors(_config(tmp_path, tiny_model_dir, [("summarise", adapter)]))
    assert "targets module(s) the base does not have: model.layers.7.self_attn.q_proj" in found.message
    assert "in layers 0-1" in (found.hint or "")


def test_names_are_unique_and_not_the_base(tmp_path, tiny_model_dir, peft_adapter):
    found = _errors(
        _config(tmp_path, tiny_model_dir, [("m", peft_adapter), ("s", peft_adapter), ("s", peft_adapter)])
    )
    assert sorted((f.line, f.path, f.message.split(" (")[0]) for f in found) == [
        (7, "model.adapters[0].name", "adapter name 'm' is the base model's name"),
        (13, "model.adapters[2].name", "duplicate adapter name 's'"),
    ]


def test_a_missing_adapter_directory_is_found(tmp_path, tiny_model_dir):
    [found] = _errors(_config(tmp_path, tiny_model_dir, [("s", tmp_path / "nowhere")]))
    assert (found.line, found.column) == AT[:2]
    assert "has no adapter_config.json and adapter_model.safetensors" in found.message


def test_the_builtin_base_refuses_an_adapter_of_the_tiny_model(tmp_path, peft_adapter):
    path = _config(tmp_path, Path("builtin:smollm2-135m-instruct"), [("s", peft_adapter)])
    path.write_text(
        path.read_text().replace(
            f"source: {Path('builtin:smollm2-135m-instruct')}", "source: builtin:smollm2-135m-instruct"
        )
    )
    [found] = _errors(path)
    assert "not on this base (builtin:smollm2-135m-instruct)" in found.message


def test_loaded_adapters_count_in_the_memory_estimate_and_can_push_it_over_a_profile(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A rank-64 adapter on every projection of the tiny model: its factors, in fp32 as the engine
    holds them, are what tips the model over a profile sized between the two needs."""
    import yaml
    from safetensors.numpy import load_file

    from deployer.config import load_config
    from deployer.config.estimate import ModelShape, estimate_memory
    from deployer.config.quantity import format_bytes

    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    wide = make_peft_adapter(tiny_model_dir, tmp_path / "wide", seed=0, rank=64, targets=every)
    factors = 4 * sum(t.size for t in load_file(wide / "adapter_model.safetensors").values())
    path = _config(tmp_path, tiny_model_dir, [("wide", wide)])
    config = load_config(path, environ={})
    shape = ModelShape.from_config_json(tiny_model_dir / "config.json")
    alone = estimate_memory(shape, config.model.model_copy(update={"adapters": []}), config.agent).total

    def profile_errors(memory: int) -> list:
        doc = yaml.safe_load(path.read_text())
        doc["fleet"]["devices"][0]["profile"] = "small"
        doc["profiles"] = {"small": {"memory": memory}}
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return [f for f in _errors(path) if f.path == "profiles.small.memory"]

    [finding] = profile_errors(alone + factors // 2)
    assert f"needs about {format_bytes(alone + factors)}" in finding.message, finding.message
    assert f"LoRA adapters {format_bytes(factors)}" in finding.message, finding.message
    assert "fewer or lower-rank LoRA adapters" in finding.hint
    assert profile_errors(alone + factors) == []  # exactly enough room for the adapter
