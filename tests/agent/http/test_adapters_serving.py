"""LoRA adapters served by the agent (issue #41): loaded from the device's adapter store at start-up
and by the admin socket, listed by /v1/models, selected per request by the official `openai`
client's `model`, batched with the base and each other, counted per adapter in /metrics. The
adapters are real PEFT adapters of the tiny model."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner

from deployer.agent.cli import cli
from deployer.agent.engines import make_engine
from deployer.agent.engines.base import Engine
from deployer.agent.http.server import AgentServer
from deployer.agent.ota.adapters import AdapterStore
from deployer.core.fsutil import read_json_object
from deployer.core.lora import from_peft, write_adapter
from tests.agent.conftest import EngineWrapper, StartAgent, parse_samples
from tests.agent.engines.torch.steps import PROMPTS
from tests.agent.lora_helpers import make_peft_adapter


@pytest.fixture(scope="module")
def artifacts(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapter artifacts: `summarise` 1 and 2, `extract` 1 (different seeds: different answers)."""
    out = {}
    for key, (name, version, seed) in {
        "summarise-1": ("summarise", "1", 1),
        "summarise-2": ("summarise", "2", 3),
        "extract-1": ("extract", "1", 2),
    }.items():
        peft = make_peft_adapter(tiny_model_dir, tmp_path_factory.mktemp(f"peft-{key}"), seed=seed, b_std=0.3)
        artifact = tmp_path_factory.mktemp(key)
        write_adapter(from_peft(peft, name, version, "tiny-base"), artifact)
        out[key] = artifact
    return out


def install(server_root: Path, artifact: Path, counter: int) -> None:
    """Install an artifact in the device's adapter store, as `sits-agent adapter install` does after
    verifying it (lora-fleet's side)."""
    meta = read_json_object(artifact / "adapter.json")
    name, version = meta["name"], meta["version"]
    AdapterStore(server_root).install(name, artifact, f"{name}-{version}-id", version, counter)


def store_root(root: Path) -> Path:
    from deployer.agent.ota.store import DeviceStore

    return DeviceStore(root).base


def client(server: AgentServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)


