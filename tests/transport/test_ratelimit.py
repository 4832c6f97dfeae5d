"""Rate caps on uploads (deploy.yaml's bandwidth): the token bucket both sides share, a put held to
a device's rate, and a fleet total shared by several devices. A virtual clock that `sleep` moves
forward makes the timing exact and the tests instant."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deployer.core.hashing import sha256_file
from deployer.core.ratelimit import Throttle, TokenBucket
from deployer.transport.local import LocalTransport


class VirtualClock:
    """time.monotonic and time.sleep for a bucket: sleeping moves the clock, nothing waits."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.now += seconds


def bucket(clock: VirtualClock, rate: float, burst: float | None = None) -> TokenBucket:
    return TokenBucket(rate, burst=burst, clock=clock, sleep=clock.sleep)


def test_a_bucket_lets_its_burst_through_then_holds_the_rate() -> None:
    clock = VirtualClock()
    limit = bucket(clock, rate=1000, burst=500)
    assert limit.take(500) == 0  # the burst: at once
    for _ in range(20):
        limit.take(100)
    assert clock.now == pytest.approx(2.0)  # 2000 bytes past the burst at 1000 B/s


def test_a_take_larger_than_the_burst_is_paid_off_as_debt() -> None:
    clock = VirtualClock()
    limit = bucket(clock, rate=1000, burst=100)
    limit.take(100)
    assert limit.take(5000) == pytest.approx(5.0)
    clock.now += 1.0  # idle time refills at most the burst
    assert limit.take(100) == 0
    assert limit.take(100) == pytest.approx(0.1)


def test_a_rate_of_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="above 0"):
        TokenBucket(0)


@pytest.fixture
def blob(tmp_path: Path) -> Path:
    path = tmp_path / "delta.patch"
    path.write_bytes(os.urandom(3 * 1024 * 1024 + 77))
    return path


def _device(tmp_path: Path, name: str, throttle: Throttle) -> LocalTransport:
    (tmp_path / name).mkdir()
    device = LocalTransport(tmp_path / name, label=name)
    device.throttle = throttle
    return device


def test_a_put_takes_size_over_rate_and_arrives_intact(tmp_path: Path, blob: Path) -> None:
    clock = VirtualClock()
    rate = 250_000.0  # 2Mbit
    device = _device(tmp_path, "kiosk", Throttle([bucket(clock, rate)]))
    written: list[int] = []
    result = device.put(
        blob, "/var/lib/sits/incoming/delta.patch", progress=lambda done, _: written.append(done)
    )
    size = blob.stat().st_size
    assert result.bytes_sent == size and written[-1] == size
    assert sha256_file(tmp_path / "kiosk/var/lib/sits/incoming/delta.patch") == sha256_file(blob)
    burst = max(16 * 1024, rate * 0.25)
    assert clock.now == pytest.approx((size - burst) / rate, rel=0.01)


def test_the_fleet_total_binds_across_devices_and_the_tighter_cap_wins(tmp_path: Path, blob: Path) -> None:
    clock = VirtualClock()
    total = bucket(clock, rate=100_000, burst=16 * 1024)
    fast = _device(tmp_path, "fast", Throttle([bucket(clock, 10**9), total]))
    slow = _device(tmp_path, "slow", Throttle([bucket(clock, 50_000, burst=16 * 1024), total]))
    assert fast.throttle is not None and fast.throttle.rate == 100_000
    fast.put(blob, "/a")
    after_fast = clock.now
    size = blob.stat().st_size
    assert after_fast == pytest.approx(size / 100_000, rel=0.01)  # the total, not the device's 1 GB/s
    slow.put(blob, "/a")
    assert clock.now - after_fast == pytest.approx(size / 50_000, rel=0.01)  # the device's own cap


def test_no_throttle_means_no_waiting(tmp_path: Path, blob: Path) -> None:
    (tmp_path / "free").mkdir()
    device = LocalTransport(tmp_path / "free")
    assert device.throttle is None
    assert device.put(blob, "/a").bytes_sent == blob.stat().st_size
