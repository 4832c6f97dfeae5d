"""A Qwen2.5-1.5B-shaped checkpoint end to end: `sits-deployer build` with the quality gate, a delta
to a new version, a signed install on a device root from the artifact and then from the patch, and
the agent's torch engine loading it and answering once (bench/scale.py's stages, on one shape).

The checkpoint is bench/shapes.py's (random bf16 weights, 3.1 GB in two shards with an index,
Qwen2's q/k/v biases, GQA, a 151,936-row tied embedding), written once and cached. The build runs
the CLI in a child process that reports its own peak RSS (VmHWM, which exec resets, so the parent
pytest's memory does not count): the gate streams the models a decoder layer at a time, so the
peak stays near one layer and one window's logits, far below the 6 GB fp32 model.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from bench.delta import scale_artifacts
from bench.scale import Stages, install_rows
from bench.shapes import checkpoint
from deployer.core.manifest import read_manifest
from deployer.release.delta import create_patch
from tests.build.conftest import EVAL_TEXT

# The whole-model gate peaked near 4x the fp32 model; streaming keeps 1.5B well under this.
PEAK_RSS_LIMIT_MB = 3000
DEPLOY = """\
apiVersion: sits.dev/v1
kind: Deployment
application: scale
model:
  name: qwen2-5-1-5b
  version: 1.0.0
  source: {source}
  quantization:
    scheme: int4
    group_size: 128
  quality_gate:
    eval_text: {eval_text}
    max_tokens: 256
    max_perplexity_increase_pct: 1000000
    min_top1_agreement: 0
fleet:
  devices:
    - name: dev1
      transport: local
      root: ./fleet/dev1
"""
# Runs the CLI as `sits-deployer` would, then prints this process's peak RSS in kB on stderr.
CHILD = """
import sys
from pathlib import Path
from deployer.cli.main import main
sys.argv = ["sits-deployer", *sys.argv[1:]]
try:
    main()
finally:
    status = Path("/proc/self/status").read_text()
    hwm = next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))
    sys.stderr.write(f"VMHWM {hwm}\\n")
"""


@pytest.mark.long
def test_a_1_5b_model_builds_with_the_gate_ships_as_a_delta_installs_and_answers(tmp_path):
    source = checkpoint("qwen2.5-1.5b")
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(DEPLOY.format(source=source, eval_text=EVAL_TEXT))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, "build", "-f", str(deploy), "--output", "json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    quality = result["quality"]
    assert quality["tokens"] == 256
    assert 4.0 < quality["bits_per_weight"] < 5.0  # int4 with a bf16 scale and zero per 128
    assert quality["top1_agreement"] < 1.0  # the gate saw the quantized model, not the source twice
    manifest = read_manifest(Path(result["artifact_dir"]))
    assert manifest.quality is not None and manifest.quality.tokens == 256
    peak_mb = int(done.stderr.rsplit("VMHWM ", 1)[1].split()[0]) / 1024
    assert peak_mb < PEAK_RSS_LIMIT_MB, f"peak RSS {peak_mb:.0f} MB"

    artifact = Path(result["artifact_dir"])
    versions = scale_artifacts("qwen2.5-1.5b", tmp_path / "versions", artifact)
    shutil.rmtree(versions.pop("two-layers"))
    versions["patch"] = tmp_path / "every-tensor.patch"
    create_patch(artifact, versions["every-tensor"], versions["patch"])
    stages = Stages("qwen2.5-1.5b", None, Console(file=io.StringIO()))
    install_rows(stages, versions, tmp_path / "install")  # raises if sits-agent refuses either
    assert [row.stage.split()[:2] for row in stages.rows] == [["install", "1.0.0"], ["install", "1.1.0"]]
    answer = subprocess.run(
        [sys.executable, "-m", "bench.load_child", str(artifact), "torch", "1", "512", "--generate", "4"],
        capture_output=True,
        text=True,
        check=True,
    )
    row = json.loads(answer.stdout.strip().splitlines()[-1])
    assert row["tokens"] == 4 and row["text"]
