"""agent.yaml's `draft: int4` through the agent, asked with the official `openai` client: greedy
answers equal those of an agent without a draft, streamed or not, alone and four at once, and
/v1/models shows the draft's acceptance as it grows (the engine's description now, not the one
at load)."""

from __future__ import annotations

import threading

import openai
import pytest

from deployer.agent.http.server import AgentServer, engine_factory_for
from deployer.agent.settings import AgentSettings

QUESTIONS = ("Tell me about edge devices.", "What is a delta patch?", "hello world 123", "Name a colour.")


def ask(client: openai.OpenAI, model: str, question: str, stream: bool = False) -> str:
    messages = [{"role": "user", "content": question}]
    if not stream:
        done = client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0)
        return done.choices[0].message.content or ""
    chunks = client.chat.completions.create(
        model=model, messages=messages, max_tokens=48, temperature=0, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.fixture(scope="module")
def agents(varied_model_dir, tmp_path_factory):
    """An agent without a draft and one with `draft: int4`, on a random checkpoint whose greedy
    tokens have clear margins (the draft proposes only tokens it is sure of)."""
    servers = []
    for draft in ("off", "int4"):
        root = tmp_path_factory.mktemp(f"draft-{draft}")
        settings = AgentSettings(
            port=0,
            root=root,
            admin_socket=None,
            threads=1,
            context_length=256,
            max_prompt_tokens=128,
            max_concurrent=4,
            draft=draft,
            latency_budget_ms=60_000,
        )
        server = AgentServer(settings, engine_factory_for(settings))
        server.start()
        servers.append(server)
        assert server.reload(varied_model_dir, "v1").ok
    yield servers
    for server in servers:
        server.stop()


def client_of(server: AgentServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)


def draft_line(client: openai.OpenAI) -> str:
    [model] = client.models.list().data
    return model.model_extra["extra"]["draft"]


def proposals(line: str) -> int:
    return int(line.split(" of ")[1].split()[0]) if " of " in line else 0


def test_greedy_answers_equal_an_agent_without_a_draft_and_models_shows_the_rounds(agents):
    plain, drafted = (client_of(s) for s in agents)
    model = plain.models.list().data[0].id
    before = proposals(draft_line(drafted))
    assert draft_line(plain) == "off"
    for question in QUESTIONS[:2]:
        for stream in (False, True):
            assert ask(drafted, model, question, stream) == ask(plain, model, question, stream)
    line = draft_line(drafted)
    assert line.startswith("int4-g32 (draft), up to 5 proposals a round")
    assert proposals(line) > before  # what the requests proposed shows at once


def test_four_clients_at_once_get_the_answers_each_gets_alone(agents):
    plain = client_of(agents[0])
    model = plain.models.list().data[0].id
    alone = {q: ask(plain, model, q) for q in QUESTIONS}
    together: dict[str, str] = {}

    def one(question: str) -> None:
        together[question] = ask(client_of(agents[1]), model, question, stream=True)

    threads = [threading.Thread(target=one, args=(q,)) for q in QUESTIONS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert together == alone
