"""Creating and applying a patch of a multi-hundred-MB artifact hold blocks, not files (issue #38).

A 384 MiB weights file of three 128 MiB uint8 tensors (the layout of packed int4 weights): one
unchanged (a copy from the base), one with 2.5% of its bytes one step up or down (a difference
codec), one replaced by random bytes (128 MiB of incompressible raw stream). The patch is created
and applied in fresh processes, whose memory growth is measured from just before the call to the
process's peak.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from deployer.core.hashing import sha256_file
from deployer.core.patch_format import Codec, read_header

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20
TENSOR = 128 * MIB
# The device budget is 128 MiB for the whole applying process; the interpreter with numpy and
# zstandard takes about 32 MiB of it, so applying may add at most this much, whatever the file size.
GROWTH_BOUND = 64 * MIB

# Creating reads both files through memory maps; pages it has passed over count in its RSS until
# handed back. Its zstd and bzip2 coders take the rest (a level-19 zstd context is about 100 MiB).
CREATE_BOUND = 256 * MIB

# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forking parent, this test process.
MEASURE = """
import json, sys
from pathlib import Path
from deployer.core.patch_apply import apply_patch
from deployer.release.delta import create_patch
def status(field):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field))
    return int(line.split()[1]) * 1024
before = status("VmRSS:")
{"create": create_patch, "apply": apply_patch}[sys.argv[1]](*map(Path, sys.argv[2:]))
print(json.dumps({"growth": status("VmHWM:") - before}))
"""


def _artifacts(root: Path) -> tuple[Path, Path]:
    """Base and target directories; tensors written one file at a time to keep this process small."""
    rng = np.random.default_rng(7)
    base, target = root / "base", root / "target"
    base.mkdir()
    target.mkdir()
    tensors = {name: rng.integers(0, 256, TENSOR, dtype=np.uint8) for name in ("same", "nudged", "new")}
    save_file(tensors, str(base / "model.safetensors"))
    picked = np.flatnonzero(rng.random(TENSOR) < 0.025)
    tensors["nudged"][picked] += rng.choice(np.array([1, 255], dtype=np.uint8), len(picked))
    tensors["new"] = rng.integers(0, 256, TENSOR, dtype=np.uint8)
    save_file(tensors, str(target / "model.safetensors"))
    return base, target


def _growth(*args: Path | str) -> int:
    """Bytes the process grew by running MEASURE with `args`."""
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, *map(str, args)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return int(json.loads(run.stdout)["growth"])


@pytest.mark.long
def test_a_384_mib_artifact_is_patched_in_bounded_memory(tmp_path):
    base, target = _artifacts(tmp_path)
    patch = tmp_path / "p.patch"
    created = _growth("create", base, target, patch)
    assert created <= CREATE_BOUND, f"creating grew the process by {created / MIB:.0f} MiB"
    header, _ = read_header(patch)
    codecs = {s.name: s.codec for s in header.targets[0].segments}
    assert codecs["new"] is Codec.RAW and codecs["nudged"] not in (Codec.RAW, Codec.COPY)
    assert patch.stat().st_size > TENSOR  # the raw tensor's stream alone is larger than the bound
    out = tmp_path / "staging"
    out.mkdir()
    growth = _growth("apply", patch, base, out)
    assert sha256_file(out / "model.safetensors") == sha256_file(target / "model.safetensors")
    assert growth <= GROWTH_BOUND, f"applying grew the process by {growth / MIB:.0f} MiB"
