"""The transfer progress `apply` shows, through a real pseudo-terminal and through a pipe: on a
terminal a live bar per upload with its rate and ETA; otherwise plain lines, each about one device.

A child process runs the CLI's own progress path (`fleet_cmds._Board` and `_meter`, as `apply`'s
executor uses them) over two real uploads of the local transport, each held to 2 MiB/s by a token
bucket so that they last long enough (about 1.5 s) for the bar to show an ETA.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

MiB = 1 << 20
CHILD = """
import sys, threading
from pathlib import Path
from deployer.cli import fleet_cmds
from deployer.cli.common import console
from deployer.core.ratelimit import Throttle, TokenBucket
from deployer.transport.local import LocalTransport

src, root = Path(sys.argv[1]), Path(sys.argv[2])
board = fleet_cmds._Board() if console().is_terminal else None
meter = fleet_cmds._meter(board)

def send(device):
    transport = LocalTransport(root / device, label=device)
    transport.throttle = Throttle([TokenBucket(2 * 2**20)])
    transport.put(src, "/models/model.bin", progress=meter(device, "model.bin"))

def both():
    threads = [threading.Thread(target=send, args=(d,)) for d in ("dev1", "dev2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

if board is not None:
    with board.live:
        both()
else:
    both()
"""
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
RATE = r"[0-9.]+ [kMG]?bit/s"


def _child(tmp_path: Path) -> list[str]:
    src = tmp_path / "model.bin"
    src.write_bytes(os.urandom(3 * MiB))
    (tmp_path / "fleet").mkdir()
    return [sys.executable, "-c", CHILD, str(src), str(tmp_path / "fleet")]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "COLUMNS", "LINES")}
    return env | {"TERM": "xterm-256color"}


def test_on_a_terminal_each_upload_has_a_bar_with_rate_and_eta(tmp_path: Path) -> None:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen(_child(tmp_path), stdin=slave, stdout=slave, stderr=slave, env=_env())
    os.close(slave)
    raw = bytearray()
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal's last descriptor
            break
        if not chunk:
            break
        raw += chunk
    os.close(master)
    assert proc.wait(timeout=60) == 0, raw.decode(errors="replace")[-2000:]
    text = raw.decode(errors="replace")
    assert "\x1b[" in text  # drawn in place, not printed line by line
    frames = ANSI.sub("", text)
    for device in ("dev1", "dev2"):
        bars = re.findall(rf"{device} model\.bin\s*\S*\s*([0-9.]+)/3\.1 MB\s+({RATE})?\s*(ETA \S+)?", frames)
        assert bars, frames[-2000:]
        assert any(rate and eta for _, rate, eta in bars), f"no bar of {device} shows a rate and an ETA"
        assert any(done == "3.1" for done, _, _ in bars), f"{device}'s bar never reaches the end"


def test_without_a_terminal_the_output_is_one_line_per_device(tmp_path: Path) -> None:
    done = subprocess.run(_child(tmp_path), capture_output=True, text=True, env=_env(), timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines and "\x1b" not in done.stderr and "\r" not in done.stderr
    line = re.compile(
        rf"^(dev[12]): send model\.bin [0-9.]+ (?:B|KiB|MiB) of 3\.0 MiB(?:, {RATE})?(?:, ETA \S+)?$"
    )
    matched = [line.match(x) for x in lines]
    assert all(matched), lines
    last = {m.group(1): m.group(0) for m in matched if m}
    assert set(last) == {"dev1", "dev2"}
    assert all(re.search(rf"3\.0 MiB of 3\.0 MiB, {RATE}$", x) for x in last.values()), last
