"""The loader's memory: mapped weights leave the process's memory once copied."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deployer.agent.engines.torch import loader
from deployer.agent.engines.torch.loader import WeightFiles, load_model


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
