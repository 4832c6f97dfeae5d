"""Rollout bench: v2 rolled out to N lab devices over real SSH, as a patch vs as the full artifact,
with `--parallel 1` vs `--parallel 8`.

Each device runs what `apply` runs for an update: `send_release` uploads the signed release and its
payload over SFTP (resumable, verified by sha256), then `sits-agent install` on the device verifies
the signatures, counter, expiry and base, applies the patch (or copies the artifact), checks every
output hash and promotes the new version. The agent's hot swap is not included (no agent serves
during the bench: 50 model servers do not fit one 2-core host; bench/swap.py measures the swap).
Set-up outside the timing: the agent's wheel and key on every device, v1 installed. Each round
installs a new v2 (2.0.<round>, same weights, its own release counter) and the devices are rolled
back to v1 afterwards, so every round starts from the same state. Baseline: the full artifact at
--parallel 1, in the same run. On this lab the devices share the host's CPUs, so the speed-up
understates what N real devices, each with its own CPU, would see.

    python bench/rollout.py                      # 20 and 50 devices, tiny seeded model (needs root)
    python bench/rollout.py --devices 6          # quicker
    python bench/rollout.py --model smollm2      # SmolLM2-135M-Instruct int8 (about 160 MB per device)
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# ruff: noqa: E402 - imports after the path set-up above
from deployer.build.demo_model import make_smollm2_variant, make_tiny_checkpoint, prepare_smollm2
from deployer.build.pipeline import build_artifact
from deployer.build.spec import BuildRequest, QuantSpec
from deployer.core.hashing import sha256_file
from deployer.core.release import PatchRef, make_release
from deployer.push.bootstrap import INCOMING, build_agent_wheel, install_agent, install_args, send_release
from deployer.push.facts import AGENT_CONFIG, KEYS_DIR, VENV_PYTHON, DeviceSite
from deployer.release.delta import create_patch
from deployer.release.desired import ReleaseFiles
from deployer.release.sign import add_signature, envelope_for, generate_key, load_private_key
from deployer.transport import run_bounded
from deployer.transport.ssh import SshOptions, SshTransport
from tests.lab.lab import Lab

V1 = "1.0.0"


@dataclass(frozen=True)
class Sources:
    """The model checkpoints v1 and v2 are built from."""

    v1: Path
    v2: Path


def _sources(work: Path, model: str) -> Sources:
    """Two seeds of the tiny model, or SmolLM2 and SmolLM2 with its last two layers changed."""
    if model == "tiny":
        return Sources(
            make_tiny_checkpoint(work / "src-1", seed=0), make_tiny_checkpoint(work / "src-2", seed=1)
        )
    return Sources(prepare_smollm2(), make_smollm2_variant(work / "src-2", seed=1))


def _build(source: Path, version: str, work: Path) -> Path:
    request = BuildRequest(source, "bench", version, QuantSpec(scheme="int8"), work / "store")
    return build_artifact(request).artifact_dir


class Releases:
    """Signs releases with one bench key: v1 in full, and each round's v2 in full or as a patch."""

    def __init__(self, work: Path, sources: Sources) -> None:
        self.work = work
        self.sources = sources
        pair = generate_key(work / "k.key", work / "k.pub", passphrase=None, unencrypted=True)
        self.public_key = pair.public_path
        self.key = load_private_key(pair.private_path, None)
        self.v1 = _build(sources.v1, V1, work)
        self.counter = 0

    def release(self, artifact: Path, *, patch_from: Path | None = None) -> ReleaseFiles:
        """A signed release of `artifact` with the next counter (a patch from `patch_from` if given)."""
        self.counter += 1
        patch, ref = None, None
        if patch_from is not None:
            patch = self.work / f"patch-{self.counter}.patch"
            create_patch(patch_from, artifact, patch)
            base = make_release(patch_from, counter=1, expires_in=timedelta(days=1))
            ref = PatchRef(
                base_version=V1,
                base_sha256=base.artifact.sha256,
                sha256=sha256_file(patch),
                size=patch.stat().st_size,
            )
        release = make_release(artifact, counter=self.counter, expires_in=timedelta(days=1), patch=ref)
        manifest = self.work / f"release-{self.counter}.json"
        manifest.write_bytes(add_signature(envelope_for(release), self.key).to_bytes())
        return ReleaseFiles(manifest, self.counter, patch, artifact)

    def round(self, index: int, mode: str) -> ReleaseFiles:
        """Round `index`'s v2 (version 2.0.<index>), in full or as a patch from v1."""
        v2 = _build(self.sources.v2, f"2.0.{index}", self.work)
        return self.release(v2, patch_from=self.v1 if mode == "patch" else None)


