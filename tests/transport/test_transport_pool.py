"""Bounded parallelism over devices, and the retry backoff schedule."""

from __future__ import annotations

import random
import threading
import time

import pytest

from deployer.errors import ConfigError, TransportError
from deployer.transport.base import RetryPolicy
from deployer.transport.pool import Outcome, run_bounded


def test_outcomes_come_back_in_input_order():
    outcomes = run_bounded(range(10), lambda i: i * i, parallel=4)
    assert [o.result for o in outcomes] == [i * i for i in range(10)]
    assert all(o.ok for o in outcomes)


@pytest.mark.parametrize("parallel", [1, 3])
def test_exactly_parallel_jobs_run_at_once(parallel):
    # Jobs meet in groups of `parallel` at a barrier: fewer workers would break it (timeout), and
    # more would let a job count more than `parallel` running.
    barrier = threading.Barrier(parallel, timeout=10)
    running = 0
    peak = 0
    lock = threading.Lock()

    def job(_: int) -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        barrier.wait()
        with lock:
            running -= 1

    run_bounded(range(4 * parallel), job, parallel=parallel)
    assert peak == parallel


def test_a_device_error_is_that_device_outcome_and_the_rest_go_on():
    def job(i: int) -> int:
        if i == 2:
            raise TransportError("dev2: cannot connect")
        return i

    seen: list[Outcome[int, int]] = []
    outcomes = run_bounded(range(5), job, parallel=2, on_done=seen.append)
    assert [o.ok for o in outcomes] == [True, True, False, True, True]
    assert str(outcomes[2].error) == "dev2: cannot connect"
    assert sorted(o.item for o in seen) == [0, 1, 2, 3, 4]


def test_a_bug_in_a_job_propagates_and_unstarted_jobs_never_start():
    started: list[int] = []

    def job(i: int) -> None:
        started.append(i)
        if i == 0:
            raise ZeroDivisionError("bug")
        time.sleep(0.05)

    with pytest.raises(ZeroDivisionError):
        run_bounded(range(50), job, parallel=1)
    assert len(started) < 50


def test_parallel_below_one_is_refused():
    with pytest.raises(ConfigError, match="--parallel must be at least 1"):
        run_bounded([1], lambda i: i, parallel=0)


def test_backoff_starts_at_once_then_grows_within_its_caps():
    policy = RetryPolicy(attempts=6, base_delay_s=0.5, max_delay_s=3.0)
    for seed in range(20):
        delays = list(policy.delays(random.Random(seed)))
        caps = [0.0, 0.5, 1.0, 2.0, 3.0, 3.0]
        assert len(delays) == 6 and delays[0] == 0.0
        assert all(0.0 <= d <= cap for d, cap in zip(delays, caps, strict=True))


def test_backoff_is_jittered():
    policy = RetryPolicy(attempts=3)
    assert len({tuple(policy.delays(random.Random(seed))) for seed in range(5)}) == 5
