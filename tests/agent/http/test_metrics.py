"""The agent's metrics on prometheus_client: names as before, parseable, per-agent registries."""

from prometheus_client.parser import text_string_to_metric_families

from deployer.agent.http.metrics import AgentMetrics


def test_render_parses_and_keeps_the_names():
    metrics = AgentMetrics()
    metrics.requests.labels(endpoint="/v1/models", status="200").inc(3)
    metrics.ttft.labels(adapter="").observe(0.3)
    metrics.model_info.labels(
        model="m", version="1", quantization="int8", kernel="k", engine="torch", device="cpu"
    ).set(1)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    assert {"sits_requests", "sits_time_to_first_token_seconds", "sits_model_info"} <= set(families)
    assert "process_resident_memory_bytes" in families
    assert metrics.value("sits_requests_total", endpoint="/v1/models", status="200") == 3
    assert metrics.value("sits_time_to_first_token_seconds_count", adapter="") == 1
    assert metrics.value("sits_requests_total", endpoint="/nope", status="200") == 0
    assert not any(name.endswith("_created") for f in families.values() for name, *_ in f.samples)


def test_agents_do_not_share_counters():
    first, second = AgentMetrics(), AgentMetrics()
    first.generation_tokens.labels(adapter="").inc(5)
    assert second.value("sits_generation_tokens_total", adapter="") == 0
