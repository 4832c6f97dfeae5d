"""The README's demo, shortened (fewer fine-tune steps), run as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_demo_runs_end_to_end_and_cleans_up(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "deployer", "demo", "--workdir", str(workdir), "--finetune-steps", "10"],
        capture_output=True,
        text=True,
        timeout=1500,
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert re.search(r"Traffic during the canary rollout: \d+ ok, 0 failed", out), out[-4000:]
    assert re.search(r"Patch v1 -> v2: [\d.]+ MB against [\d.]+ MB", out)
    assert "Demo finished" in out
    # The passphrase the demo generated never reaches the output.
    assert "SITS_SIGNING_PASSPHRASE=" not in out
    # Cleaned up: the work directory is gone and no agent of it is left running.
    assert not workdir.exists()
    running = subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True, check=False)
    assert running.stdout.strip() == ""
