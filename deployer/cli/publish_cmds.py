"""`publish` and `promote`: deploy.yaml's signed releases as TUF channels on a static server or bucket,
and ring advancement once a ring's devices have converged healthy."""

from __future__ import annotations

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
