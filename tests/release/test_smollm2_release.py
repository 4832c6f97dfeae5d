"""The whole release path on real SmolLM2-135M-Instruct artifacts, through the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file

from deployer.cli.main import cli
from tests.release.helpers import build, tree

pytestmark = pytest.mark.slow


def _last_layers_changed(src: Path, dest: Path) -> Path:
    """A copy of `src` whose last decoder layer's MLP moved a little (a partial fine-tune)."""
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(".*"))
    tensors = load_file(str(src / "model.safetensors"))
    rng = np.random.default_rng(0)
    for name in ("model.layers.29.mlp.up_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        t = tensors[name]
        tensors[name] = t + (rng.standard_normal(t.shape) * 1e-3).astype(t.dtype)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def test_smollm2_int8_delta_release_apply(smollm2_dir, tmp_path):
    v1 = build(smollm2_dir, tmp_path / "store", "1.0.0")
    v2 = build(_last_layers_changed(smollm2_dir, tmp_path / "src-v2"), tmp_path / "store", "1.1.0")
    patch, rel, out = tmp_path / "p.patch", tmp_path / "release.json", tmp_path / "staging"
    env = {"SITS_SIGNING_PASSPHRASE": "a long test passphrase"}
    runner = CliRunner()
    for args in (
        ["keygen", "-o", str(tmp_path / "k")],
        ["delta", "--from", str(v1), "--to", str(v2), "-o", str(patch)],
        [
            "release",
            str(v2),
            "--counter",
            "2",
            "--base",
            str(v1),
            "--patch",
            str(patch),
            "--key",
            str(tmp_path / "k.key"),
            "-o",
            str(rel),
        ],
        [
            "verify",
            str(rel),
            "--trusted-key",
            str(tmp_path / "k.pub"),
            "--installed",
            str(v1),
            "--installed-counter",
            "1",
            "--patch",
            str(patch),
            "--artifact",
            str(v2),
        ],
        [
            "patch-apply",
            "--base",
            str(v1),
            "--patch",
            str(patch),
            "-o",
            str(out),
            "--manifest",
            str(rel),
            "--trusted-key",
            str(tmp_path / "k.pub"),
            "--installed-counter",
            "1",
        ],
    ):
        result = runner.invoke(cli, args, env=env)
        assert result.exit_code == 0, result.stderr
    assert tree(out) == tree(v2)
    # Two changed int8 tensors of a 160 MB artifact: the patch is a small fraction of it.
    weights = (v2 / "model.safetensors").stat().st_size
    assert patch.stat().st_size < weights / 50
    assert json.loads(rel.read_text())["signed"]["patch"]["size"] == patch.stat().st_size
