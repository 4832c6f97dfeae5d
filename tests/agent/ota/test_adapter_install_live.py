"""`AdapterInstaller` against a running agent (issue #41): a signed adapter release verified, put in
the device's adapter store, hot-loaded through the admin socket (POST /admin/adapters/reload) and
smoke-tested there (/admin/adapters/smoke) while the base keeps serving; a rollback reloads the
previous version. The adapters are real PEFT adapters of the tiny model."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import openai
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from deployer.agent.cli import http_adapter_control
from deployer.agent.ota.adapter_install import AdapterInstaller
from deployer.agent.ota.adapters import AdapterStore
from deployer.agent.ota.store import DeviceStore
from deployer.agent.settings import AgentSettings
from deployer.build.adapter import AdapterBuild, AdapterBuildRequest, build_adapter
from deployer.core.adapter_release import make_adapter_release
from deployer.core.verify import TrustedKeys, key_id
from deployer.release.sign import add_signature, envelope_for
from tests.agent.engines.llamacpp.conftest import needs_llama_cpp
from tests.agent.engines.torch.steps import PROMPTS
from tests.agent.lora_helpers import make_peft_adapter
from tests.release.helpers import artifact_id, build

KEY = ec.generate_private_key(ec.SECP256R1())


@pytest.fixture(scope="module")
def builds(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, AdapterBuild]:
    """`summarise` 1.0.0 and 1.1.0 (other seeds: other answers) for an int8 artifact of the tiny model."""
    root = tmp_path_factory.mktemp("live")
    base = build(tiny_model_dir, root / "store", "1.0.0")
    out = {}
    for version, seed in (("1.0.0", 1), ("1.1.0", 3)):
        peft = make_peft_adapter(tiny_model_dir, root / f"peft-{seed}", seed=seed, b_std=0.3)
        request = AdapterBuildRequest(
            name="summarise",
            version=version,
            peft_dir=peft,
            scale=1.0,
            base_artifact_dir=base,
            base_artifact_id=artifact_id(base),
            base_source_dir=tiny_model_dir,
            store_dir=root / "store",
        )
        out[version] = build_adapter(request)
    return out


def _installer(settings: AgentSettings, base_id: str) -> AdapterInstaller:
    """An installer for the agent with `settings`, trusting KEY, for adapters of base `base_id`."""
    return AdapterInstaller(
        AdapterStore(DeviceStore(settings.root).base),
        http_adapter_control(settings),
        trusted=lambda: TrustedKeys({key_id(KEY.public_key()): KEY.public_key()}, 1),
        base_artifact_id=lambda: base_id,
    )


def _asker(port: int) -> tuple[openai.OpenAI, Callable[[str], tuple[str, str]]]:
    """The official openai client of the agent on `port`, and ask(model) -> (greedy text, the
    model that answered) through it."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)

    def ask(model: str) -> tuple[str, str]:
        answer = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0)
        return answer.choices[0].text, answer.model

    return client, ask


def _manifest(build: AdapterBuild, counter: int, path: Path) -> Path:
    body = make_adapter_release(build.artifact_dir, counter=counter, expires_in=timedelta(days=1))
    path.write_bytes(add_signature(envelope_for(body), KEY).to_bytes())
    return path


def test_install_hot_loads_and_smokes_each_version_and_rollback_restores_the_last(
    start_agent, builds, tmp_path
) -> None:
    agent = start_agent()
    settings = agent.settings
    installer = _installer(settings, builds["1.0.0"].base_artifact_id)
    client, ask = _asker(agent.port)
    base_model = next(m.id for m in client.models.list())
    base_answer = ask(base_model)
    first = installer.install(
        _manifest(builds["1.0.0"], 1, tmp_path / "r1.json"), artifact=builds["1.0.0"].artifact_dir
    )
    assert (first.version, first.from_version) == ("1.0.0", None)
    v1 = ask("summarise")
    assert v1[1] == "summarise@1.0.0"
    second = installer.install(
        _manifest(builds["1.1.0"], 2, tmp_path / "r2.json"), artifact=builds["1.1.0"].artifact_dir
    )
    assert (second.version, second.from_version) == ("1.1.0", "1.0.0")
    v2 = ask("summarise")
    assert v2[1] == "summarise@1.1.0" and v2[0] != v1[0]
    back = installer.rollback("summarise")
    assert (back.version, back.counter) == ("1.0.0", 2)
    assert ask("summarise") == v1
    assert ask(base_model) == base_answer  # the base served throughout, untouched
    smoke = installer.control.smoke("summarise")  # what install asked after each reload
    assert (smoke.ok, smoke.served) == (True, True) and smoke.detail.startswith("smoke prompts answered")


@needs_llama_cpp
def test_an_install_to_a_llama_cpp_agent_hot_loads_and_another_bases_adapter_is_refused(
    start_agent, tiny_model_dir, tmp_path
) -> None:
    """The same install against the llama.cpp engine: its LoRA GGUF loaded on the served GGUF while
    the base serves. An adapter of another base (a wider tiny model) is refused by the release's
    base check, and, put in the store past it, by the engine's own: 409, the device serving on."""
    from deployer.agent.engines import make_engine
    from deployer.build.demo_model import make_tiny_checkpoint
    from deployer.errors import BaseMismatchError
    from tests.agent.engines.llamacpp.conftest import build_gguf, build_gguf_adapter

    agent = start_agent(
        load=False,
        engine="llama.cpp",
        factory=lambda: make_engine("llama.cpp", context_length=256, threads=1),
    )
    tiny_gguf_dir = build_gguf(tiny_model_dir, tmp_path / "store")
    assert agent.reload(tiny_gguf_dir, "v1").ok
    base_id = artifact_id(tiny_gguf_dir)
    summarise = build_gguf_adapter(
        tiny_model_dir, tiny_gguf_dir, tmp_path / "store", name="summarise", seed=5
    )
    wide = make_tiny_checkpoint(tmp_path / "wide", hidden_size=96)
    wide_base = build_gguf(wide, tmp_path / "wide-store", scheme="fp32")
    other = build_gguf_adapter(wide, wide_base, tmp_path / "wide-store", name="extract", seed=5)
    installer = _installer(agent.settings, base_id)
    store = installer.adapters
    client, ask = _asker(agent.port)
    base_model = next(m.id for m in client.models.list())
    base_answer = ask(base_model)
    body = make_adapter_release(summarise, counter=1, expires_in=timedelta(days=1))
    (tmp_path / "r1.json").write_bytes(add_signature(envelope_for(body), KEY).to_bytes())
    installed = installer.install(tmp_path / "r1.json", artifact=summarise)
    assert installed.version == "1.0.0"
    listed = {m.id: m.model_dump() for m in client.models.list()}
    assert (listed["summarise"]["parent"], listed["summarise"]["loaded"]) == (base_model, True)
    with_adapter = ask("summarise")
    assert with_adapter[1] == "summarise@1.0.0" and with_adapter[0] != base_answer[0]

    body = make_adapter_release(other, counter=1, expires_in=timedelta(days=1))
    (tmp_path / "r2.json").write_bytes(add_signature(envelope_for(body), KEY).to_bytes())
    with pytest.raises(BaseMismatchError):
        installer.install(tmp_path / "r2.json", artifact=other)
    store.install("extract", other, other.name, "1.0.0", 1)  # past the release's check
    reload = installer.control.reload("extract")
    assert not reload.ok and "does not fit the model served" in reload.detail
    assert "extract" not in {m.id for m in client.models.list()}
    assert ask(base_model) == base_answer and ask("summarise") == with_adapter
