"""`sits-deployer publish`: put deploy.yaml's signed release on a static server or bucket as TUF channels."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import click

from deployer.cli.common import emit_json, info, output_option


@click.command(
    epilog="Examples:\n\n  sits-deployer publish -f deploy.yaml --to /srv/www/sits\n\n"
    "  sits-deployer publish --to s3://my-bucket/sits --channel canary\n\n"
    "Devices poll <base_url>/<channel>/ with `sits-agent poll` (see docs/pull-mode.md).",
)
@click.option(
    "-f",
    "--file",
    "config_path",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    default=Path("deploy.yaml"),
    show_default=True,
    help="The deploy.yaml whose model is published.",
)
@click.option(
    "--to",
    "to",
    required=True,
    metavar="DIR|s3://BUCKET/PREFIX",
    help="Where the channels go: a directory a web server serves, or an S3 bucket and prefix.",
)
@click.option(
    "--channel",
    "channels",
    multiple=True,
    metavar="NAME",
    help="Publish to this channel (ring) only; repeatable. Default: every channel in publish.channels.",
)
@output_option
def publish(config_path: Path, to: str, channels: tuple[str, ...], output: str) -> None:
    """Build (or reuse) the model, sign its releases and TUF metadata, and upload each channel.

    Patches from the versions a channel published before are included; re-running without changes
    only re-signs the short-lived timestamp (do that from cron more often than timestamp_expires).
    """
    from deployer.config import load_config
    from deployer.publish import publish as publish_channels

    results = publish_channels(load_config(config_path), to, channels=channels)
    if output == "json":
        emit_json([asdict(r) for r in results])
        return
    for r in results:
        what = "new release" if r.changed else "timestamp re-signed, release unchanged"
        bases = f", patches from {', '.join(r.patch_bases)}" if r.patch_bases else ""
        info(
            f"{r.channel}: {r.version} (counter {r.counter}{bases}) -> {r.destination}: {what}; "
            f"targets v{r.targets_version}, timestamp v{r.timestamp_version}, {r.uploaded} file(s) written"
        )
        info(f"  devices trust {r.local_dir / 'metadata' / '1.root.json'} as etc/sits/pull-root.json")
