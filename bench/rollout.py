"""Rollout delivery bench: a v2 sent to N lab devices over real SSH, as a patch vs as the full artifact,
with `--parallel 1` vs `--parallel 8`.

What is timed is the delivery phase of `apply` (the executor's send step: `send_release` uploads the
signed release and its payload into each device's incoming directory over SFTP, verified by sha256)
for every device, at most P at a time. The lab's devices are booted systemd containers with sshd but
no torch, so the agent's install and hot swap are not part of these figures (bench/swap.py has those).
Baseline: full artifact at --parallel 1, in the same run.

    python bench/rollout.py                      # 20 and 50 devices, tiny seeded model (needs root)
    python bench/rollout.py --devices 6          # quicker
    python bench/rollout.py --model smollm2      # SmolLM2-135M-Instruct int8 (about 160 MB per device)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# ruff: noqa: E402 - imports after the path set-up above
from deployer.bootstrap import INCOMING, send_release
from deployer.build.demo_model import make_tiny_checkpoint, prepare_smollm2
from deployer.build.pipeline import build_artifact
from deployer.build.spec import BuildRequest, QuantSpec
from deployer.core.hashing import sha256_file
from deployer.core.release import PatchRef, make_release
from deployer.delta import create_patch
from deployer.desired import ReleaseFiles
from deployer.facts import DeviceSite
from deployer.sign import add_signature, envelope_for, generate_key, load_private_key
from deployer.transport import run_bounded
from deployer.transport.ssh import SshOptions, SshTransport
from tests.lab.lab import Lab


def _artifacts(work: Path, model: str) -> tuple[Path, Path]:
    """v1 and v2 artifacts: two seeds of the tiny model, or SmolLM2 with every 10th tensor nudged."""
    built = []
    for seed, version in ((0, "1.0.0"), (1, "2.0.0")):
        if model == "tiny":
            source = make_tiny_checkpoint(work / f"src-{seed}", seed=seed)
        else:
            source = _nudged_smollm2(work / f"src-{seed}", seed)
        request = BuildRequest(source, "bench", version, QuantSpec(scheme="int8"), work / "store")
        built.append(build_artifact(request).artifact_dir)
    return built[0], built[1]


def _nudged_smollm2(dest: Path, seed: int) -> Path:
    """SmolLM2 as shipped (seed 0) or with a few tensors changed (seed 1), like a small fine-tune."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    source = prepare_smollm2()
    shutil.copytree(source, dest)
    if seed:
        weights = dest / "model.safetensors"
        tensors = load_file(weights)
        for i, name in enumerate(sorted(tensors)):
            if i % 10 == 0 and tensors[name].dim() == 2:
                tensors[name] = tensors[name] * (1 + 1e-2 * torch.randn_like(tensors[name]))
        save_file(tensors, weights)
    return dest


def _releases(work: Path, v1: Path, v2: Path) -> dict[str, ReleaseFiles]:
    pair = generate_key(work / "k.key", work / "k.pub", passphrase=None, unencrypted=True)
    key = load_private_key(pair.private_path, None)
    patch = work / "v1-v2.patch"
    create_patch(v1, v2, patch)
    base = make_release(v1, counter=1, expires_in=timedelta(days=1)).artifact.sha256
    ref = PatchRef(
        base_version="1.0.0", base_sha256=base, sha256=sha256_file(patch), size=patch.stat().st_size
    )
    out = {}
    for mode, patch_ref, counter in (("full", None, 2), ("patch", ref, 3)):
        envelope = add_signature(
            envelope_for(make_release(v2, counter=counter, expires_in=timedelta(days=1), patch=patch_ref)),
            key,
        )
        manifest = work / f"release-{mode}.json"
        manifest.write_bytes(envelope.to_bytes())
        out[mode] = ReleaseFiles(manifest, counter, patch if patch_ref else None, v2)
    return out


def _deliver(lab: Lab, count: int, release: ReleaseFiles, parallel: int) -> tuple[float, int]:
    """Wall seconds to deliver `release` to devices 1..count, and the bytes sent per device."""
    options = SshOptions(key_file=lab.client_key, known_hosts=lab.known_hosts)
    sites = [
        DeviceSite(f"dev{i}", lab.device(i).address, "/", False, 8080, "python3", "python3")
        for i in range(1, count + 1)
    ]
    transports = {s.name: SshTransport(s.host, options=options, label=s.name) for s in sites}
    for site in sites:  # a clean incoming dir, and connections made outside the timing
        transports[site.name].run(f"rm -rf {INCOMING}").check("clean")
    started = time.monotonic()
    outcomes = run_bounded(sites, lambda s: send_release(s, transports[s.name], release), parallel=parallel)
    wall = time.monotonic() - started
    for transport in transports.values():
        transport.close()
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise SystemExit(f"delivery failed on {len(failed)} devices: {failed[0].error}")
    return wall, max(o.result or 0 for o in outcomes)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, nargs="+", default=[20, 50])
    parser.add_argument("--parallel", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    args = parser.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory(prefix="sits-bench-rollout-") as tmp:
        work = Path(tmp)
        v1, v2 = _artifacts(work, args.model)
        releases = _releases(work, v1, v2)
        lab = Lab(work / "lab", max(args.devices))
        lab.up(ttl_s=3600, owner_pid=os.getpid())
        rows = []
        try:
            with lab.enter_hub():
                for count in args.devices:
                    for mode in ("full", "patch"):
                        for parallel in args.parallel:
                            wall, sent = _deliver(lab, count, releases[mode], parallel)
                            rows.append((count, mode, parallel, wall, sent))
                            console.print(f"{count} devices, {mode}, --parallel {parallel}: {wall:.2f} s")
        finally:
            lab.down()
    table = Table(title=f"delivery of v2 ({args.model}, int8) over SSH to lab devices")
    for column in ("devices", "payload", "--parallel", "wall s", "bytes/device", "vs full --parallel 1"):
        table.add_column(column, justify="right")
    for count, mode, parallel, wall, sent in rows:
        base = next(r[3] for r in rows if r[0] == count and r[1] == "full" and r[2] == min(args.parallel))
        table.add_row(str(count), mode, str(parallel), f"{wall:.2f}", f"{sent:,}", f"{base / wall:.1f}x")
    console.print(table)
    console.print(
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, paramiko SFTP"
    )


if __name__ == "__main__":
    main()
