"""The official openai client against a running agent: chat, streaming, completions, models."""

from __future__ import annotations

import openai
import pytest

from tests.agent.conftest import parse_samples

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def agent(start_agent):
    return start_agent()


@pytest.fixture
def client(agent):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{agent.port}/v1", api_key="unused", max_retries=0)


def test_chat_answer_has_usage_and_finish_reason(agent, client, model_name):
    answer = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=6, temperature=0)
    choice = answer.choices[0]
    assert answer.object == "chat.completion"
    assert answer.model == f"{agent.manager.active_info().model}@v1"
    assert choice.message.role == "assistant"
    assert choice.finish_reason in {"stop", "length"}
    assert 1 <= answer.usage.completion_tokens <= 6
    assert answer.usage.prompt_tokens > 5
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_stream_with_usage_matches_the_plain_answer(client, model_name):
    plain = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=8, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.completion_tokens == plain.usage.completion_tokens
    assert last.usage.prompt_tokens == plain.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1


def test_stream_without_usage_has_no_usage_chunk(client, model_name):
    chunks = list(
        client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=3, stream=True)
    )
    assert all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)


def test_seeded_sampling_repeats(client, model_name):
    def sample():
        return (
            client.chat.completions.create(
                model=model_name, messages=MESSAGES, max_tokens=8, temperature=1.0, top_p=0.9, seed=42
            )
            .choices[0]
            .message.content
        )

    assert sample() == sample()


def test_stop_string_cuts_the_answer(client, model_name):
    plain = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=12, temperature=0)
    text = plain.choices[0].message.content
    assert len(text) >= 2
    stop = text[1]
    cut = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]


def test_completions_plain_and_streamed(client, model_name):
    plain = client.completions.create(model=model_name, prompt="The capital of", max_tokens=5, temperature=0)
    assert plain.object == "text_completion"
    assert plain.usage.completion_tokens <= 5
    chunks = list(
        client.completions.create(
            model=model_name,
            prompt="The capital of",
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_models_lists_active_then_previous(agent, client, tiny_model_dir_b):
    (only,) = client.models.list().data
    assert only.id == f"{agent.manager.active_info().model}@v1"
    assert (only.status, only.version, only.quantization) == ("active", "v1", "fp32")
    # fp32 on a CPU: ours on an AVX2-only CPU, else oneDNN's linear or F.linear, per shape,
    # whichever the load timed faster.
    assert set(only.kernel.split("+")) <= {
        "mkldnn._linear_pointwise",
        "linear",
        "sits.fp32_linear (ours, AVX2)",
    }
    # The engine's own facts come along: on a CPU the KV cache is fp32 and compile stays off.
    assert (only.extra["kv_cache"], only.extra["compile"]) == ("fp32", "off")
    assert only.extra == agent.manager.active_info().extra
    assert agent.reload(tiny_model_dir_b, "v2").ok
    active, previous = client.models.list().data
    assert (active.version, active.status, active.loaded) == ("v2", "active", True)
    assert (previous.version, previous.status, previous.loaded) == ("v1", "previous", False)


def test_health_ready_and_metrics(agent, client, model_name, http, wait_until):
    client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=3)
    # The server counts a request just after answering it.
    wait_until(
        lambda: agent.metrics.value("sits_requests_total", endpoint="/v1/chat/completions", status="200"),
        "counted",
    )
    wait_until(lambda: agent.manager.counts().running == 0, "slot returned")
    assert http(agent.port, "GET", "/healthz")[0] == 200
    status, _, body = http(agent.port, "GET", "/readyz")
    assert (status, body["version"]) == (200, "v1")
    status, headers, text = http(agent.port, "GET", "/metrics")
    assert status == 200
    assert headers["content-type"].startswith("text/plain; version=")
    samples = parse_samples(text)
    assert samples[("sits_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))] == 1
    assert samples[("sits_time_to_first_token_seconds_count", (("adapter", ""),))] == 1
    assert samples[("sits_e2e_request_latency_seconds_count", (("adapter", ""),))] == 1
    assert samples[("sits_reloads_total", (("result", "success"),))] == 1
    (info,) = [dict(labels) for name, labels in samples if name == "sits_model_info"]
    assert (info["version"], info["quantization"]) == ("v1", "fp32")
    assert samples[("sits_requests_running", ())] == 0
    assert samples[("sits_generation_tokens_total", (("adapter", ""),))] >= 1
    assert samples[("process_resident_memory_bytes", ())] > 0  # process metrics come along


def test_suffix_fills_in_the_middle_where_the_model_has_fim_tokens(start_agent, tmp_path):
    from deployer.agent.chat import TextCodec
    from deployer.build.demo_model import make_tiny_checkpoint

    fim = make_tiny_checkpoint(
        tmp_path / "fim", extra_special_tokens=("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
    )
    agent = start_agent(load=False)
    assert agent.reload(fim, "v1").ok
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{agent.port}/v1", api_key="unused", max_retries=0)
    answer = client.completions.create(model="fim", prompt="def f(", suffix="):", max_tokens=3, temperature=0)
    codec = TextCodec.from_dir(fim)
    pre, suf, mid = (codec.token_id(t) for t in ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))
    prefix, suffix = (codec.encode(text, add_special_tokens=False) for text in ("def f(", "):"))
    assert answer.usage.prompt_tokens == len([pre, *prefix, suf, *suffix, mid])
    assert answer.usage.completion_tokens >= 1
