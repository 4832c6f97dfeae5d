"""The loader's memory: mapped weights leave the process's memory once copied."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deployer.agent.engines.torch import loader
from deployer.agent.engines.torch.loader import WeightFiles, load_model
from deployer.agent.engines.torch.qlinear import KERNEL_LINEAR
from deployer.errors import FormatError


def _resident_file_bytes() -> int:
    """RssFile of this process: the mapped file pages it holds."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_released_tensors_leave_memory_and_still_read_back(tmp_path: Path) -> None:
    big = torch.randn(4096, 4096)  # 64 MiB
    small = torch.ones(3, dtype=torch.float32)
    save_file({"big": big, "small": small}, str(tmp_path / "model.safetensors"))
    weights = WeightFiles(tmp_path)
    mapped = weights.require("big")
    assert torch.equal(mapped, big)  # every page read
    before = _resident_file_bytes()
    weights.release(["big", "absent"])
    assert before - _resident_file_bytes() > 48 * 2**20
    # Never written, a view of released pages reads the file again: nothing is lost.
    assert torch.equal(mapped, big) and torch.equal(weights.require("small"), small)


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_a_load_releases_every_tensor_it_copies(
    scheme: str, tiny_model_dir: Path, build, monkeypatch: pytest.MonkeyPatch
) -> None:
    artifact = build(tiny_model_dir, scheme, 32)
    released: set[str] = set()
    original = WeightFiles.release

    def spy(self: WeightFiles, names) -> None:
        names = list(names)
        released.update(n for n in names if n in self.names())
        original(self, names)

    monkeypatch.setattr(loader.WeightFiles, "release", spy)
    load_model(artifact, device="cpu", dtype="auto", max_context=64)
    stored = WeightFiles(artifact).names()
    assert released == stored


def test_a_cpu_load_looks_up_the_embedding_in_the_mapped_file(
    tiny_model_dir: Path, build, monkeypatch: pytest.MonkeyPatch
) -> None:
    artifact = build(tiny_model_dir, "int4", 32)  # fp16 embedding, tied head
    views: dict[str, int] = {}
    original = WeightFiles.get

    def spy(self: WeightFiles, name: str) -> torch.Tensor | None:
        tensor = original(self, name)
        if tensor is not None:
            views[name] = tensor.data_ptr()
        return tensor

    monkeypatch.setattr(loader.WeightFiles, "get", spy)
    loaded = load_model(artifact, device="cpu", dtype="auto", max_context=64)
    table = loaded.model.model.embed_tokens
    # No copy: the parameter is the view of the file, in the stored dtype.
    assert table.weight.data_ptr() == views["model.embed_tokens.weight"]
    assert (table.weight.dtype, loaded.dtype) == (torch.float16, torch.bfloat16)
    rows = table(torch.tensor([[1, 2]]))
    assert rows.dtype == torch.bfloat16
    assert torch.equal(rows[0, 1], table.weight[2].to(torch.bfloat16))
    assert loaded.kernels["lm_head"] != KERNEL_LINEAR  # the int8 head, quantized from the same view


def test_release_rows_drops_only_those_rows_pages(tmp_path: Path) -> None:
    big = torch.randn(4096, 4096)  # 64 MiB, 16 KiB a row
    save_file({"big": big}, str(tmp_path / "model.safetensors"))
    weights = WeightFiles(tmp_path)
    mapped = weights.require("big")
    assert torch.equal(mapped, big)
    before = _resident_file_bytes()
    weights.release_rows("big", 0, 2048)
    dropped = before - _resident_file_bytes()
    assert 24 * 2**20 < dropped < 40 * 2**20
    assert torch.equal(mapped, big)


def test_an_int8_head_of_the_wrong_shape_is_refused(tiny_model_dir: Path, build, tmp_path: Path) -> None:
    directory = shutil.copytree(build(tiny_model_dir, "int4", 32), tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    vocab = config["vocab_size"]
    (directory / "config.json").write_text(json.dumps(config | {"vocab_size": vocab + 64}))
    with pytest.raises(
        FormatError, match=rf"embed_tokens\.weight: weights are \[{vocab}, .*implies \[{vocab + 64}"
    ):
        load_model(directory, device="cpu", dtype="auto", max_context=64)
