"""Rollout strategies and their decisions: waves, the offline policy, analysis, the failure threshold.

Pure: data in, data out, no I/O. The executor walks the waves this module makes and asks it whether
a device passed its analysis and whether the rollout must halt.

    all-at-once  one wave with every device
    rolling      waves of `batch_size` devices, at most `max_unavailable` of them updating at once
    canary       cumulative steps (counts or percentages, e.g. [1, 50%, 100%]); after each step but
                 the last, an analysis window (readiness, smoke latency, error rate from /metrics),
                 then a pause
    blue-green   a stage wave (agent, files and payload on every device, nothing switched), then one
                 switch wave; if any device fails to stage, no device is switched. On each device
                 the agent loads the new model beside the old and swaps only after its smoke checks.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from deployer.config.models import Strategy

__all__ = [
    "MAX_ERROR_RATE",
    "MAX_FALLBACK_RATIO",
    "MetricsSnapshot",
    "OfflineDecision",
    "Sample",
    "Wave",
    "WaveKind",
    "decide_offline",
    "judge",
    "make_waves",
    "should_halt",
]

# Share of requests answered with a 5xx during an analysis window above which a device fails it.
MAX_ERROR_RATE = 0.05
# A canary device fails when it falls back to the upstream more than this many times as often as the
# devices still on the old version did in the same window, and by at least MIN_FALLBACK_EXCESS (so
# that one fallback against none is not "infinitely more").
MAX_FALLBACK_RATIO = 2.0
MIN_FALLBACK_EXCESS = 0.05


class WaveKind(enum.StrEnum):
    """What a wave does to its devices."""

    DEPLOY = "deploy"  # every step of the device's plan
    STAGE = "stage"  # blue-green: bootstrap, files, payload; nothing is switched
    SWITCH = "switch"  # blue-green: install (hot swap), health gate, hooks


@dataclass(frozen=True)
class Wave:
    """A group of devices updated together, then judged."""

    index: int
    kind: WaveKind
    devices: tuple[str, ...]
    parallel: int | None = None  # a cap below --parallel (rolling: max_unavailable)
    analysis_s: float = 0.0  # analysis window after the wave
    pause_s: float = 0.0  # wait after the analysis, before the next wave


def make_waves(strategy: Strategy, devices: Sequence[str]) -> list[Wave]:
    """The waves for `devices` (in rollout order) under `strategy`; empty when there are none."""
    names = tuple(devices)
    if not names:
        return []
    pause = strategy.pause.total_seconds()
    if strategy.type == "blue-green":
        return [Wave(0, WaveKind.STAGE, names), Wave(1, WaveKind.SWITCH, names)]
    if strategy.type == "rolling":
        size = strategy.batch_size or strategy.max_unavailable or 1
        cap = strategy.max_unavailable or size
        batches = [names[i : i + size] for i in range(0, len(names), size)]
        return [
            Wave(i, WaveKind.DEPLOY, batch, parallel=cap, pause_s=pause if i < len(batches) - 1 else 0.0)
            for i, batch in enumerate(batches)
        ]
    if strategy.type == "canary":
        waves, start = [], 0
        counts = sorted(set(strategy.resolved_steps(len(names))))
        for i, end in enumerate(counts):
            last = i == len(counts) - 1
            waves.append(
                Wave(
                    i,
                    WaveKind.DEPLOY,
                    names[start:end],
                    analysis_s=0.0 if last else strategy.analysis_window.total_seconds(),
                    pause_s=0.0 if last else pause,
                )
            )
            start = end
        return [w for w in waves if w.devices]
    return [Wave(0, WaveKind.DEPLOY, names)]


@dataclass(frozen=True)
class OfflineDecision:
    """What to do about unreachable devices: skip them (reported), or refuse the whole rollout."""

    skipped: tuple[str, ...]
    refusal: str | None  # set when policy is fail and some device is offline


def decide_offline(policy: str, offline: Sequence[str]) -> OfflineDecision:
    """Apply `strategy.offline` (skip | fail) to the devices the facts found unreachable."""
    if not offline:
        return OfflineDecision((), None)
    if policy == "skip":
        return OfflineDecision(tuple(offline), None)
    return OfflineDecision(
        (), f"{len(offline)} device(s) offline: {', '.join(offline)}; strategy.offline is 'fail'"
    )


def should_halt(failed: int, limit: int) -> bool:
    """True when `failed` devices reach the failure threshold (a limit of 0 never halts)."""
    return limit > 0 and failed >= limit


@dataclass(frozen=True)
class MetricsSnapshot:
    """The counters of one /metrics scrape the analysis (and `status`) need."""

    requests: float = 0.0
    errors: float = 0.0  # requests answered with a 5xx status
    answers: float = 0.0  # generation requests answered by the device or its fallback upstream
    fallbacks: float = 0.0  # of those, answered by the upstream
    fallbacks_5m: float | None = None  # the upstream's answers over the last 5 minutes
    edge_status: str | None = None  # ready | busy | offline, as the agent sees itself

    def fallback_rate(self, before: MetricsSnapshot) -> tuple[float, float] | None:
        """(share of answers the upstream gave since `before`, answers) or None without answers."""
        answers = self.answers - before.answers
        return ((self.fallbacks - before.fallbacks) / answers, answers) if answers > 0 else None


@dataclass(frozen=True)
class Sample:
    """What the analysis saw on one device: metrics at the start and end of the window, the final
    readiness and the latency of the smoke prompts sent at its end (None when they failed)."""

    device: str
    ready: bool
    smoke_ms: float | None
    before: MetricsSnapshot
    after: MetricsSnapshot


def judge(
    sample: Sample,
    *,
    latency_budget_ms: float,
    max_error_rate: float = MAX_ERROR_RATE,
    baseline_fallback_rate: float | None = None,
) -> str | None:
    """Why the device failed its analysis, or None when it passed. `baseline_fallback_rate` is the
    share of answers the fallback upstream gave on the devices not yet updated, in the same window
    (None when they answered nothing)."""
    if not sample.ready:
        return "not ready at the end of the analysis window"
    if sample.smoke_ms is None:
        return "the smoke prompts failed"
    if sample.smoke_ms > latency_budget_ms:
        return f"smoke latency {sample.smoke_ms:.0f} ms is over the {latency_budget_ms:.0f} ms budget"
    served = sample.after.requests - sample.before.requests
    failed = sample.after.errors - sample.before.errors
    if served > 0 and failed / served > max_error_rate:
        return f"error rate {failed / served:.1%} over {served:.0f} requests exceeds {max_error_rate:.0%}"
    rate = sample.after.fallback_rate(sample.before)
    if rate is not None and baseline_fallback_rate is not None:
        share, answers = rate
        excess = share - baseline_fallback_rate
        if share > MAX_FALLBACK_RATIO * baseline_fallback_rate and excess >= MIN_FALLBACK_EXCESS:
            return (
                f"fallback rate {share:.1%} over {answers:.0f} answers is more than "
                f"{MAX_FALLBACK_RATIO:g}x the {baseline_fallback_rate:.1%} of the devices still on the "
                "old version"
            )
    return None
