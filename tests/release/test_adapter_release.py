"""Adapter artifacts and releases (issue #41): built reproducibly from real PEFT adapters, signed
like model releases, and refused on the device — replayed, downgraded, for another base, tampered —
with nothing installed or loaded; a failed smoke test rolls the adapter back."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest

from deployer.agent.ota.adapter_install import AdapterControl, AdapterInstaller, ControlAnswer
from deployer.agent.ota.adapters import AdapterStore
from deployer.build.adapter import AdapterBuild, AdapterBuildRequest, build_adapter
from deployer.core.adapter_release import make_adapter_release
from deployer.core.hashing import sha256_file
from deployer.core.release import Envelope, PatchRef
from deployer.errors import (
    AgentError,
    BaseMismatchError,
    BuildError,
    ExpiredError,
    FormatError,
    HashMismatchError,
    ReplayError,
    SignatureError,
)
from deployer.release.delta import create_patch
from deployer.release.sign import add_signature, envelope_for
from tests.agent.lora_helpers import make_peft_adapter
from tests.build.conftest import small_gate
from tests.release.helpers import NOW, Fleet, artifact_id, tree


@dataclass(frozen=True)
class Adapters:
    """Two versions of one adapter for fleet.v1, one for fleet.v2, and their PEFT sources."""

    v1: AdapterBuild
    v2: AdapterBuild
    other_base: AdapterBuild
    peft: Path


def _request(fleet: Fleet, tiny: Path, peft: Path, store: Path, version: str, base: Path | None = None):
    base = base or fleet.v1
    return AdapterBuildRequest(
        name="summarise",
        version=version,
        peft_dir=peft,
        scale=1.0,
        base_artifact_dir=base,
        base_artifact_id=artifact_id(base),
        base_source_dir=tiny,
        store_dir=store,
    )


@pytest.fixture(scope="module")
def adapters(fleet: Fleet, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    root = tmp_path_factory.mktemp("adapters")
    peft1 = make_peft_adapter(tiny_model_dir, root / "peft1", seed=1)
    peft2 = make_peft_adapter(tiny_model_dir, root / "peft2", seed=2)
    store = root / "store"
    return Adapters(
        v1=build_adapter(_request(fleet, tiny_model_dir, peft1, store, "1.0.0")),
        v2=build_adapter(_request(fleet, tiny_model_dir, peft2, store, "1.1.0")),
        other_base=build_adapter(_request(fleet, tiny_model_dir, peft1, store, "1.0.0", base=fleet.v2)),
        peft=peft1,
    )


def test_the_build_is_reproducible_and_bound_to_its_base(fleet, tiny_model_dir, adapters, tmp_path):
    again = build_adapter(_request(fleet, tiny_model_dir, adapters.peft, tmp_path / "store", "1.0.0"))
    assert again.artifact_id == adapters.v1.artifact_id
    assert tree(again.artifact_dir) == tree(adapters.v1.artifact_dir)
    assert adapters.other_base.artifact_id != adapters.v1.artifact_id  # same factors, other base
    meta = json.loads((adapters.v1.artifact_dir / "adapter.json").read_text())
    assert meta["base_artifact_id"] == artifact_id(fleet.v1)
    assert sorted(p.name for p in adapters.v1.artifact_dir.iterdir()) == [
        "adapter.json",
        "adapter.safetensors",
        "sits-adapter.json",
    ]


def test_the_quality_gate_scores_base_plus_adapter_against_the_merged_model(
    fleet, tiny_model_dir, adapters, tmp_path
):
    request = _request(fleet, tiny_model_dir, adapters.peft, tmp_path / "store", "1.0.0")
    gated = build_adapter(AdapterBuildRequest(**{**request.__dict__, "gate": small_gate()}))
    assert gated.quality is not None and gated.quality.passed
    # int8 base + fp16 factors stay close to the fp32 merged model; the figures go into the manifest.
    assert gated.quality.top1_agreement > 0.9
    manifest = json.loads((gated.artifact_dir / "sits-adapter.json").read_text())
    assert manifest["quality"]["top1_agreement"] == gated.quality.top1_agreement


def test_a_pinned_base_hash_that_differs_is_refused(fleet, tiny_model_dir, adapters, tmp_path):
    request = _request(fleet, tiny_model_dir, adapters.peft, tmp_path / "store", "1.0.0")
    with pytest.raises(BuildError, match=r"base_sha256 0{16}\.\.\. pins another base"):
        build_adapter(AdapterBuildRequest(**{**request.__dict__, "base_sha256": "0" * 64}))


# --- the device ---


@dataclass
class Agent:
    """The running agent's adapter control: which versions it was asked to load, smoke results."""

    store: AdapterStore
    smoke_ok: bool = True
    loaded: list[str] = field(default_factory=list)

    def control(self) -> AdapterControl:
        def reload(name: str) -> ControlAnswer:
            record = self.store.record(name)
            self.loaded.append(f"{name} {record.version if record else 'unloaded'}")
            return ControlAnswer(True, True)

        return AdapterControl(reload, lambda name: ControlAnswer(self.smoke_ok, True, "said nothing"))


