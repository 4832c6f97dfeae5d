"""Uploads on thin links in the lab (marked `lab`): a token bucket on the device's veth (tc tbf, as a
cellular or satellite link caps a site), and a flaky proxy that drops the SSH connection every few
MB. The rates and bytes are measured on the real link and printed (`-s` shows them)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deployer.config.models import Bandwidth
from deployer.core.ratelimit import Throttle, TokenBucket
from deployer.transport.base import RetryPolicy
from tests.lab.lab import Lab
from tests.lab.netns import HUB

pytestmark = pytest.mark.lab

STAGING = "/var/lib/sits/staging"
LINK = "1mbit"  # the device's link: 125 000 bytes/s
LINK_RATE = 125_000


@pytest.fixture
def thin_link(hub: Lab) -> Iterator[int]:
    """Device 1's link capped at LINK by a token bucket on its veth's hub end (traffic towards the
    device, the push direction); removed after the test. Yields the device's index."""
    veth = hub.device(1).veth
    tc = ["ip", "netns", "exec", HUB, "tc", "qdisc"]
    subprocess.run(
        [*tc, "replace", "dev", veth, "root", "tbf", "rate", LINK, "burst", "32kbit", "latency", "400ms"],
        check=True,
    )
    try:
        yield 1
    finally:
        subprocess.run([*tc, "del", "dev", veth, "root"], check=False)


def _wire_bytes(veth: str) -> int:
    """Bytes the token bucket on `veth` has let through so far (tc's own counter)."""
    stats = subprocess.run(
        ["ip", "netns", "exec", HUB, "tc", "-s", "qdisc", "show", "dev", veth],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(stats.split(" Sent ", 1)[1].split()[0])


@pytest.mark.parametrize(
    ("configured", "size", "capped_by", "expected"),
    [
        ("400kbit", 600_000, "config", 50_000),  # below the link: the configured rate holds
        ("4Mbit", 1_500_000, "link", LINK_RATE),  # above the link: the link's cap holds, nothing breaks
    ],
)
def test_a_throttled_link_holds_the_configured_rate_or_the_links_cap(
    hub: Lab,
    ssh_to,
    thin_link: int,
    tmp_path: Path,
    configured: str,
    size: int,
    capped_by: str,
    expected: int,
) -> None:
    src = tmp_path / "patch.bin"
    src.write_bytes(os.urandom(size))
    transport = ssh_to(hub.device(thin_link).address, io_timeout_s=30)
    rate = Bandwidth.model_validate({"rate": configured}).rate  # as deploy.yaml's bandwidth gives it
    assert rate is not None
    transport.throttle = Throttle([TokenBucket(rate)])
    transport.run("true")  # connected before the clock starts: the handshake is not the transfer

    wire_before, started = _wire_bytes(hub.device(thin_link).veth), time.monotonic()
    result = transport.put(src, f"{STAGING}/throttled-{configured}.bin")
    elapsed = time.monotonic() - started  # put returns once the device has hashed it all
    measured, wire = size / elapsed, (_wire_bytes(hub.device(thin_link).veth) - wire_before) / elapsed

    print(
        f"\n[throttle] link {LINK}, configured {configured}: file {measured * 8 / 1000:.0f} kbit/s, "
        f"on the wire {wire * 8 / 1000:.0f} kbit/s (Ethernet, IP, TCP and SSH framing included)"
    )
    assert result.sha256 and not result.unchanged
    # The configured rate caps the file's bytes; the link's cap counts every byte on the wire.
    assert abs((measured if capped_by == "config" else wire) - expected) <= 0.1 * expected


def test_a_20mb_upload_arrives_through_5_cuts_sending_at_most_1_1x(
    hub: Lab, ssh_to, proxy_to, host_key_line, tmp_path: Path
) -> None:
    size, cuts = 20 * 1024 * 1024, 5
    src = tmp_path / "patch.bin"
    src.write_bytes(os.urandom(size))
    proxy = proxy_to(hub.device(2).address, cut_after=size * 7 // 10 // cuts, cuts=cuts)
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{proxy.port} {' '.join(host_key_line(2))}\n")
    retry = RetryPolicy(attempts=cuts + 2, base_delay_s=0.2, max_delay_s=1)
    transport = ssh_to("127.0.0.1", port=proxy.port, known_hosts=known, retry=retry)

    result = transport.put(src, f"{STAGING}/cut.bin")

    print(
        f"\n[push cuts] {proxy.cuts_made} cuts, {proxy.connections} connections, {proxy.total} bytes "
        f"on the wire for {size} ({proxy.total / size:.4f}x); file bytes sent {result.bytes_sent}"
    )
    assert proxy.cuts_made == cuts and proxy.connections == cuts + 1
    assert proxy.total <= 1.1 * size  # counted at the proxy: SSH framing, handshakes, resends
    assert hub.nsenter(2, ["sha256sum", f"{STAGING}/cut.bin"]).split()[0] == result.sha256
