"""The README's demo, shortened (fewer fine-tune steps), run as a user runs it, on each agent engine."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ENGINES = [
    "torch",
    pytest.param(
        "llama.cpp",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("llama_cpp") is None,
            reason="llama-cpp-python is not installed (pip install 'sits-deployer[llamacpp]')",
        ),
    ),
]


def _demo(workdir: Path, *options: str) -> str:
    """The demo's output, run as a user runs it with `options` (fewer fine-tune steps); it must
    succeed."""
    result = subprocess.run(
        [
            *(sys.executable, "-m", "deployer", "demo", "--workdir", str(workdir)),
            "--finetune-steps",
            "10",
            *options,
        ],
        capture_output=True,
        text=True,
        timeout=1500,
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_demo_runs_end_to_end_and_cleans_up(tmp_path: Path, engine: str) -> None:
    workdir = tmp_path / "demo"
    out = _demo(workdir, "--engine", engine)
    assert re.search(r"Traffic during the canary rollout: \d+ ok, 0 failed", out), out[-4000:]
    sizes = re.search(r"Patch v1 -> v2: ([\d.]+) MB against ([\d.]+) MB", out)
    assert sizes, out[-4000:]
    # v2 differs from v1 only in its fine-tuned top blocks: the patch carries far less than the model.
    assert float(sizes[1]) < float(sizes[2]) / 2
    # Every device answered v2 through the engine asked for.
    assert len(re.findall(rf"│ dev\d\s+│ 1\.1\.0\s+│ {re.escape(engine)} ", out)) == 6, out[-4000:]
    # The device with the 1 ms deadline answered through dev1's agent, and status counted it.
    assert re.search(
        r"dev3 answered .*: served by upstream \(smollm2-135m-instruct@1\.0\.0\), fallback reason: deadline",
        out,
    ), out[-4000:]
    if engine == "torch":
        _assert_the_adapter_act(out)
    assert "Demo finished" in out
    # The passphrase the demo generated never reaches the output.
    assert "SITS_SIGNING_PASSPHRASE=" not in out
    # Cleaned up: the work directory is gone and no agent of it is left running.
    assert not workdir.exists()
    running = subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True, check=False)
    assert running.stdout.strip() == ""


def _assert_the_adapter_act(out: str) -> None:
    """A LoRA adapter of v1 rolled out, answered by its name on both devices that do not fall back,
    moved to 1.1.0 and rolled back to 1.0.0, while no request to the base or to it failed."""
    rest = out
    for title, version in (
        ("support 1.0.0 answers", "1.0.0"),
        ("support 1.1.0 answers", "1.1.0"),
        ("support after its rollback", "1.0.0"),
    ):
        assert title in rest, out[-4000:]
        rest = rest[rest.index(title) :]  # the tables come in this order
        table = rest[: rest.index("└")]  # down to the table's bottom border
        assert len(re.findall(rf"│ dev[12]\s+│ support@{re.escape(version)}\s+│", table)) == 2, table
    assert "send-adapter-patch adapter support 1.0.0 -> 1.1.0: patch" in out, out[-4000:]
    base = re.search(r"Traffic to the base during the adapter's .*: (\d+) ok, (\d+) failed", out)
    tuned = re.search(
        r"Traffic to adapter support during .*: (\d+) ok, (\d+) failed \(answered by (.*)\)", out
    )
    assert base and tuned, out[-4000:]
    assert int(base[1]) > 0 and base[2] == "0", base[0]
    assert int(tuned[1]) > 0 and tuned[2] == "0", tuned[0]


def test_demo_builds_int4_group_128_under_the_gate_it_prints(tmp_path: Path) -> None:
    """`sits-deployer demo --quantization int4-g128`, as the README says: v1 and v2 are int4 group
    128 with awq, gated by the looser limits the demo prints, and the story runs to its end."""
    from deployer.demo.run import QUANTIZATIONS

    out = _demo(tmp_path / "demo", "--quantization", "int4-g128")
    chosen = QUANTIZATIONS["int4-g128"]
    assert "deploy.yaml (int4-g128):" in out, out[-4000:]
    for key, limit in chosen.gate.items():
        assert f"{key}: {limit}" in out, out[-4000:]
    assert "Build v1: SmolLM2-135M-Instruct, int4 group 128 with awq safetensors, quality-gated" in out
    # Every device answered v2, and no request failed while it rolled out.
    assert len(re.findall(r"│ dev\d\s+│ 1\.1\.0\s+│ torch ", out)) == 6, out[-4000:]
    assert re.search(r"Traffic during the canary rollout: \d+ ok, 0 failed", out), out[-4000:]
    assert "Demo finished" in out
