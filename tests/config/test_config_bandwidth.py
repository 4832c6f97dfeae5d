"""deploy.yaml's `bandwidth:`: rates in bits or bytes per second, validated at file:line:column,
set fleet-wide and overridden per profile and device."""

from __future__ import annotations

import pytest

from deployer.config import load_config, validate_file
from deployer.config.models import Link
from deployer.config.quantity import format_rate, parse_rate
from tests.config.conftest import BASE_LINES, WriteConfig


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [("2Mbit", 250_000), ("500kbit/s", 62_500), ("1mbit", 125_000), ("1MB/s", 10**6), ("256KiB/s", 262_144)],
)
def test_rates_in_bits_or_bytes(text: str, bytes_per_s: float) -> None:
    assert parse_rate(text) == bytes_per_s


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('"0Mbit"', "must be above 0"),
        ('"2 furlongs"', "invalid rate '2 furlongs'"),
        ("5", "a rate needs a unit"),
        ('"1Mbps"', "invalid rate"),  # tc's kbps means kilobytes: no unit that reads both ways
    ],
)
def test_a_bad_rate_is_a_finding_at_its_position(write_config: WriteConfig, value: str, message: str) -> None:
    path = write_config(f"bandwidth:\n  rate: {value}\n")
    errors = [f for f in validate_file(path, {}) if f.is_error]
    assert len(errors) == 1
    assert str(errors[0]).startswith(f"{path}:{BASE_LINES + 2}:9: bandwidth.rate: ")
    assert message in str(errors[0])


def test_the_device_overrides_the_profile_which_overrides_the_fleet(write_config: WriteConfig) -> None:
    path = write_config(
        "bandwidth: {rate: 4Mbit, push_total: 10Mbit, pull_total: 4Mbit}\n",
        replace=(
            ('small: {memory: 4Gi, cpu: "2"}', 'small: {memory: 4Gi, cpu: "2", bandwidth: {metered: true}}'),
            ("      agent_port: 8082\n", "      agent_port: 8082\n      bandwidth: {rate: 1MB/s}\n"),
        ),
    )
    config = load_config(path)
    d1, d2 = config.fleet.devices
    assert config.link_for(d1) == Link(rate=5e5, metered=True)
    assert config.link_for(d2) == Link(rate=1e6, metered=True)
    assert config.bandwidth is not None and config.bandwidth.push_total == 1.25e6
    assert format_rate(config.bandwidth.pull_total or 0) == "4 Mbit/s"


def test_no_bandwidth_means_no_limit(write_config: WriteConfig) -> None:
    config = load_config(write_config())
    assert {config.link_for(d) for d in config.fleet.devices} == {Link()}


def test_max_in_flight_reaches_the_ssh_transport_of_the_device_it_is_set_for(
    write_config: WriteConfig,
) -> None:
    from deployer.push.facts import DeviceSite
    from deployer.push.fleet import _connect
    from deployer.transport.ssh import SshOptions, SshTransport

    path = write_config(
        "bandwidth: {max_in_flight: 1Mi}\n",
        replace=(
            ("      transport: local\n      root: ./fleet/d1\n", "      host: 192.0.2.1\n"),
            ("      transport: local\n      root: ./fleet/d2\n", "      host: 192.0.2.2\n"),
            ("      agent_port: 8082\n", "      agent_port: 8082\n      bandwidth: {max_in_flight: 65536}\n"),
        ),
    )
    config = load_config(path)
    d1, d2 = config.fleet.devices
    assert config.link_for(d1) == Link(max_in_flight=2**20)
    sent = {}
    for device in (d1, d2):
        transport = _connect(config, device, DeviceSite.of(config, device))
        assert isinstance(transport, SshTransport)
        sent[device.name] = transport.options.max_in_flight
    assert sent == {"d1": 2**20, "d2": 65536}
    without = load_config(
        write_config(
            replace=(("      transport: local\n      root: ./fleet/d1\n", "      host: 192.0.2.1\n"),)
        )
    )
    d1 = without.fleet.devices[0]
    transport = _connect(without, d1, DeviceSite.of(without, d1))
    assert (
        isinstance(transport, SshTransport) and transport.options.max_in_flight == SshOptions().max_in_flight
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("16Ki", "greater than or equal to 32768"),
        ("1Gi", "less than or equal to 67108864"),
        ('"a lot"', "invalid memory quantity 'a lot'"),
    ],
)
def test_a_bad_max_in_flight_is_a_finding_at_its_position(
    write_config: WriteConfig, value: str, message: str
) -> None:
    path = write_config(f"bandwidth:\n  max_in_flight: {value}\n")
    errors = [f for f in validate_file(path, {}) if f.is_error]
    assert len(errors) == 1
    assert str(errors[0]).startswith(f"{path}:{BASE_LINES + 2}:18: bandwidth.max_in_flight: ")
    assert message in str(errors[0])