def _release(
    fleet: Fleet,
    build: AdapterBuild,
    counter: int,
    *,
    patch_from: AdapterBuild | None = None,
    patch: Path | None = None,
    expires_in: timedelta = timedelta(days=30),
    signer: int = 0,
) -> Envelope:
    ref = None
    if patch_from is not None and patch is not None:
        ref = PatchRef(
            base_version=patch_from.version,
            base_sha256=patch_from.artifact_id,
            sha256=sha256_file(patch),
            size=patch.stat().st_size,
        )
    body = make_adapter_release(
        build.artifact_dir, counter=counter, expires_in=expires_in, now=NOW, patch=ref
    )
    return add_signature(envelope_for(body), fleet.keys[signer])


def _states(store: AdapterStore) -> dict[str, str]:
    """Every state.json and artifact dir under the store: what an install would change."""
    if not store.dir.is_dir():
        return {}
    return {
        str(p.relative_to(store.dir)): p.read_text() if p.is_file() else "" for p in store.dir.glob("*/*")
    }


def _write(envelope: Envelope, path: Path) -> Path:
    path.write_bytes(envelope.to_bytes())
    return path


@pytest.fixture
def device(fleet: Fleet, tmp_path: Path) -> tuple[AdapterInstaller, AdapterStore, Agent]:
    store = AdapterStore(tmp_path / "device")
    agent = Agent(store)
    installer = AdapterInstaller(
        store,
        agent.control(),
        trusted=lambda: fleet.trusted(),
        base_artifact_id=lambda: artifact_id(fleet.v1),
        now=lambda: NOW + timedelta(hours=1),
    )
    return installer, store, agent


def test_install_then_patch_then_rollback(fleet, adapters, device, tmp_path):
    installer, store, agent = device
    first = installer.install(
        _write(_release(fleet, adapters.v1, 1), tmp_path / "r1.json"), artifact=adapters.v1.artifact_dir
    )
    assert (first.version, first.counter) == ("1.0.0", 1)
    patch = tmp_path / "a1-a2.patch"
    create_patch(adapters.v1.artifact_dir, adapters.v2.artifact_dir, patch)
    assert patch.stat().st_size < adapters.v2.artifact_bytes
    envelope = _release(fleet, adapters.v2, 2, patch_from=adapters.v1, patch=patch)
    second = installer.install(_write(envelope, tmp_path / "r2.json"), patch=patch)
    assert (second.version, second.from_version, second.artifact_id) == (
        "1.1.0",
        "1.0.0",
        adapters.v2.artifact_id,
    )
    assert tree(store.record("summarise").path) == tree(adapters.v2.artifact_dir)
    back = installer.rollback("summarise")
    assert (back.version, back.counter) == ("1.0.0", 2)  # the floor stays: 1.1.0's release is spent
    assert agent.loaded == ["summarise 1.0.0", "summarise 1.1.0", "summarise 1.0.0"]


