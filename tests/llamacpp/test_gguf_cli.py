"""`agent.engine: llama.cpp`: validate asks for a GGUF-capable quantization, and build makes a GGUF."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from deployer.build.gguf_writer import GGUF_NAME
from deployer.cli.main import cli
from deployer.core.gguf_io import read_gguf_header

DEPLOY = """\
apiVersion: sits.dev/v1
kind: Deployment
application: tiny
model:
  name: tiny
  version: 1.0.0
  source: {source}
  quantization:
    scheme: {scheme}
    group_size: {group_size}
fleet:
  devices:
    - name: dev1
      transport: local
      root: ./fleet/dev1
agent:
  engine: llama.cpp
"""


def _deploy(tmp_path: Path, source: Path, scheme: str, group_size: int) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(DEPLOY.format(source=source, scheme=scheme, group_size=group_size))
    return path


def test_validate_refuses_int4_groups_gguf_cannot_hold(tiny_model_dir, tmp_path):
    deploy = _deploy(tmp_path, tiny_model_dir, "int4", 128)
    result = CliRunner().invoke(cli, ["validate", "-f", str(deploy), "--output", "json"])
    assert result.exit_code == 1
    findings = json.loads(result.stdout)
    (finding,) = [f for f in findings if "llama.cpp needs int4 with group size 32" in f["message"]]
    assert "not 128" in finding["message"]
    assert finding["line"] == 10  # the group_size line of deploy.yaml


def test_validate_accepts_int4_in_groups_of_32(tiny_model_dir, tmp_path):
    deploy = _deploy(tmp_path, tiny_model_dir, "int4", 32)
    result = CliRunner().invoke(cli, ["validate", "-f", str(deploy), "--output", "json"])
    assert result.exit_code == 0, result.output


def test_build_makes_a_gguf_artifact_for_the_llama_cpp_engine(tiny_model_dir, tmp_path):
    deploy = _deploy(tmp_path, tiny_model_dir, "int4", 32)
    result = CliRunner().invoke(cli, ["build", "-f", str(deploy), "--output", "json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    artifact = Path(summary["artifact_dir"])
    header = read_gguf_header(artifact / GGUF_NAME)
    assert {t.dtype for t in header.tensors if t.name.startswith("blk.") and len(t.shape) == 2} == {"Q4_1"}
    assert summary["bytes_written"] == (artifact / GGUF_NAME).stat().st_size
