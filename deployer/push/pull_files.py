"""Provisioning devices for pull mode: the files `apply` keeps on a device so that it polls by itself.

    /etc/sits/pull.yaml         url: <publish.base_url>/<channel>/, the device's channel being the
                                first of publish.channels whose selector its labels match; its
                                link from deploy.yaml's bandwidth (max_rate, metered), when set
    /etc/sits/pull-root.json    that channel's newest root metadata: the device's TUF trust anchor
    sits-poll.service/.timer    one poll, and the jittered timer that runs it (systemd devices)

Only when deploy.yaml sets `publish.base_url` and the device matches a channel; the channel must be
published first, since its root is what the device trusts. The files are deterministic (a second
apply changes nothing) and go through bootstrap.desired_files, so `plan` shows them as write steps.
"""

from __future__ import annotations

import yaml

from deployer.config.models import Channel, Config, Device
from deployer.push.facts import PULL_CONFIG, PULL_ROOT, UNIT_DIR
from deployer.push.units import UnitParams, render_pull_units

__all__ = ["channel_of", "channel_url", "link_settings", "pull_files"]


def channel_of(config: Config, device: Device) -> Channel | None:
    """The channel `device` polls, or None (no publish section, or no channel matches its labels)."""
    return config.publish.channel_for(device.labels) if config.publish else None


def channel_url(base_url: str, channel: str) -> str:
    """The URL devices poll for `channel`."""
    return f"{base_url.rstrip('/')}/{channel}/"


def link_settings(config: Config, device: Device) -> dict[str, object]:
    """pull.yaml's link fields for `device` ({} when deploy.yaml sets none, so that pull.yaml stays
    as it was). Its rate is its own cap or its share of `bandwidth.pull_total`, split evenly among
    the devices that poll: each polls by itself, so a share is what each can be held to."""
    link = config.link_for(device)
    total = config.bandwidth.pull_total if config.bandwidth else None
    pollers = sum(1 for d in config.fleet.devices if channel_of(config, d) is not None)
    share = total / pollers if total and pollers else None
    rate = min((r for r in (link.rate, share) if r), default=None)
    fields: dict[str, object] = {"max_rate": rate} if rate else {}
    if link.metered:
        fields |= {"metered": True, "allow_full_on_metered": link.allow_full_on_metered}
    return fields


def pull_files(config: Config, device: Device, units: UnitParams | None) -> dict[str, bytes]:
    """Device path -> content of the pull-mode files for `device` ({} when it is not in pull mode);
    the poll units too when `units` (the device's unit parameters) is given. Raises ConfigError when
    its channel was never published."""
    channel = channel_of(config, device)
    if config.publish is None or config.publish.base_url is None or channel is None:
        return {}
    from deployer.pull.publish import channel_root  # tuf loads only for pull-mode fleets

    settings: dict[str, object] = {"url": channel_url(config.publish.base_url, channel.name)}
    settings |= link_settings(config, device)
    files = {
        PULL_CONFIG: (
            "# Written by sits-deployer from deploy.yaml (publish); local edits are overwritten.\n"
            + yaml.safe_dump(settings, sort_keys=True)
        ).encode(),
        PULL_ROOT: channel_root(config, channel.name),
    }
    if units is not None:
        for name, text in render_pull_units(units).items():
            files[f"{UNIT_DIR}/{name}"] = text.encode()
    return files