@pytest.mark.parametrize(
    ("case", "error", "message"),
    [
        ("replayed", ReplayError, "release counter 1 is not above the installed 1: a replayed"),
        ("downgraded", ReplayError, "release counter 1 is not above the installed 2"),
        ("wrong-base", BaseMismatchError, "was made for base artifact"),
        ("expired", ExpiredError, "expired at"),
        ("untrusted", SignatureError, "signed only by unknown key id"),
        ("tampered-manifest", SignatureError, "does not verify"),
        ("tampered-file", HashMismatchError, "(tampered or corrupt)"),
        ("model-release", FormatError, "not an adapter release (kind 'sits-release')"),
    ],
)
def test_bad_adapter_releases_are_refused_and_nothing_loads(
    fleet, adapters, device, tmp_path, case, error, message
):
    installer, store, agent = device
    payload = adapters.v1.artifact_dir
    if case in ("replayed", "downgraded"):
        installer.install(_write(_release(fleet, adapters.v1, 1), tmp_path / "r1.json"), artifact=payload)
        if case == "downgraded":
            installer.install(
                _write(_release(fleet, adapters.v2, 2), tmp_path / "r2.json"),
                artifact=adapters.v2.artifact_dir,
            )
        envelope = _release(fleet, adapters.v1, 1)
    elif case == "wrong-base":
        envelope, payload = _release(fleet, adapters.other_base, 1), adapters.other_base.artifact_dir
    elif case == "expired":
        envelope = _release(fleet, adapters.v1, 1, expires_in=timedelta(minutes=5))
    elif case == "untrusted":
        envelope = _release(fleet, adapters.v1, 1, signer=2)
    elif case == "tampered-manifest":
        envelope = _release(fleet, adapters.v1, 1)
        envelope = Envelope(signed={**envelope.signed, "counter": 99}, signatures=envelope.signatures)
    elif case == "tampered-file":
        envelope = _release(fleet, adapters.v1, 1)
        payload = Path(shutil.copytree(adapters.v1.artifact_dir, tmp_path / "tampered"))
        data = bytearray((payload / "adapter.safetensors").read_bytes())
        data[-1] ^= 0x01
        (payload / "adapter.safetensors").write_bytes(bytes(data))
    else:
        envelope = fleet.release(counter=5, patch=False)
    states, loads = _states(store), list(agent.loaded)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        installer.install(_write(envelope, tmp_path / "bad.json"), artifact=payload)
    assert (_states(store), agent.loaded) == (states, loads)
    assert not list(store.dir.glob(".staging*"))


def test_a_failed_smoke_test_rolls_the_adapter_back(fleet, adapters, device, tmp_path):
    installer, store, agent = device
    installer.install(
        _write(_release(fleet, adapters.v1, 1), tmp_path / "r1.json"), artifact=adapters.v1.artifact_dir
    )
    agent.smoke_ok = False
    with pytest.raises(
        AgentError, match=r"summarise 1\.1\.0: smoke prompts failed: said nothing; rolled back to 1\.0\.0"
    ):
        installer.install(
            _write(_release(fleet, adapters.v2, 2), tmp_path / "r2.json"), artifact=adapters.v2.artifact_dir
        )
    assert store.record("summarise").version == "1.0.0"
    assert agent.loaded == ["summarise 1.0.0", "summarise 1.1.0", "summarise 1.0.0"]


def test_sits_agent_adapter_install_and_rollback_on_a_device(fleet, adapters, tmp_path):
    """The device's command line: the base installed with `sits-agent install`, then the adapter
    verified against it and installed, a replay refused, and a rollback to none; no agent is
    listening, so each loads at the agent's next start."""
    from click.testing import CliRunner
    from cryptography.hazmat.primitives import serialization

    from deployer.agent.cli import cli
    from deployer.agent.ota.store import DeviceStore
    from deployer.core.release import make_release

    device = DeviceStore(tmp_path / "device")
    device.ensure_layout()
    (device.keys_dir / "release.pub").write_bytes(
        fleet.keys[0]
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )

    def run(*args: str) -> tuple[int, str, str]:
        result = CliRunner().invoke(cli, [*args, "--root", str(device.root), "--output", "json"])
        return result.exit_code, result.stdout, result.stderr

    def signed(body, name: str) -> str:
        return str(_write(add_signature(envelope_for(body), fleet.keys[0]), tmp_path / name))

    base = signed(make_release(fleet.v1, counter=1, expires_in=timedelta(days=1)), "base.json")
    assert run("install", "--manifest", base, "--artifact", str(fleet.v1))[0] == 0
    adapter = signed(
        make_adapter_release(adapters.v1.artifact_dir, counter=3, expires_in=timedelta(days=1)), "a.json"
    )
    code, out, err = run(
        "adapter", "install", "--manifest", adapter, "--artifact", str(adapters.v1.artifact_dir)
    )
    assert code == 0, err
    assert json.loads(out) == {
        "name": "summarise",
        "version": "1.0.0",
        "artifact_id": adapters.v1.artifact_id,
        "from_version": None,
        "counter": 3,
        "detail": "",
    }
    code, _, err = run(
        "adapter", "install", "--manifest", adapter, "--artifact", str(adapters.v1.artifact_dir)
    )
    assert code == 1 and "replayed" in err and "Traceback" not in err
    code, out, err = run("adapter", "rollback", "summarise")
    assert code == 0, err
    assert (json.loads(out)["version"], json.loads(out)["counter"]) == (None, 3)
    assert AdapterStore(device.base).installed() == {}