def ask(server: AgentServer, model: str) -> tuple[str, str]:
    """(the greedy completion, the model id the answer names). A plain completion: the random tiny
    model answers any chat prompt the same way, base or adapter."""
    answer = client(server).completions.create(model=model, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    return answer.choices[0].text, answer.model


@pytest.fixture
def agent(start_agent: StartAgent, short_dir: Path, artifacts: dict[str, Path]) -> AgentServer:
    """An agent whose store has `summarise` 1 and `extract` 1 installed before it starts."""
    root = short_dir / "root0"
    for artifact in ("summarise-1", "extract-1"):
        install(store_root(root), artifacts[artifact], 1)
    return start_agent(max_concurrent=4)


def test_models_lists_the_base_and_each_adapter_with_its_parent(agent: AgentServer) -> None:
    models = {m.id: m for m in client(agent).models.list()}
    base = next(m for m in models if "@" in m)
    assert {m for m in models if "@" not in m} == {"summarise", "extract"}
    summarise = models["summarise"].model_dump()
    assert (summarise["parent"], summarise["version"], summarise["loaded"]) == (base, "1", True)


def test_a_request_naming_an_adapter_uses_it_alone_and_in_a_mixed_batch(
    agent: AgentServer, http: Callable
) -> None:
    base_model = next(m.id for m in client(agent).models.list() if "@" in m.id)
    alone = {name: ask(agent, name) for name in (base_model, "summarise", "extract")}
    assert len({text for text, _ in alone.values()}) == 3  # each adapter changes the answer
    assert alone["summarise"][1] == "summarise@1"
    mixed = ["summarise", base_model, "extract", "summarise"]
    with ThreadPoolExecutor(len(mixed)) as pool:
        answers = list(pool.map(lambda name: ask(agent, name), mixed))
    assert answers == [alone[name] for name in mixed]
    samples = parse_samples(http(agent.port, "GET", "/metrics")[2])
    assert samples[("sits_generation_tokens_total", (("adapter", "summarise"),))] > 0
    assert samples[("sits_generation_tokens_total", (("adapter", ""),))] > 0
    assert samples[("sits_adapter_info", (("adapter", "extract"), ("version", "1")))] == 1


def test_an_unknown_model_is_404_model_not_found(agent: AgentServer) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        ask(agent, "no-such-adapter")
    assert caught.value.code == "model_not_found"


def test_admin_reload_swaps_an_adapters_version_and_unloads_it(
    agent: AgentServer, artifacts: dict[str, Path], http: Callable, short_dir: Path
) -> None:
    before = ask(agent, "summarise")[0]
    install(store_root(short_dir / "root0"), artifacts["summarise-2"], 2)
    status, _, body = http(agent.admin_socket, "POST", "/admin/adapters/reload", {"name": "summarise"})
    assert (status, body) == (200, {"name": "summarise", "version": "2", "status": "loaded"})
    text, model = ask(agent, "summarise")
    assert model == "summarise@2" and text != before
    status, _, body = http(agent.admin_socket, "POST", "/admin/adapters/smoke", {"name": "summarise"})
    assert status == 200 and (body["version"], body["ok"]) == ("2", True)
    AdapterStore(store_root(short_dir / "root0")).remove("summarise")
    status, _, body = http(agent.admin_socket, "POST", "/admin/adapters/reload", {"name": "summarise"})
    assert (status, body["status"]) == (200, "unloaded")
    with pytest.raises(openai.NotFoundError):
        ask(agent, "summarise")
    status, _, body = http(agent.admin_socket, "POST", "/admin/adapters/smoke", {"name": "summarise"})
    assert (status, body["error"]["code"]) == (404, "model_not_found")


def test_a_broken_adapter_is_refused_and_the_loaded_version_keeps_serving(
    agent: AgentServer, artifacts: dict[str, Path], http: Callable, short_dir: Path, tmp_path: Path
) -> None:
    before = ask(agent, "summarise")
    broken = tmp_path / "summarise-2"
    shutil.copytree(artifacts["summarise-2"], broken)
    weights = broken / "adapter.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])  # truncated factors
    install(store_root(short_dir / "root0"), broken, 2)
    status, _, body = http(agent.admin_socket, "POST", "/admin/adapters/reload", {"name": "summarise"})
    assert status == 409 and "adapter.safetensors" in body["error"]["message"]
    assert ask(agent, "summarise") == before


def test_start_up_rolls_back_an_adapter_that_fails_to_load(
    start_agent: StartAgent, short_dir: Path, artifacts: dict[str, Path], tmp_path: Path
) -> None:
    root = store_root(short_dir / "root0")
    install(root, artifacts["summarise-1"], 1)
    broken = tmp_path / "summarise-2"
    shutil.copytree(artifacts["summarise-2"], broken)
    weights = broken / "adapter.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])  # truncated factors
    install(root, broken, 2)
    agent = start_agent()
    assert ask(agent, "summarise")[1] == "summarise@1"
    assert AdapterStore(root).state("summarise").version == "1"
    assert AdapterStore(root).state("summarise").counter == 2  # a rollback never lowers it


class NoAdapters(EngineWrapper):
    """The real torch engine, as an engine that serves no adapters."""

    serves_adapters = False

    def __init__(self, engine: Engine) -> None:
        self._engine = engine


def test_an_engine_without_adapters_skips_them_and_keeps_them_installed(
    start_agent: StartAgent, short_dir: Path, artifacts: dict[str, Path], http: Callable
) -> None:
    root = store_root(short_dir / "root0")
    install(root, artifacts["summarise-1"], 1)
    install(root, artifacts["summarise-2"], 2)
    agent = start_agent(factory=lambda: NoAdapters(make_engine("torch", context_length=256, threads=1)))
    assert all(m.model_dump().get("kind") != "lora" for m in client(agent).models.list())
    assert AdapterStore(root).state("summarise").version == "2"  # not rolled back: not its fault
    status, _, body = http(agent.admin_socket, "POST", "/admin/adapters/reload", {"name": "summarise"})
    assert status == 409 and "serves no LoRA adapters" in body["error"]["message"]


@pytest.mark.slow
def test_smollm2_adapter_equals_the_merged_model_alone_and_in_a_mixed_batch(
    start_agent: StartAgent, short_dir: Path, smollm2_dir: Path, tmp_path: Path
) -> None:
    """A real rank-8 q/v PEFT adapter of SmolLM2-135M-Instruct: through the official client, its
    greedy chat answers are those of the checkpoint with the adapter merged in (PEFT's own
    merge_and_unload, fp32, served by a second agent), alone and beside the base in one batch."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_dir = make_peft_adapter(smollm2_dir, tmp_path / "peft", seed=5, rank=8, alpha=16, b_std=0.02)
    write_adapter(from_peft(peft_dir, "summarise", "1", "smollm2"), tmp_path / "artifact")
    install(store_root(short_dir / "root0"), tmp_path / "artifact", 1)
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    merged_dir = tmp_path / "merged"
    PeftModel.from_pretrained(base, peft_dir).merge_and_unload().save_pretrained(merged_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, merged_dir / name)
    settings = {"context_length": 512, "max_prompt_tokens": 256, "max_tokens": 32, "max_concurrent": 4}
    agent = start_agent(load=False, **settings)
    assert agent.reload(smollm2_dir, "v1").ok
    reference = start_agent(load=False, **settings)
    assert reference.reload(merged_dir, "merged").ok
    base_id = next(m.id for m in client(agent).models.list() if "@" in m.id)
    merged_id = next(m.id for m in client(reference).models.list())
    questions = ["What is the capital of France?", "Name three colours.", "Say hello in Spanish."]

    def chat(server: AgentServer, model: str, question: str) -> str:
        answer = client(server).chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0
        )
        return answer.choices[0].message.content or ""

    want = [chat(reference, merged_id, q) for q in questions]
    assert [chat(agent, "summarise", q) for q in questions] == want
    assert [chat(agent, base_id, q) for q in questions] != want  # the adapter changes the answers
    jobs = [(m, q) for q in questions for m in ("summarise", base_id)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        mixed = list(pool.map(lambda job: chat(agent, *job), jobs))
    assert mixed[::2] == want


def test_the_adapter_commands_reload_and_list_through_the_admin_socket(
    agent: AgentServer, artifacts: dict[str, Path], short_dir: Path, tmp_path: Path
) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text(f"admin_socket: {agent.admin_socket}\n")
    device = ["--root", str(short_dir / "root0"), "--config", str(config)]

    def sits_agent(*args: str) -> dict:
        result = CliRunner().invoke(cli, [*args, *device, "--output", "json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    install(store_root(short_dir / "root0"), artifacts["summarise-2"], 2)
    assert sits_agent("adapter", "reload", "summarise") == {
        "name": "summarise",
        "version": "2",
        "status": "loaded",
    }
    listed = {a["name"]: a for a in sits_agent("adapter", "list")["adapters"]}
    assert (listed["summarise"]["loaded_version"], listed["summarise"]["previous_version"]) == ("2", "1")
    assert listed["extract"]["loaded"] is True


def test_langchain_selects_an_adapter_by_model_name(agent: AgentServer) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model="extract",
        base_url=f"http://127.0.0.1:{agent.port}/v1",
        api_key="none",
        temperature=0,
        max_tokens=8,
        max_retries=0,
    )
    assert chat.invoke("Hello").response_metadata["model_name"] == "extract@1"
