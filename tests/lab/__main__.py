"""Command line of the device lab: `python -m tests.lab up|down|status` (run from the repository root)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tests.lab import emulation
from tests.lab.lab import Lab, load, reap
from tests.lab.proc import LabError

DEFAULT_WORKDIR = Path(os.environ.get("SITS_LAB_DIR", ".lab"))


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run one lab command, return the exit code."""
    parser = argparse.ArgumentParser(prog="python -m tests.lab", description=__doc__)
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="lab work dir (default .lab)")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build (if needed) and boot the devices")
    up.add_argument("-n", "--devices", type=int, default=3)
    up.add_argument("--ttl", type=float, default=1800, help="seconds until the lab tears itself down")
    up.add_argument(
        "--arm64",
        type=int,
        default=0,
        metavar="K",
        help="the last K of the devices are aarch64, under qemu emulation (first build: 15-25 minutes)",
    )
    sub.add_parser("down", help="tear the lab down, guard route last")
    sub.add_parser("status", help="one JSON line per device")
    sub.add_parser("reap", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            if not 0 <= args.arm64 <= args.devices:
                raise LabError(f"--arm64 {args.arm64}: give 0 to {args.devices} (the lab's device count)")
            host = (emulation.host_arch(),) * (args.devices - args.arm64)
            lab = Lab(args.workdir, args.devices, arches=(*host, *("aarch64",) * args.arm64))
            report = lab.up(ttl_s=args.ttl)
            print(
                f"[lab] {report.devices} devices running: rootfs {report.rootfs_s:.1f} s, "
                f"spawn {report.spawn_s:.1f} s, boot {report.boot_s:.1f} s; ssh key {lab.client_key}, "
                f"known_hosts {lab.known_hosts}; clients run in `ip netns exec slhub ...`",
                file=sys.stderr,
            )
        elif args.command == "down":
            # Without a state file (a crashed run), still sweep whatever device dirs are there.
            lab = load(args.workdir) if (args.workdir / "lab.json").exists() else Lab(args.workdir, 1)
            lab.down()
        elif args.command == "status":
            for row in load(args.workdir).status():
                print(json.dumps(row))
        else:
            reap(args.workdir.resolve())
    except LabError as exc:
        print(f"[lab] error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
