"""The Prometheus text registry renders what was recorded, in the exposition format."""

import threading

import pytest

from deployer.agent.http.metrics import AgentMetrics, Registry


def test_counter_and_gauge_lines():
    registry = Registry()
    requests = registry.counter("x_requests_total", "Requests.", ("code",))
    running = registry.gauge("x_running", "Running.")
    requests.inc(code="200")
    requests.inc(2, code="200")
    requests.inc(code="429")
    running.set(3)
    running.dec()
    text = registry.render()
    assert text.endswith("\n")
    assert "# TYPE x_requests_total counter" in text
    assert 'x_requests_total{code="200"} 3.0' in text
    assert 'x_requests_total{code="429"} 1.0' in text
    assert "# TYPE x_running gauge\nx_running 2.0" in text


def test_histogram_buckets_are_cumulative():
    registry = Registry()
    latency = registry.histogram("x_seconds", "Latency.", buckets=(0.1, 1.0))
    for value in (0.05, 0.5, 0.7, 5.0):
        latency.observe(value)
    lines = registry.render().splitlines()
    assert 'x_seconds_bucket{le="0.1"} 1' in lines
    assert 'x_seconds_bucket{le="1.0"} 3' in lines
    assert 'x_seconds_bucket{le="+Inf"} 4' in lines
    assert "x_seconds_count 4" in lines
    assert "x_seconds_sum 6.25" in lines
    assert latency.count() == 4


def test_label_values_are_escaped_and_labels_checked():
    registry = Registry()
    info = registry.gauge("x_info", "Info.", ("version",))
    info.set(1, version='a"b\\c\nd')
    assert 'x_info{version="a\\"b\\\\c\\nd"} 1.0' in registry.render()
    with pytest.raises(ValueError, match="takes labels"):
        info.set(1, other="x")
    with pytest.raises(ValueError, match="cannot decrease"):
        registry.counter("x_total", "T.").inc(-1)
    with pytest.raises(ValueError, match="twice"):
        registry.gauge("x_info", "again")


def test_gauge_clear_drops_old_label_sets():
    metrics = AgentMetrics()
    labels = dict(model="m", quantization="int8", kernel="k", engine="torch", device="cpu")
    metrics.model_info.set(1, version="1", **labels)
    metrics.model_info.clear()
    metrics.model_info.set(1, version="2", **labels)
    text = metrics.render()
    assert 'version="2"' in text
    assert 'version="1"' not in text


def test_concurrent_increments_are_not_lost():
    metrics = AgentMetrics()

    def work():
        for _ in range(1000):
            metrics.generation_tokens.inc()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert metrics.generation_tokens.value() == 4000
