"""A request with thousands of tools (about 900 KB) is refused at once with a 400 naming `tools`,
through the official openai client: building its grammar once took seconds of a quadratic lookup
on the event loop, long enough for the loop watchdog to stop the agent."""

from __future__ import annotations

import json

import openai
import pytest

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}


def test_thousands_of_tools_are_a_400_naming_tools(start_agent, model_name, http):
    agent = start_agent(max_request_bytes=2 << 20)
    tools = [
        {
            "type": "function",
            "function": {"name": f"tool_{i}", "description": "d" * 60, "parameters": WEATHER},
        }
        for i in range(5000)
    ]
    assert len(json.dumps(tools)) > 800_000
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{agent.port}/v1", api_key="x", max_retries=0, timeout=30
    )
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "hi"}], tools=tools, max_tokens=4
        )
    assert info.value.param == "tools"
    assert "at most 128 items" in info.value.message
    assert http(agent.port, "GET", "/healthz")[0] == 200
