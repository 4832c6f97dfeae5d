"""Progress of long uploads: rate over the last seconds and ETA on a virtual clock, at most one
report per interval, always one at the end; and the executor meters every upload it makes."""

from __future__ import annotations

from pathlib import Path

from deployer.push.meter import TransferMeter, TransferStatus
from tests.push.simulator import SimFleet

MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rate_and_eta_follow_the_link_and_reports_are_spaced() -> None:
    clock, seen = Clock(), []
    meter = TransferMeter("model.bin", seen.append, every_s=10, clock=clock)
    for second in range(21):  # 1 MiB/s for 20 s of a 40 MiB file
        clock.now = float(second)
        meter(second * MiB, 40 * MiB)
    assert [s.done for s in seen] == [0, 10 * MiB, 20 * MiB]  # first, then every 10 s
    last = seen[-1]
    assert last.rate == MiB and last.eta_s == 20.0
    assert last.describe() == "model.bin 20.0 MiB of 40.0 MiB, 8.39 Mbit/s, ETA 20s"


def test_the_rate_is_the_recent_one_and_the_end_is_always_reported() -> None:
    clock, seen = Clock(), []
    meter = TransferMeter("p", seen.append, every_s=100, clock=clock)
    for second in range(11):  # 2 MiB/s for 10 s, then the link slows to 0.5 MiB/s
        clock.now = float(second)
        meter(second * 2 * MiB, 40 * MiB)
    done = 20 * MiB
    for second in range(11, 51):
        clock.now = float(second)
        done += MiB // 2
        meter(min(done, 40 * MiB), 40 * MiB)
    assert seen[-1].done == seen[-1].total == 40 * MiB  # the end, whatever the interval
    assert seen[-1].rate == MiB / 2  # measured over the last seconds, not since the start


def test_a_resume_from_a_shorter_prefix_measures_afresh() -> None:
    clock, seen = Clock(), []
    meter = TransferMeter("p", seen.append, every_s=0, clock=clock)
    meter(0, 10 * MiB)
    clock.now = 1
    meter(4 * MiB, 10 * MiB)
    clock.now = 5  # cut; the resume starts from the 3 MiB verified on the device
    meter(3 * MiB, 10 * MiB)
    assert seen[-1] == TransferStatus("p", 3 * MiB, 10 * MiB, None, None)


def test_the_executor_meters_each_upload_by_device_and_file(tmp_path: Path) -> None:
    sim = SimFleet(tmp_path, 2)
    fp = sim.plan()
    metered: list[tuple[str, str, int, int]] = []

    def meter(device: str, name: str):
        return lambda done, total: metered.append((device, name, done, total))

    sim.executor(meter=meter).run(fp.plan, {f.name: f for f in fp.facts}, sim.releases(sim.session, fp))
    puts = {(d, Path(x).name) for d, e, x in sim.events if e == "put"}
    assert puts and {(d, n) for d, n, _, _ in metered} == puts
    assert all(done <= total for _, _, done, total in metered)
