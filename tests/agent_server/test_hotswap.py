"""Hot swaps on a running agent: under load with no failed request, refusals that keep the old model,
and the unload-first policy's gap (503 + Retry-After) and restore."""

from __future__ import annotations

import threading

import openai

from deployer.agent.engines import make_engine
from deployer.agent.hotswap import ModelManager
from deployer.agent.settings import AgentSettings, SmokePrompt

MESSAGES = [{"role": "user", "content": "Hello"}]


def _client(agent):
    # No retries: a request that fails during a swap must show up as a failure.
    return openai.OpenAI(base_url=f"http://127.0.0.1:{agent.port}/v1", api_key="unused", max_retries=0)


def test_swaps_under_concurrent_load_fail_no_request(
    start_agent, tiny_model_dir, tiny_model_dir_b, http, wait_until
):
    agent = start_agent(max_concurrent=4, queue_length=16)
    client = _client(agent)
    stop = threading.Event()
    served, failures = [], []

    def hammer():
        while not stop.is_set():
            try:
                answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
                served.append(answer.model)
            except openai.OpenAIError as exc:
                failures.append(repr(exc))

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for thread in threads:
        thread.start()
    results = []
    try:
        for version, directory in (
            ("v2", tiny_model_dir_b),
            ("v1", tiny_model_dir),
            ("v2", tiny_model_dir_b),
        ):
            status, _, body = http(
                agent.port, "POST", "/admin/reload", {"version": version, "artifact_dir": str(directory)}
            )
            results.append((status, body["ok"], body["active_version"]))
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    assert failures == []
    assert results == [(200, True, "v2"), (200, True, "v1"), (200, True, "v2")]
    assert {model.rsplit("@", 1)[1] for model in served} == {"v1", "v2"}
    assert agent.metrics.reloads.value(result="success") == 4  # the first load and three swaps
    wait_until(lambda: agent.manager.counts().running == 0, "every slot returned")


def test_broken_artifact_is_refused_and_the_old_keeps_serving(start_agent, broken_model_dir, http, chat_body):
    agent = start_agent()
    status, _, body = http(
        agent.port, "POST", "/admin/reload", {"version": "v2", "artifact_dir": str(broken_model_dir)}
    )
    assert (status, body["ok"], body["phase"], body["active_version"]) == (409, False, "load", "v1")
    assert body["reason"].startswith("load failed:")
    status, _, answer = http(agent.port, "POST", "/v1/chat/completions", chat_body())
    assert (status, answer["model"].rsplit("@", 1)[1]) == (200, "v1")
    assert http(agent.port, "GET", "/readyz")[0] == 200
    assert agent.metrics.reloads.value(result="failure") == 1


def test_reload_without_body_needs_an_installed_version(start_agent, http):
    agent = start_agent(load=False)
    status, _, body = http(agent.port, "POST", "/admin/reload", {})
    assert (status, body["error"]["code"]) == (409, "no_version")
    status, _, body = http(agent.port, "POST", "/admin/reload", {"versoin": "v1"})
    assert status == 400


def _manager(**overrides):
    settings = AgentSettings(port=0, context_length=256, max_prompt_tokens=128, **overrides)
    return ModelManager(lambda: make_engine("torch", context_length=256, threads=1), settings)


def test_smoke_over_the_latency_budget_refuses_the_swap(tiny_model_dir):
    manager = _manager(latency_budget_ms=1, smoke_prompts=(SmokePrompt(prompt="Hello", max_tokens=64),))
    result = manager.swap_to(tiny_model_dir, "v1")
    assert (result.ok, result.phase, result.active_version) == (False, "smoke", None)
    assert "budget 1 ms" in result.reason
    assert not manager.ready


def test_smoke_answer_without_the_expected_text_refuses_the_swap(tiny_model_dir, tiny_model_dir_b):
    manager = _manager(smoke_prompts=(SmokePrompt(prompt="Hello", expect="no tiny model says this"),))
    result = manager.swap_to(tiny_model_dir, "v1")
    assert (result.ok, result.phase) == (False, "smoke")
    assert "no tiny model says this" in result.reason


def test_unload_first_gap_answers_503_then_serves_the_new_model(
    start_agent, tiny_model_dir, tiny_model_dir_b, http, chat_body
):
    gate = threading.Event()
    calls, results = [], []

    def gated_factory():
        calls.append(1)
        if len(calls) == 2:  # the swap's new engine: hold the gap open until the test has looked
            assert gate.wait(120)
        return make_engine("torch", context_length=256, threads=1)

    agent = start_agent(factory=gated_factory, swap_policy="unload-first")
    swap = threading.Thread(target=lambda: results.append(agent.reload(tiny_model_dir_b, "v2")))
    swap.start()
    try:
        for _ in range(1200):
            status, headers, body = http(agent.port, "POST", "/v1/chat/completions", chat_body())
            if status == 503:
                break
        assert (status, body["error"]["code"]) == (503, "model_unavailable")
        assert int(headers["Retry-After"]) >= 1
        assert http(agent.port, "GET", "/readyz")[0] == 503
    finally:
        gate.set()
        swap.join(120)
    (result,) = results
    assert (result.ok, result.policy, result.active_version) == (True, "unload-first", "v2")
    status, _, answer = http(agent.port, "POST", "/v1/chat/completions", chat_body())
    assert (status, answer["model"].rsplit("@", 1)[1]) == (200, "v2")


def test_unload_first_failure_restores_the_old_model(start_agent, broken_model_dir, http, chat_body):
    agent = start_agent(swap_policy="unload-first")
    result = agent.reload(broken_model_dir, "v2", reason="update")
    assert (result.ok, result.phase, result.restored, result.active_version) == (False, "load", True, "v1")
    status, _, answer = http(agent.port, "POST", "/v1/chat/completions", chat_body())
    assert (status, answer["model"].rsplit("@", 1)[1]) == (200, "v1")
    assert agent.metrics.rollbacks.value(result="success") == 1


def test_rollback_reloads_are_counted(start_agent, tiny_model_dir_b):
    agent = start_agent()
    assert agent.reload(tiny_model_dir_b, "v0", reason="rollback").ok
    assert agent.metrics.rollbacks.value(result="success") == 1
