"""A hostile bsdiff patch cannot exhaust memory: peak RSS of `apply_patch`, measured in a subprocess.

Each patch is as large as the format allows (a 16 MiB bsdiff segment reading 32 MiB of stream
bytes) and lies: huge control values, lengths in the bsdiff header that the payload does not
have, a stream that declares its size and holds far more, and bzip2 blocks that expand to
128 MiB from a few hundred bytes (the issue's 1.5 KB to 2 GiB, smaller to build quickly). Each is
refused with a FormatError, and the growth of the applying process stays under a bound computed
from the format's caps, far below what decompressing any of them would take.
"""

from __future__ import annotations

import bz2
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard

from deployer.core.patch_format import BLOCK_BYTES, MAX_WHOLE_BYTES, WHOLE_OVERHEAD_BYTES, ZSTD_MAX_WINDOW
from tests.release.helpers import forge_patch

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20
BOMB = 128 * MIB  # what each bzip2 bomb expands to

# What applying one segment may hold at once, by the format's caps:
SEGMENT_STREAM = 2 * MAX_WHOLE_BYTES + WHOLE_OVERHEAD_BYTES  # a bsdiff segment's bytes, held once
BZIP2_STATE = 4 * MIB  # bzip2's decoder for 900k blocks needs about 3.7 MB; bsdiff has three blocks
BOUND = SEGMENT_STREAM + ZSTD_MAX_WINDOW + 3 * BZIP2_STATE + 4 * BLOCK_BYTES + 8 * MIB  # + interpreter

# Growth of the process from just before apply_patch to its peak: RSS before, the high-water mark
# after (an upper bound of what applying added). VmHWM, not ru_maxrss: Linux carries ru_maxrss over
# exec from the forking parent, this test process.
MEASURE = """
import json, sys
from pathlib import Path
from deployer.core.patch_apply import apply_patch
from deployer.errors import SitsError
def status(field):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field))
    return int(line.split()[1]) * 1024
before = status("VmRSS:")
error = None
try:
    apply_patch(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
except SitsError as exc:
    error = [type(exc).__name__, exc.message]
print(json.dumps({"growth": status("VmHWM:") - before, "error": error}))
"""


def _offset(n: int) -> bytes:
    """bsdiff's signed 64-bit integer."""
    return (n if n >= 0 else (-n) | (1 << 63)).to_bytes(8, "little")


def _entry(x: int, y: int, z: int) -> bytes:
    return _offset(x) + _offset(y) + _offset(z)


def _bsdiff(control: bytes, diff: bytes, length: int, stream_bytes: int, *, lengths: tuple | None = None):
    """A BSDIFF40 payload of exactly `stream_bytes` bytes (the extra block padded with zeros)."""
    len_control, len_diff = lengths or (len(control), len(diff))
    head = b"BSDIFF40" + _offset(len_control) + _offset(len_diff) + _offset(length)
    body = head + control + diff
    return body + bytes(stream_bytes - len(body))


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("base")
    (directory / "w.bin").write_bytes(bytes(range(256)) * 256)
    return directory


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """A bzip2 stream of a few hundred bytes that expands to BOMB zero bytes."""
    return bz2.compress(bytes(BOMB))


def _hostile(name: str, bomb: bytes) -> tuple[int, bytes, bytes]:
    """(segment length, bsdiff payload, what its zstd stream holds) of the named attack."""
    length, most = MAX_WHOLE_BYTES, SEGMENT_STREAM
    empty = bz2.compress(b"")
    if name == "huge control values":
        return length, (blob := _bsdiff(bz2.compress(_entry(1 << 62, 0, 1 << 62)), empty, length, most)), blob
    if name == "bsdiff lengths past the payload":
        return length, (blob := _bsdiff(b"", b"", length, most, lengths=(1 << 40, 1 << 40))), blob
    if name == "diff block bomb":
        return length, (blob := _bsdiff(bz2.compress(_entry(length, 0, 0)), bomb, length, most)), blob
    if name == "control block bomb":  # zero-progress entries: a smaller segment keeps it quick
        small = 64 * 1024
        return small, (blob := _bsdiff(bomb, empty, small, 2 * small + WHOLE_OVERHEAD_BYTES)), blob
    assert name == "stream holds more than it declares"
    blob = _bsdiff(bz2.compress(_entry(1 << 62, 0, 0)), empty, length, most)
    return length, blob, blob + bytes(BOMB)


def _patch(path: Path, base: Path, length: int, blob: bytes, content: bytes) -> Path:
    old = (base / "w.bin").read_bytes()
    frame = zstandard.ZstdCompressor(level=1).compress(content)
    segment = {
        "name": "w",
        "codec": "bsdiff",
        "length": length,
        "base_offset": 0,
        "base_length": len(old),
        "item_size": 1,
        "stream": 0,
        "stream_bytes": len(blob),
    }
    header = {
        "format": "sits-patch",
        "format_version": 2,
        "base": {"w.bin": {"sha256": hashlib.sha256(old).hexdigest(), "size": len(old)}},
        "streams": [{"coder": "zstd", "length": len(frame), "size": len(blob)}],  # declares the payload
        "targets": [{"path": "w.bin", "sha256": "0" * 64, "size": length, "segments": [segment]}],
    }
    return forge_patch(path, header, [frame])


@pytest.mark.parametrize(
    "attack",
    [
        "huge control values",
        "bsdiff lengths past the payload",
        "diff block bomb",
        "control block bomb",
        "stream holds more than it declares",
    ],
)
def test_a_hostile_bsdiff_patch_is_refused_within_the_memory_bound(tmp_path, base, bomb, attack):
    length, blob, content = _hostile(attack, bomb)
    patch = _patch(tmp_path / "hostile.patch", base, length, blob, content)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, str(patch), str(base), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]  # no MemoryError, no traceback
    result = json.loads(run.stdout)
    assert result["error"] is not None and result["error"][0] == "FormatError", result
    assert result["growth"] <= BOUND, f"{attack}: grew {result['growth'] / MIB:.0f} MiB > {BOUND / MIB:.0f}"
    assert list(out.iterdir()) == []  # what was written is removed
