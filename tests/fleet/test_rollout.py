"""The pure rollout decisions: waves per strategy, offline policy, threshold, metrics analysis."""

from __future__ import annotations

import pytest

from deployer.config.models import Strategy
from deployer.push.health import parse_metrics
from deployer.push.rollout import (
    MetricsSnapshot,
    Sample,
    WaveKind,
    decide_offline,
    judge,
    make_waves,
    should_halt,
)

NAMES = [f"d{i}" for i in range(1, 11)]


def _waves(**strategy):
    return [(w.kind, list(w.devices), w.parallel) for w in make_waves(Strategy(**strategy), NAMES)]


def test_all_at_once_is_one_wave():
    assert _waves(type="all-at-once") == [(WaveKind.DEPLOY, NAMES, None)]


def test_rolling_batches_with_max_unavailable_as_parallel_cap():
    waves = make_waves(Strategy(type="rolling", batch_size=4, max_unavailable=2, pause="5s"), NAMES)
    assert [list(w.devices) for w in waves] == [NAMES[:4], NAMES[4:8], NAMES[8:]]
    assert {w.parallel for w in waves} == {2}
    assert [w.pause_s for w in waves] == [5.0, 5.0, 0.0]


def test_canary_cumulative_steps_with_analysis_except_after_the_last():
    waves = make_waves(Strategy(type="canary", steps=[1, "50%"], analysis_window="30s", pause="1m"), NAMES)
    assert [list(w.devices) for w in waves] == [NAMES[:1], NAMES[1:5], NAMES[5:]]
    assert [w.analysis_s for w in waves] == [30.0, 30.0, 0.0]
    assert [w.pause_s for w in waves] == [60.0, 60.0, 0.0]


def test_canary_duplicate_steps_make_no_empty_waves():
    waves = make_waves(Strategy(type="canary", steps=[1, 1, "10%"]), NAMES)
    assert [len(w.devices) for w in waves] == [1, 9]


def test_blue_green_stages_everything_before_switching():
    assert _waves(type="blue-green") == [(WaveKind.STAGE, NAMES, None), (WaveKind.SWITCH, NAMES, None)]


def test_no_devices_no_waves():
    assert make_waves(Strategy(type="canary"), []) == []


def test_offline_policy():
    assert decide_offline("skip", ["d3"]).skipped == ("d3",)
    refused = decide_offline("fail", ["d3", "d4"])
    assert refused.skipped == () and "d3, d4" in (refused.refusal or "")
    assert decide_offline("fail", []).refusal is None


@pytest.mark.parametrize(
    ("failed", "limit", "halt"), [(0, 1, False), (1, 1, True), (2, 3, False), (5, 0, False)]
)
def test_threshold(failed, limit, halt):
    assert should_halt(failed, limit) is halt


METRICS = """# HELP sits_requests_total Requests answered, by endpoint and HTTP status.
# TYPE sits_requests_total counter
sits_requests_total{endpoint="/v1/chat/completions",status="200"} 90.0
sits_requests_total{endpoint="/v1/chat/completions",status="503"} 8.0
sits_requests_total{endpoint="/v1/completions",status="500"} 2.0
sits_reloads_total{result="success"} 3.0
"""


def test_parse_metrics_counts_requests_and_5xx():
    assert parse_metrics(METRICS) == MetricsSnapshot(requests=100.0, errors=10.0)
    assert parse_metrics("garbage\n") == MetricsSnapshot()


def _sample(ready=True, smoke_ms=100.0, before=(0, 0), after=(0, 0)):
    return Sample("d1", ready, smoke_ms, MetricsSnapshot(*before), MetricsSnapshot(*after))


def test_judge_passes_a_healthy_device():
    assert judge(_sample(after=(100, 1)), latency_budget_ms=500) is None


@pytest.mark.parametrize(
    ("sample", "words"),
    [
        (_sample(ready=False), "not ready"),
        (_sample(smoke_ms=None), "smoke prompts failed"),
        (_sample(smoke_ms=900.0), "over the 500 ms budget"),
        (_sample(before=(100, 0), after=(200, 10)), "error rate 10.0%"),
    ],
)
def test_judge_fails_with_a_reason(sample, words):
    assert words in (judge(sample, latency_budget_ms=500) or "")
