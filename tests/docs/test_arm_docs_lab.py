"""docs/operating.md's "Arm devices" block, run as written on a lab of its own (marked `lab`).

The block's ```bash lines (test_operating.py runs the ```sh ones, on local devices) bring up a lab
with one aarch64 device, look at it and take the lab down: in a fresh directory, whose `.lab` is the
lab's work dir. Only one lab runs on a machine, so this needs the session's lab (tests/lab/fixtures.py) not
to be up yet: in a whole run it comes first (tests/docs sorts before tests/fleet); run on its own
otherwise.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lab.fixtures import lab_unavailable
from tests.lab.lab import ACTIVE

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "operating.md"
SECTION = re.compile(r"^## Arm devices\n(.*?)(?=^## |\Z)", re.M | re.S)
BASH = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)


def arm_lines() -> list[str]:
    """The command lines of the section's ```bash blocks, in order (comments stripped)."""
    section = SECTION.search(DOC.read_text(encoding="utf-8"))
    assert section, "docs/operating.md has no '## Arm devices' section"
    lines = []
    for block in BASH.finditer(section.group(1)):
        for raw in block.group(1).splitlines():
            line = raw.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def test_arm_devices_block_runs_as_written(tmp_path: Path) -> None:
    if reason := lab_unavailable():
        pytest.skip(reason)
    if ACTIVE.exists():
        pytest.skip(f"a lab is up already ({ACTIVE}): run this test first or on its own")
    lines = arm_lines()
    assert lines[0].startswith("python -m tests.lab up") and lines[-1] == "python -m tests.lab down"
    env = {k: v for k, v in os.environ.items() if k != "SITS_LAB_DIR"}  # the doc's paths name .lab
    env |= {"PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"}
    printed: dict[str, str] = {}
    try:
        for line in lines:
            done = subprocess.run(
                ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=3600
            )
            assert done.returncode == 0, f"{line}: exit {done.returncode}\n{done.stdout}{done.stderr[-3000:]}"
            printed[line] = done.stdout
    finally:
        down = [sys.executable, "-m", "tests.lab", "down"]  # again, should a line have failed
        subprocess.run(down, cwd=tmp_path, env=env, capture_output=True, timeout=300, check=False)
    rows = [json.loads(row) for row in printed["python -m tests.lab status"].splitlines()]
    assert [(r["device"], r["arch"], r["state"]) for r in rows] == [
        ("dev1", "x86_64", "running"),
        ("dev2", "x86_64", "running"),
        ("dev3", "aarch64", "running"),
    ], rows
    (uname,) = [out for line, out in printed.items() if line.endswith("uname -m")]
    assert uname.strip() == "aarch64"
    assert not ACTIVE.exists()
