"""The agent serving the real SmolLM2-135M-Instruct to the official openai client."""

from __future__ import annotations

import openai
import pytest

from deployer.agent.engines import make_engine
from deployer.agent.http.server import AgentServer
from deployer.agent.settings import AgentSettings, SmokePrompt


@pytest.mark.slow
def test_smollm2_answers_the_openai_client(smollm2_dir):
    settings = AgentSettings(
        port=0,
        context_length=512,
        max_prompt_tokens=256,
        smoke_prompts=(SmokePrompt(prompt="What is the capital of France?", expect="Paris", max_tokens=16),),
        latency_budget_ms=120_000,
    )
    server = AgentServer(settings, lambda: make_engine("torch", context_length=512, threads=2))
    server.start()
    try:
        result = server.reload(smollm2_dir, "1.0.0")
        assert result.ok, result
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
        (model,) = client.models.list().data
        answer = client.chat.completions.create(
            model=model.id,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20,
            temperature=0,
        )
        assert "Paris" in answer.choices[0].message.content
        streamed = client.chat.completions.create(
            model=model.id,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20,
            temperature=0,
            stream=True,
        )
        assert (
            "".join(c.choices[0].delta.content or "" for c in streamed) == answer.choices[0].message.content
        )
    finally:
        server.stop()