def test_a_first_version_that_fails_its_smoke_test_is_removed_and_its_release_spent(
    fleet, adapters, device, tmp_path
):
    installer, store, agent = device
    agent.smoke_ok = False
    manifest = _write(_release(fleet, adapters.v1, 1), tmp_path / "r1.json")
    with pytest.raises(AgentError, match=r"rolled back to none \(unloaded\)"):
        installer.install(manifest, artifact=adapters.v1.artifact_dir)
    assert (store.installed(), store.state("summarise").counter) == ({}, 1)
    assert agent.loaded == ["summarise 1.0.0", "summarise unloaded"]
    with pytest.raises(ReplayError):
        installer.install(manifest, artifact=adapters.v1.artifact_dir)


def test_build_release_and_install_an_adapter_from_the_command_lines(tiny_model_dir, adapters, tmp_path):
    """deploy.yaml's adapter built with the base by `sits-deployer build`, released by
    `sits-deployer release` (an adapter release: the artifact holds sits-adapter.json), installed
    by `sits-agent adapter install` on a device that runs that base."""
    from click.testing import CliRunner

    from deployer.agent.cli import cli as agent
    from deployer.cli.main import cli as controller
    from deployer.core.release import make_release
    from deployer.release.sign import load_private_key

    config = tmp_path / "deploy.yaml"
    config.write_text(
        "application: demo\nmodel:\n  name: tiny\n  version: 1.0.0\n"
        f"  source: {tiny_model_dir}\n  adapters:\n"
        f"    - {{name: summarise, version: 1.0.0, source: {adapters.peft}}}\n"
        "fleet:\n  devices:\n    - {name: d1, transport: local, root: ./d1}\n"
    )
    runner = CliRunner()

    def ok(cli, *args: str) -> dict:
        result = runner.invoke(cli, [*args, "--output", "json"])
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout)

    built = ok(controller, "build", "-f", str(config))
    [adapter] = built["adapters"]
    assert (adapter["name"], adapter["version"]) == ("summarise", "1.0.0")
    assert adapter["bytes"] < 0.2 * sum(f.stat().st_size for f in Path(built["artifact_dir"]).iterdir())
    keys = ok(controller, "keygen", "-o", str(tmp_path / "release"), "--unencrypted")
    key, manifest = keys["private"], str(tmp_path / "a.json")
    release = ok(
        controller, "release", adapter["artifact_dir"], "--counter", "1", "--key", key, "-o", manifest
    )
    assert (release["adapter"], release["artifact"]) == ("summarise", adapter["artifact_id"])

    device = tmp_path / "device"
    (device / "etc" / "sits" / "keys").mkdir(parents=True)
    shutil.copyfile(keys["public"], device / "etc" / "sits" / "keys" / "release.pub")
    base = make_release(Path(built["artifact_dir"]), counter=1, expires_in=timedelta(days=1))
    signed = add_signature(envelope_for(base), load_private_key(Path(key), None))
    base_manifest = _write(signed, tmp_path / "base.json")
    root = ["--root", str(device)]
    ok(agent, "install", *root, "--manifest", str(base_manifest), "--artifact", built["artifact_dir"])
    installed = ok(
        agent, "adapter", "install", *root, "--manifest", manifest, "--artifact", adapter["artifact_dir"]
    )
    assert (installed["version"], installed["artifact_id"]) == ("1.0.0", adapter["artifact_id"])
