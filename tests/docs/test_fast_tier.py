"""README's day-to-day command, `./scripts/test.sh --fast`, run as written.

It runs with pytest's `--collect-only -q` after it (test.sh passes extra arguments to pytest): the
set-up, the linters and the fast tier's selection exactly as a developer gets them, without running
the fast tier's tests a second time (the rest of the suite runs each of them; doing it again would
add the whole tier's minutes to CI and check nothing new). Marked `long`, so the fast tier never
contains itself.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "./scripts/test.sh --fast"


def test_the_readme_shows_the_fast_tier_command() -> None:
    assert re.search(rf"^{re.escape(COMMAND)}\s+#", (ROOT / "README.md").read_text(encoding="utf-8"), re.M)


def _venv_is_current(venv: Path) -> bool:
    """Whether scripts/setup.sh would leave `venv` as it is (its stamp: the hash of the project's
    dependency list and pins); when not, it would reinstall the project into the running venv."""
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (ROOT / "constraints.txt").read_bytes())
    stamp = venv / ".sits-installed"
    return stamp.exists() and stamp.read_text().strip() == want.hexdigest()


@pytest.mark.long
def test_the_fast_tier_lints_then_selects_the_tests_without_model_lab_or_nginx(
    request: pytest.FixtureRequest,
) -> None:
    venv = Path(sys.prefix)
    if not _venv_is_current(venv):
        pytest.skip(f"{venv} is older than pyproject.toml or constraints.txt: run ./scripts/test.sh once")
    # The venv running this suite is the one set up; the llama.cpp step is the set-up's, not the tier's.
    env = {**os.environ, "SITS_VENV": str(venv), "SITS_NO_LLAMACPP": "1"}
    done = subprocess.run(
        [*shlex.split(COMMAND), "--collect-only", "-q"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "All checks passed!" in done.stdout and "Success: no issues found" in done.stdout  # ruff, mypy
    counts = re.search(r"^(\d+)/(\d+) tests collected \((\d+) deselected\)", done.stdout, re.M)
    assert counts and int(counts[1]) > 0 and int(counts[3]) > 0, done.stdout[-2000:]
    collected = {line for line in done.stdout.splitlines() if "::" in line}
    assert "tests/pull/test_pull_attacks.py::test_expired_timestamp_is_refused" in collected  # a mirror
    left_out = {
        "nginx": "tests/pull/test_pull_update.py::test_device_installs_full_then_patch_then_stays",
        "lab": "tests/pull/test_pull_lab.py::",
        "slow (the real model)": "tests/release/test_smollm2_release.py::",
        "long (this test)": request.node.nodeid,
    }
    for why, test in left_out.items():
        assert not any(line.startswith(test) for line in collected), f"{why}: {test}"
