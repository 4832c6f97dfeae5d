"""Hot swaps on a running agent: refusals that keep the old model, and the unload-first policy's gap
(503 + Retry-After) and restore. Swaps under 16 streaming clients: test_scheduler_http.py."""

from __future__ import annotations

import json
import logging
import shutil
import threading

from deployer.agent.engines import make_engine
from deployer.agent.runtime.hotswap import ModelManager
from deployer.agent.settings import AgentSettings, SmokePrompt


def test_broken_artifact_is_refused_and_the_old_keeps_serving(start_agent, broken_model_dir, http, chat_body):
    agent = start_agent()
    result = agent.reload(broken_model_dir, "v2")
    assert (result.ok, result.phase, result.active_version) == (False, "load", "v1")
    assert result.reason.startswith("load failed:")
    status, _, answer = http(agent.port, "POST", "/v1/chat/completions", chat_body())
    assert (status, answer["model"].rsplit("@", 1)[1]) == (200, "v1")
    assert http(agent.port, "GET", "/readyz")[0] == 200
    assert agent.metrics.value("sits_reloads_total", result="failure") == 1


def _manager(**overrides):
    settings = AgentSettings(port=0, context_length=256, max_prompt_tokens=128, **overrides)
    return ModelManager(lambda: make_engine("torch", context_length=256, threads=1), settings)


def test_each_load_logs_where_the_model_runs_and_why(tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="sits.agent"):
        assert _manager().swap_to(tiny_model_dir, "v1").ok
    prefix = "sits-agent event "
    events = [
        json.loads(r.getMessage()[len(prefix) :]) for r in caplog.records if r.getMessage().startswith(prefix)
    ]
    (loaded,) = [e for e in events if e["event"] == "loaded"]
    assert loaded == {
        "event": "loaded",
        "version": "v1",
        "reason": "cpu (asked for)",  # _manager's factory makes the engine with the default device
        "engine": "torch",
        "device": "cpu",
        "compile": "off",
    }


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
    start_agent, tiny_model_dir_b, model_name, tmp_path, http, chat_body
):
    v2_dir = tmp_path / "v2" / model_name  # the next version of the same model
    shutil.copytree(tiny_model_dir_b, v2_dir)
    gate = threading.Event()
    calls, results = [], []

    def gated_factory():
        calls.append(1)
        if len(calls) == 2:  # the swap's new engine: hold the gap open until the test has looked
            assert gate.wait(120)
        return make_engine("torch", context_length=256, threads=1)

    agent = start_agent(factory=gated_factory, swap_policy="unload-first")
    swap = threading.Thread(target=lambda: results.append(agent.reload(v2_dir, "v2")))
    swap.start()
    try:
        for _ in range(1200):
            status, headers, body = http(agent.port, "POST", "/v1/chat/completions", chat_body())
            if status == 503:
                break
        assert (status, body["error"]["code"]) == (503, "model_unavailable")
        assert int(headers["retry-after"]) >= 1
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
    assert agent.metrics.value("sits_rollbacks_total", result="success") == 1


def test_rollback_reloads_are_counted(start_agent, tiny_model_dir_b):
    agent = start_agent()
    assert agent.reload(tiny_model_dir_b, "v0", reason="rollback").ok
    assert agent.metrics.value("sits_rollbacks_total", result="success") == 1
