"""deployer/core/lora.py: PEFT adapters in, sits-lora artifacts out and back, bad inputs refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from deployer.core.lora import LoraAdapter, from_peft, read_adapter, write_adapter
from deployer.errors import FormatError
from tests.agent.lora_helpers import make_peft_adapter

Q0 = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def peft_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real PEFT adapter (rank 4 on q/v) of the tiny model. Read-only."""
    return make_peft_adapter(tiny_model_dir, tmp_path_factory.mktemp("peft"), seed=3)


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def test_from_peft_reads_every_factor_in_peft_naming(peft_dir: Path, tiny_model_dir: Path) -> None:
    adapter = from_peft(peft_dir, "summarise", "1", "sha256:base")
    layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
    assert adapter.target_modules == tuple(
        sorted(f"model.layers.{i}.self_attn.{p}" for i in range(layers) for p in ("q_proj", "v_proj"))
    )
    assert (adapter.rank, adapter.alpha, adapter.factor) == (4, 8.0, 2.0)
    raw = load_file(str(peft_dir / "adapter_model.safetensors"))
    a, b = adapter.tensors[Q0]
    assert a.dtype == np.float16 and b.dtype == np.float16
    np.testing.assert_array_equal(a, raw[f"base_model.model.{Q0}.lora_A.weight"].astype(np.float16))
    np.testing.assert_array_equal(b, raw[f"base_model.model.{Q0}.lora_B.weight"].astype(np.float16))
    assert np.abs(b).max() > 0  # the helper's B is not PEFT's zero init


def test_write_then_read_gives_the_same_adapter_and_the_same_bytes(peft_dir: Path, tmp_path: Path) -> None:
    adapter = from_peft(peft_dir, "summarise", "1.2", "sha256:base", scale=0.5)
    write_adapter(adapter, tmp_path / "one")
    write_adapter(adapter, tmp_path / "two")
    for name in ("adapter.json", "adapter.safetensors"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    back = read_adapter(tmp_path / "one")
    assert (back.name, back.version, back.base_artifact_id, back.rank, back.alpha, back.scale) == (
        "summarise",
        "1.2",
        "sha256:base",
        4,
        8.0,
        0.5,
    )
    assert back.target_modules == adapter.target_modules
    for module, (a, b) in adapter.tensors.items():
        np.testing.assert_array_equal(back.tensors[module][0], a)
        np.testing.assert_array_equal(back.tensors[module][1], b)
    # The file is plain safetensors: the library reads it.
    assert set(load_file(str(tmp_path / "one" / "adapter.safetensors"))) == {
        f"{m}.lora_{x}" for m in adapter.target_modules for x in "AB"
    }
    assert back.nbytes == adapter.nbytes > 0


def test_a_rank_that_does_not_match_the_config_names_file_and_tensor(peft_dir: Path, tmp_path: Path) -> None:
    bad = _copy(peft_dir, tmp_path / "peft")
    config = json.loads((bad / "adapter_config.json").read_text())
    config["r"] = 8
    (bad / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(
        FormatError, match=r"adapter_model\.safetensors: tensor '.*lora_A\.weight' has rank 4"
    ):
        from_peft(bad, "x", "1", "base")


def test_nan_in_a_factor_is_refused_with_its_tensor(peft_dir: Path, tmp_path: Path) -> None:
    bad = _copy(peft_dir, tmp_path / "peft")
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    key = f"base_model.model.{Q0}.lora_B.weight"
    tensors[key] = tensors[key].copy()
    tensors[key][0, 0] = np.nan
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(FormatError, match=rf"tensor '{key}' holds NaN"):
        from_peft(bad, "x", "1", "base")


def test_a_missing_tensor_is_refused_in_peft_and_in_the_artifact(peft_dir: Path, tmp_path: Path) -> None:
    bad = _copy(peft_dir, tmp_path / "peft")
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    key = f"base_model.model.{Q0}.lora_A.weight"
    del tensors[key]
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(FormatError, match=rf"tensor '{key}' is missing"):
        from_peft(bad, "x", "1", "base")

    artifact = tmp_path / "artifact"
    write_adapter(from_peft(peft_dir, "x", "1", "base"), artifact)
    stored = load_file(str(artifact / "adapter.safetensors"))
    del stored[f"{Q0}.lora_B"]
    save_file(stored, str(artifact / "adapter.safetensors"))
    with pytest.raises(FormatError, match=rf"adapter\.safetensors: tensor '{Q0}\.lora_B' is missing"):
        read_adapter(artifact)


def test_an_artifact_whose_factors_lie_about_rank_or_values_is_refused(
    peft_dir: Path, tmp_path: Path
) -> None:
    adapter = from_peft(peft_dir, "x", "1", "base")
    a, b = adapter.tensors[Q0]
    for label, tensors, pattern in (
        ("rank", {**adapter.tensors, Q0: (a[:2], b)}, rf"tensor '{Q0}\.lora_A' has rank 2"),
        ("inf", {**adapter.tensors, Q0: (a, np.full_like(b, np.inf))}, r"does not fit in float16"),
    ):
        with pytest.raises(FormatError, match=pattern):
            write_adapter(LoraAdapter(**{**adapter.__dict__, "tensors": tensors}), tmp_path / label)
            read_adapter(tmp_path / label)
    write_adapter(adapter, tmp_path / "ok")
    meta = json.loads((tmp_path / "ok" / "adapter.json").read_text())
    (tmp_path / "ok" / "adapter.json").write_text(json.dumps({**meta, "name": "../escape"}))
    with pytest.raises(FormatError, match=r"adapter\.json: not a valid adapter description: name"):
        read_adapter(tmp_path / "ok")


def test_peft_options_the_format_cannot_carry_are_refused(peft_dir: Path, tmp_path: Path) -> None:
    bad = _copy(peft_dir, tmp_path / "peft")
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(FormatError, match="use_dora is set"):
        from_peft(bad, "x", "1", "base")
    with pytest.raises(FormatError, match="not a valid model id"):
        from_peft(peft_dir, "a/b", "1", "base")


def test_bf16_peft_factors_are_read(peft_dir: Path, tmp_path: Path) -> None:
    """PEFT saves in the model's dtype; numpy has no bfloat16, the reader widens it itself."""
    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file as save_torch

    bf16 = _copy(peft_dir, tmp_path / "peft")
    tensors = {
        k: v.to(torch.bfloat16) for k, v in load_torch(str(bf16 / "adapter_model.safetensors")).items()
    }
    save_torch(tensors, str(bf16 / "adapter_model.safetensors"))
    adapter = from_peft(bf16, "x", "1", "base")
    expected = tensors[f"base_model.model.{Q0}.lora_B.weight"].to(torch.float16).numpy()
    np.testing.assert_array_equal(adapter.tensors[Q0][1], expected)
