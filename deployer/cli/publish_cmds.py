"""`publish` and `promote`: deploy.yaml's signed releases as TUF channels on a static server or bucket,
and ring advancement once a ring's devices have converged healthy."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import click

from deployer.cli.common import console, emit_json, examples, info, output_option

if TYPE_CHECKING:
    from deployer.pull.publish import PublishedChannel


config_option = click.option(
    "-f",
    "--file",
    "config_path",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    default=Path("deploy.yaml"),
    show_default=True,
    help="The deploy.yaml.",
)
destination_option = click.option(
    "--to",
    "to",
    required=True,
    metavar="DIR|s3://BUCKET/PREFIX",
    help="Where the channels go: a directory a web server serves, or an S3 bucket and prefix.",
)
old_root_key_option = click.option(
    "--old-root-key",
    "old_root_keys",
    multiple=True,
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    metavar="KEY",
    help="A private key of the channels' current root, when publish.roles changed and the root rotates "
    "(keys deploy.yaml still names are found by themselves); repeatable.",
)


@click.command(
    epilog=examples(
        "sits-deployer publish -f deploy.yaml --to /srv/www/sits",
        "sits-deployer publish --to s3://my-bucket/sits --channel canary",
        "sits-deployer publish --to /srv/www/sits --old-root-key offline/root-old.key",
    )
    + "\n\nDevices poll <base_url>/<channel>/ with `sits-agent poll` (see docs/pull-mode.md).",
)
@config_option
@destination_option
@click.option(
    "--channel",
    "channels",
    multiple=True,
    metavar="NAME",
    help="Publish to this channel (ring) only; repeatable. Default: every channel in publish.channels.",
)
@old_root_key_option
@output_option
def publish(
    config_path: Path, to: str, channels: tuple[str, ...], old_root_keys: tuple[Path, ...], output: str
) -> None:
    """Build (or reuse) the model, sign its releases and TUF metadata, and upload each channel.

    Patches from the versions a channel published before are included; re-running without changes
    only re-signs the short-lived timestamp (do that from cron more often than timestamp_expires:
    it needs only the online timestamp and snapshot keys). When publish.roles names other keys than
    a channel's root lists, the root is rotated: signed by the old root's keys and the new ones.
    """
    from deployer.config import load_config
    from deployer.pull.publish import publish as publish_channels

    results = publish_channels(load_config(config_path), to, channels=channels, old_root_keys=old_root_keys)
    if output == "json":
        emit_json([asdict(r) for r in results])
        return
    for r in results:
        report_channel(r)


def report_channel(r: PublishedChannel) -> None:
    """The human lines for one published channel (stderr)."""
    what = "new release" if r.changed else "timestamp re-signed, release unchanged"
    bases = f", patches from {', '.join(r.patch_bases)}" if r.patch_bases else ""
    info(
        f"{r.channel}: {r.version} (counter {r.counter}{bases}) -> {r.destination}: {what}; "
        f"targets v{r.targets_version}, timestamp v{r.timestamp_version}, {r.uploaded} file(s) written"
    )
    if r.root_change == "rotated":
        info(
            f"  root rotated to v{r.root_version} (signed by the old and the new root keys): devices "
            "follow it at their next poll; apply provisions new devices with it"
        )
    elif r.root_change:
        info(f"  root v{r.root_version} {r.root_change}")
    for warning in r.warnings:
        console().print(f"[yellow]warning:[/yellow] {r.channel}: {warning}")


@click.command(
    epilog=examples(
        "sits-deployer promote --from canary --to /srv/www/sits",
        "sits-deployer promote --from canary --channel stable --to s3://my-bucket/sits",
    )
)
@config_option
@click.option(
    "--from",
    "source",
    required=True,
    metavar="CHANNEL",
    help="The ring whose devices must all run its release and be ready.",
)
@click.option(
    "--channel",
    "channel",
    metavar="NAME",
    help="Where the release goes. Default: the channel after --from in publish.channels.",
)
@destination_option
@old_root_key_option
@click.option("--parallel", default=4, show_default=True, type=click.IntRange(min=1))
@output_option
def promote(
    config_path: Path,
    source: str,
    channel: str | None,
    to: str,
    old_root_keys: tuple[Path, ...],
    parallel: int,
    output: str,
) -> None:
    """Publish a ring's release to the next ring, once every device of the ring runs it and is ready.

    The devices of the ring are those that poll it (the first channel whose selector their labels
    match); their version and readiness are read over the fleet's transport. When any has not
    converged healthy, nothing is published and each such device is listed.
    """
    from deployer.config import load_config
    from deployer.push.promote import promote as promote_ring

    done = promote_ring(
        load_config(config_path), source, to, channel=channel, parallel=parallel, old_root_keys=old_root_keys
    )
    if output == "json":
        emit_json(asdict(done))
        return
    for r in done.ring:
        info(f"{done.source}: {r.device} runs {r.version} ({r.health})")
    report_channel(done.published)


@click.command(
    epilog=examples(
        "sits-deployer bundle -f deploy.yaml -o /media/usb/sits-bundle.tar",
        "sits-deployer bundle -f deploy.yaml -o bundle/ --profile jetson-orin-nx --wheels-arch aarch64",
    )
    + "\n\nOn the device: sits-agent install --from /media/usb/sits-bundle.tar (an agent of "
    + "another version than the bundle's wheels is upgraded from them and restarted)"
    + "\n\nA device with no agent yet, from the bundle's wheels: pip install --no-index "
    + "--require-hashes -r bundle/wheels/requirements.txt",
)
@config_option
@click.option(
    "-o",
    "--out",
    "out",
    type=click.Path(path_type=Path),
    required=True,
    metavar="DIR|FILE",
    help="A directory, or a tar file (.tar, .tar.gz, .tgz). An earlier bundle there is replaced.",
)
@click.option(
    "--profile", metavar="NAME", help="The device class (a profile); default: the fleet's only one."
)
@click.option(
    "--bases",
    type=click.IntRange(min=0, max=32),
    default=3,
    show_default=True,
    help="Patches from this many of the versions released before (newest first).",
)
@click.option(
    "--wheels-arch",
    type=click.Choice(["x86_64", "aarch64"]),
    help="Also carry the agent's wheels for devices of this CPU architecture (llama-cpp-python "
    "cross-compiled for aarch64, once).",
)
@click.option(
    "--wheels-python",
    default=f"{sys.version_info[0]}.{sys.version_info[1]}",
    show_default=True,
    metavar="X.Y",
    help="The devices' Python, for --wheels-arch.",
)
@click.option(
    "--wheels-glibc",
    default="2.31",
    show_default=True,
    metavar="X.Y",
    help="The oldest glibc of the devices, for --wheels-arch (Ubuntu 20.04 and JetPack 5: 2.31).",
)
@output_option
def bundle(
    config_path: Path,
    out: Path,
    profile: str | None,
    bases: int,
    wheels_arch: str | None,
    wheels_python: str,
    wheels_glibc: str,
    output: str,
) -> None:
    """Write an offline bundle for a site with no network: build (or reuse) the model, sign its
    release, and put it with its artifact and patches from recent versions into DIR or FILE.

    A device installs it with `sits-agent install --from`, verified with the same keys, counters,
    expiry and anti-rollback checks as an update over the network. With --wheels-arch it carries
    the agent's wheels too, for a device that has no agent yet, or one of another version (which
    `install --from` upgrades from them).
    """
    from deployer.config import load_config
    from deployer.push.bootstrap import bundle_wheels
    from deployer.push.facts import DevicePlatform
    from deployer.release.bundle import bundle_class, write_bundle
    from deployer.release.desired import SITS_DIRNAME, build_target

    config = load_config(config_path)
    device_class = bundle_class(config, profile)
    wheels: tuple[Path, ...] = ()
    if wheels_arch is not None:
        device = DevicePlatform(wheels_python, "cpython", wheels_arch, "glibc", wheels_glibc)
        made = config.base_dir / SITS_DIRNAME / "wheels"
        wheels = bundle_wheels(config, device_class, device, Path(__file__).resolve().parents[2], made)
    target = build_target(config)
    result = write_bundle(config, target, out, device_class=device_class, bases=bases, wheels=wheels)
    if output == "json":
        emit_json({**asdict(result), "path": str(result.path)})
        return
    patches = f", patches from {', '.join(result.patch_bases)}" if result.patch_bases else ""
    carried = f", the agent's {len(result.wheels)} wheels for {wheels_arch}" if result.wheels else ""
    info(
        f"bundle of {result.version} (counter {result.counter}{patches}{carried}) for device class "
        f"{result.device_class or '(no profile)'}: {result.path}, {result.bytes:,} bytes"
    )