@dataclass(frozen=True)
class Devices:
    """SSH connections to lab devices, and a way to run one job on each of them."""

    sites: list[DeviceSite]
    transports: dict[str, SshTransport]

    @classmethod
    def connect(cls, lab: Lab, count: int) -> Devices:
        """Devices 1..count of `lab` (the agent runs from the venv the lab's rootfs carries)."""
        options = SshOptions(key_file=lab.client_key, known_hosts=lab.known_hosts)
        sites = [
            DeviceSite(f"dev{i}", lab.device(i).address, "/", False, 8080, "python3", VENV_PYTHON)
            for i in range(1, count + 1)
        ]
        return cls(sites, {s.name: SshTransport(s.host, options=options, label=s.name) for s in sites})

    def first(self, count: int) -> Devices:
        """The first `count` devices, on the same connections."""
        return Devices(self.sites[:count], self.transports)

    def each(self, job, parallel: int = 8) -> list:
        """Run job(site, transport) on every device, at most `parallel` at once; fail on any error."""
        outcomes = run_bounded(self.sites, lambda s: job(s, self.transports[s.name]), parallel=parallel)
        failed = [o for o in outcomes if not o.ok]
        if failed:
            raise SystemExit(f"{len(failed)} device(s) failed; first: {failed[0].error}")
        return [o.result for o in outcomes]

    def close(self) -> None:
        for transport in self.transports.values():
            transport.close()


def _prepare(
    site: DeviceSite, transport: SshTransport, wheel: Path, key: Path, settings: Path, v1: ReleaseFiles
) -> None:
    """The agent, its settings and trusted key, and v1 installed: the state every round starts from."""
    transport.run(f"rm -rf /var/lib/sits {INCOMING} /etc/sits", timeout=60).check("clean")
    install_agent(site, transport, wheel)
    transport.put(key, f"{KEYS_DIR}/bench.pub")
    transport.put(settings, AGENT_CONFIG)
    _rollout(site, transport, v1)


def _install(site: DeviceSite, transport: SshTransport, release: ReleaseFiles) -> None:
    argv = site.agent("install", "--no-reload", *install_args(site, release))
    transport.run(shlex.join(argv), timeout=900).check(f"{site.name}: sits-agent install")


def _rollout(site: DeviceSite, transport: SshTransport, release: ReleaseFiles) -> tuple[int, float]:
    """What `apply` does for one device: send, then install. Returns (bytes sent, send seconds)."""
    started = time.monotonic()
    sent = send_release(site, transport, release)
    send_s = time.monotonic() - started
    _install(site, transport, release)
    return sent, send_s


def _back_to_v1(site: DeviceSite, transport: SshTransport) -> None:
    """v1 current again; the round's v2 stays only as `previous` (gc), so disks do not fill up."""
    back, gc = site.agent("rollback", "--to", V1), site.agent("gc", "--keep", "1")
    command = f"{shlex.join(back)} && {shlex.join(gc)} && rm -rf {INCOMING}"
    transport.run(command, timeout=300).check(f"{site.name}: rollback")


@dataclass(frozen=True)
class Row:
    devices: int
    mode: str
    parallel: int
    wall_s: float
    bytes_per_device: int
    send_share: float  # of the device-seconds spent, the part spent sending


def _round(devices: Devices, release: ReleaseFiles, parallel: int) -> tuple[float, int, float]:
    started = time.monotonic()
    results = devices.each(lambda s, t: _rollout(s, t, release), parallel=parallel)
    wall = time.monotonic() - started
    devices.each(_back_to_v1)
    send_s = sum(r[1] for r in results)
    return wall, max(r[0] for r in results), send_s / (wall * min(parallel, len(results)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, nargs="+", default=[20, 50])
    parser.add_argument("--parallel", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    args = parser.parse_args()
    console = Console(width=120)  # the table whole, also in a log file
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="sits-bench-rollout-") as tmp:
        work = Path(tmp)
        releases = Releases(work, _sources(work, args.model))
        v1 = releases.release(releases.v1)
        wheel = build_agent_wheel(REPO, work / "wheel")
        settings = work / "agent.yaml"  # every field has a default; the devices' root is /
        settings.write_text("root: /\n")
        lab = Lab(work / "lab", max(args.devices))
        lab.up(ttl_s=3600, owner_pid=os.getpid())
        try:
            with lab.enter_hub():
                devices = Devices.connect(lab, max(args.devices))
                started = time.monotonic()
                devices.each(lambda s, t: _prepare(s, t, wheel, releases.public_key, settings, v1))
                console.print(f"set-up of {max(args.devices)} devices: {time.monotonic() - started:.0f} s")
                for count in args.devices:
                    subset = devices.first(count)
                    for mode in ("full", "patch"):
                        for parallel in args.parallel:
                            release = releases.round(len(rows) + 1, mode)
                            wall, sent, share = _round(subset, release, parallel)
                            rows.append(Row(count, mode, parallel, wall, sent, share))
                            console.print(f"{count} devices, {mode}, --parallel {parallel}: {wall:.2f} s")
                devices.close()
        finally:
            lab.down()
    console.print(_table(rows, args.model, min(args.parallel)))
    console.print(
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, paramiko SFTP; "
        "time = send + on-device verify, apply, check and promote"
    )


def _table(rows: list[Row], model: str, base_parallel: int) -> Table:
    table = Table(title=f"rollout of v2 ({model}, int8) over SSH to lab devices")
    columns = ("devices", "payload", "--parallel", "wall s", "bytes/device", "send share", "vs full p1")
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        base = next(
            r.wall_s
            for r in rows
            if r.devices == row.devices and r.mode == "full" and r.parallel == base_parallel
        )
        table.add_row(
            str(row.devices),
            row.mode,
            str(row.parallel),
            f"{row.wall_s:.2f}",
            f"{row.bytes_per_device:,}",
            f"{row.send_share:.0%}",
            f"{base / row.wall_s:.1f}x",
        )
    return table


if __name__ == "__main__":
    main()
