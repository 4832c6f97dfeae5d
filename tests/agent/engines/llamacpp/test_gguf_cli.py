"""`agent.engine: llama.cpp`: validate asks for a GGUF-capable quantization, and build makes a GGUF
(int4 as Q4_1, or Q4_0 when `quantization.gguf_int4` says so)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
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
{quantization}fleet:
  devices:
    - name: dev1
      transport: local
      root: ./fleet/dev1
agent:
  engine: {engine}
"""


def _deploy(
    tmp_path: Path,
    source: Path,
    scheme: str,
    group_size: int,
    *,
    gguf_int4: str = "",
    engine: str = "llama.cpp",
) -> Path:
    path = tmp_path / "deploy.yaml"
    quantization = f"    gguf_int4: {gguf_int4}\n" if gguf_int4 else ""
    text = DEPLOY.format(
        source=source, scheme=scheme, group_size=group_size, quantization=quantization, engine=engine
    )
    path.write_text(text)
    return path


def _validate(deploy: Path) -> tuple[int, list[dict]]:
    result = CliRunner().invoke(cli, ["validate", "-f", str(deploy), "--output", "json"])
    findings = json.loads(result.stdout) if result.exit_code else []
    return result.exit_code, [f for f in findings if f.get("severity", "error") == "error"]


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


def test_validate_accepts_gguf_int4_q4_0_for_int4_on_llama_cpp(tiny_model_dir, tmp_path):
    assert _validate(_deploy(tmp_path, tiny_model_dir, "int4", 32, gguf_int4="Q4_0")) == (0, [])


def test_validate_refuses_a_gguf_type_the_builder_cannot_write(tiny_model_dir, tmp_path):
    code, findings = _validate(_deploy(tmp_path, tiny_model_dir, "int4", 32, gguf_int4="Q4_K"))
    assert code == 1
    (finding,) = [f for f in findings if f["path"] == "model.quantization.gguf_int4"]
    assert "Q4_K" in finding["message"] and "Q4_0" in finding["message"]
    assert finding["line"] == 11


@pytest.mark.parametrize(
    ("scheme", "engine", "why"),
    [("int4", "torch", "agent.engine is not llama.cpp"), ("int8", "llama.cpp", "no weight is int4")],
)
def test_validate_flags_a_gguf_int4_that_would_be_ignored(tiny_model_dir, tmp_path, scheme, engine, why):
    code, findings = _validate(_deploy(tmp_path, tiny_model_dir, scheme, 32, gguf_int4="Q4_0", engine=engine))
    assert code == 1
    (finding,) = findings
    assert (finding["path"], finding["line"]) == ("model.quantization.gguf_int4", 11)
    assert finding["message"] == f"gguf_int4 is not used: {why}"


def test_build_writes_int4_as_q4_0_when_deploy_yaml_asks(tiny_model_dir, tmp_path):
    def build(gguf_int4: str) -> dict:
        deploy = _deploy(tmp_path, tiny_model_dir, "int4", 32, gguf_int4=gguf_int4)
        result = CliRunner().invoke(cli, ["build", "-f", str(deploy), "--output", "json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    q4_1, q4_0 = build("Q4_1"), build("Q4_0")
    # Same source and scheme: only gguf_int4 differs, and the cache tells them apart.
    assert not q4_0["cached"] and q4_0["artifact_id"] != q4_1["artifact_id"]
    for summary, expected in ((q4_1, "Q4_1"), (q4_0, "Q4_0")):
        header = read_gguf_header(Path(summary["artifact_dir"]) / GGUF_NAME)
        linear = {t.dtype for t in header.tensors if t.name.startswith("blk.") and len(t.shape) == 2}
        assert linear == {expected}
        assert header.metadata["general.file_type"] == {"Q4_0": 2, "Q4_1": 3}[expected]
    assert q4_0["bytes_written"] < q4_1["bytes_written"]  # 18-byte blocks instead of 20


def test_the_llama_cpp_demo_without_the_extra_names_it_and_starts_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # what `import llama_cpp` sees when absent
    workdir = tmp_path / "demo"
    result = CliRunner().invoke(cli, ["demo", "--engine", "llama.cpp", "--workdir", str(workdir)])
    assert result.exit_code == 1
    assert "llama-cpp-python" in result.output
    assert "pip install 'sits-deployer[llamacpp]'" in result.output  # brackets printed, not eaten as markup
    assert not workdir.exists()
