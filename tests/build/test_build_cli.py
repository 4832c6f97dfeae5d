"""`sits-deployer build` through click, on a deploy.yaml that names the tiny checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from deployer.cli.main import cli
from tests.build.conftest import EVAL_TEXT, store_is_empty

DEPLOY = """\
apiVersion: sits.dev/v1
kind: Deployment
application: tiny
model:
  name: tiny
  version: 1.0.0
  source: {source}
  quantization:
    scheme: int4
    group_size: 64
    overrides:
      - pattern: "*.mlp.*"
        scheme: int8
  quality_gate:
    eval_text: {eval_text}
    max_tokens: 64
    max_mean_kl: {limit}
    min_top1_agreement: 0.5
fleet:
  devices:
    - name: dev1
      transport: local
      root: ./fleet/dev1
"""


def _deploy(tmp_path: Path, source: Path, limit: float) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(DEPLOY.format(source=source, eval_text=EVAL_TEXT, limit=limit))
    return path


def test_build_then_cached_rebuild_as_json(tiny_model_dir, tmp_path):
    deploy = _deploy(tmp_path, tiny_model_dir, 1.0)
    runner = CliRunner()
    first = runner.invoke(cli, ["build", "-f", str(deploy), "--output", "json"])
    assert first.exit_code == 0, first.output
    built = json.loads(first.stdout)
    assert built["ok"] and not built["cached"] and built["quality"]["tokens"] == 64
    assert Path(built["artifact_dir"]).parent == tmp_path / ".sits" / "store" / "artifacts"
    manifest = json.loads((Path(built["artifact_dir"]) / "sits-manifest.json").read_text())
    assert manifest["quantization"]["modules"]["model.layers.0.mlp.up_proj"]["scheme"] == "int8"
    assert manifest["quantization"]["modules"]["model.layers.0.self_attn.q_proj"]["scheme"] == "int4"
    second = runner.invoke(cli, ["build", "-f", str(deploy)])
    assert second.exit_code == 0 and "cache hit, nothing rebuilt" in second.stderr
    assert built["artifact_id"] in second.stderr


def test_a_failing_gate_exits_1_with_a_report(tiny_model_dir, tmp_path):
    deploy = _deploy(tmp_path, tiny_model_dir, 0.0)
    result = CliRunner().invoke(cli, ["build", "-f", str(deploy), "--output", "json"])
    assert result.exit_code == 1, result.output
    assert json.loads(result.stdout)["ok"] is False
    assert "quality gate failed" in result.stderr and "FAILED: mean KL" in result.stderr
    assert store_is_empty(tmp_path / ".sits" / "store")


def test_awq_builds_and_records_its_calibration(tiny_model_dir, tmp_path):
    deploy = _deploy(tmp_path, tiny_model_dir, 1.0)
    deploy.write_text(
        deploy.read_text().replace("    group_size: 64\n", "    group_size: 64\n    awq: true\n")
    )
    result = CliRunner().invoke(cli, ["build", "-f", str(deploy), "--output", "json"])
    assert result.exit_code == 0, result.output
    built = json.loads(result.stdout)
    # int4-g64 attention (4.5 bits) and int8 MLP (8 bits and a scale per row)
    assert 4.5 < built["quality"]["bits_per_weight"] < 8.5
    manifest = json.loads((Path(built["artifact_dir"]) / "sits-manifest.json").read_text())
    assert manifest["format_version"] == 2
    assert set(manifest["quantization"]["spec"]["awq"]) == {"calibration_sha256", "tokens"}
