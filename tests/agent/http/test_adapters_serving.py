"""LoRA adapters served by the agent (issue #41): loaded from the device's adapter store at start-up
and by the admin socket, listed by /v1/models, selected per request by the official `openai`
client's `model`, batched with the base and each other, counted per adapter in /metrics. The
adapters are real PEFT adapters of the tiny model."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from deployer.agent.http.server import AgentServer
from deployer.agent.ota.adapters import AdapterStore
from deployer.core.fsutil import read_json_object
from deployer.core.lora import from_peft, write_adapter
from tests.agent.conftest import StartAgent, parse_samples
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
