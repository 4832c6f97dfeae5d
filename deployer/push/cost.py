"""What a rollout costs on the fleet's links: bytes per device, the time at each device's rate, the
fleet total and the rollout's expected duration (what `plan` prints under its table).

Pure. The duration walks the strategy's waves as the executor does: in a wave, the devices' sends
run `parallel` at a time (or the wave's own cap), each at its device's rate, and together no faster
than the fleet's push total; then the wave's analysis window and pause. Only capped links can be
estimated: a device without a rate counts as instant and is listed in `uncapped`, so the duration
is then a lower bound.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from deployer.push.plan import DevicePlan, DeviceStatus, Plan, StepKind
from deployer.push.rollout import Wave, WaveKind

__all__ = ["RolloutCost", "rollout_cost"]


@dataclass(frozen=True)
class RolloutCost:
    """The fleet's cost of a plan. `seconds` is the rollout's expected duration (sends, analysis
    windows and pauses; not installs and health gates, which the links do not decide)."""

    total_bytes: int
    seconds: float
    uncapped: tuple[str, ...]  # changing devices with payload and no rate: counted as instant
    full_downloads: tuple[str, ...]  # devices that get the full artifact rather than a patch

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (`plan --output json`'s `cost`)."""
        return {
            "total_bytes": self.total_bytes,
            "seconds": self.seconds,
            "uncapped": list(self.uncapped),
            "full_downloads": list(self.full_downloads),
        }


def rollout_cost(
    plan: Plan, waves: Sequence[Wave], *, parallel: int, push_total: float | None = None
) -> RolloutCost:
    """The cost of `plan` rolled out in `waves` with `parallel` devices at a time."""
    by_name = {d.device: d for d in plan.devices}
    changing = [d for d in plan.devices if d.status is DeviceStatus.CHANGE]
    seconds = 0.0
    for wave in waves:
        if wave.kind is not WaveKind.SWITCH:  # blue-green's switch wave sends nothing
            slots = min(parallel, wave.parallel or parallel)
            seconds += _wave_seconds([by_name[n] for n in wave.devices], slots, push_total)
        seconds += wave.analysis_s + wave.pause_s
    return RolloutCost(
        total_bytes=sum(d.bytes_to_send for d in changing),
        seconds=seconds,
        uncapped=tuple(d.device for d in changing if d.rate is None and d.bytes_to_send),
        full_downloads=tuple(
            d.device for d in changing if any(s.kind is StepKind.SEND_ARTIFACT for s in d.steps)
        ),
    )


def _wave_seconds(devices: Sequence[DevicePlan], slots: int, push_total: float | None) -> float:
    """The time one wave's sends take: `slots` at a time in rollout order (the executor's pool),
    and never less than its bytes at the fleet's push total."""
    finish: list[float] = [0.0] * max(1, slots)  # when each slot is free again
    for device in devices:
        start = heapq.heappop(finish)
        heapq.heappush(finish, start + (device.seconds or 0.0))
    makespan = max(finish)
    total = sum(d.bytes_to_send for d in devices)
    return max(makespan, total / push_total) if push_total else makespan
