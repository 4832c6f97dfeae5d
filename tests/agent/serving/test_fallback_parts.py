"""The fallback's small parts on their own: the breaker's states on a fake clock, the windows."""

from deployer.agent.serving.fallback.breaker import CircuitBreaker
from deployer.agent.serving.fallback.window import RecentEvents, RecentLatencies
from deployer.agent.serving.timing import ServiceTimes


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_failures_then_lets_one_trial_through_with_doubling_backoff():
    clock = Clock()
    breaker = CircuitBreaker(failures=2, backoff_s=10, max_backoff_s=25, clock=clock)
    breaker.failure()
    assert breaker.state == "closed" and breaker.allow()
    breaker.failure()
    assert breaker.state == "open" and not breaker.allow()
    assert breaker.retry_after_s() == 10
    clock.now = 10
    assert breaker.state == "half-open"
    assert breaker.allow() and not breaker.allow()  # one trial only
    breaker.failure()  # the trial failed: 20 s now
    clock.now = 29
    assert breaker.state == "open"
    clock.now = 30
    assert breaker.allow()
    breaker.failure()  # capped at 25 s
    assert breaker.retry_after_s() == 25
    clock.now = 55
    assert breaker.allow()
    breaker.success()
    assert breaker.state == "closed" and breaker.allow()
    breaker.failure()
    assert breaker.state == "closed"  # the count started again


def test_a_cancelled_trial_lets_the_next_caller_try():
    clock = Clock()
    breaker = CircuitBreaker(failures=1, backoff_s=1, max_backoff_s=1, clock=clock)
    breaker.failure()
    clock.now = 1
    assert breaker.allow() and not breaker.allow()
    breaker.release()
    assert breaker.allow()


def test_p95_over_the_last_calls_and_events_within_the_window():
    latencies = RecentLatencies(3)
    assert latencies.p95() is None
    for value in (5.0, 0.1, 0.2, 0.3):
        latencies.add(value)
    assert latencies.p95() == 0.3  # the 5 s call has left the window
    clock = Clock()
    events = RecentEvents(300, clock)
    events.add()
    clock.now = 200
    events.add()
    assert events.count() == 2
    clock.now = 301
    assert events.count() == 1


def test_the_estimate_grows_with_the_queue_and_the_prompt():
    times = ServiceTimes()
    assert times.first_token_estimate(3, 100) is None
    times.add(began=0.0, first=0.1, ended=1.1, prompt_chars=100, tokens=11)  # 0.1 s prefill, 1 s decode
    assert times.first_token_estimate(0, 100) == 0.1
    assert times.first_token_estimate(0, 200) == 0.2
    assert times.first_token_estimate(2, 100) == 2 * 1.1 + 0.1
