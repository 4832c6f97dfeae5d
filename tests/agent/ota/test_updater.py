"""The updater on real artifacts, patches and signatures: installs, refusals, rollbacks."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime, timedelta

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from deployer.agent.ota.updater import ReloadOutcome, Updater
from deployer.core.hashing import sha256_file
from deployer.errors import (
    AgentError,
    BaseMismatchError,
    ExpiredError,
    HashMismatchError,
    IntegrityError,
    KeyFileError,
    ReplayError,
    SignatureError,
    UnsafePathError,
)


class RecordingReloader:
    """Stands in for the server's control channel: records calls, answers as told."""

    def __init__(self, ok: bool = True) -> None:
        self.ok = ok
        self.calls: list[tuple[str, str]] = []

    def __call__(self, version: str, reason: str) -> ReloadOutcome:
        self.calls.append((version, reason))
        return ReloadOutcome(self.ok, True, "" if self.ok else "smoke test failed")


def _same_files(store, version, artifact_dir) -> bool:
    on_disk = store.version_dir(version)
    names = sorted(p.name for p in artifact_dir.iterdir())
    return names == sorted(p.name for p in on_disk.iterdir()) and all(
        sha256_file(on_disk / n) == sha256_file(artifact_dir / n) for n in names
    )


def _trust(device, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    (device.keys_dir / "second.pub").write_bytes(pem)


def _install_first(device, kit, reloader=None):
    updater = Updater(device, reloader=reloader)
    updater.install(kit.release("1.0.0", 1), artifact=kit.artifacts["1.0.0"])
    return updater


def test_full_install_then_patch_install(device, kit):
    reloader = RecordingReloader()
    updater = Updater(device, reloader=reloader)

    first = updater.install(kit.release("1.0.0", 1), artifact=kit.artifacts["1.0.0"])
    second = updater.install(kit.release("1.1.0", 2, base="1.0.0"), patch=kit.patches[("1.0.0", "1.1.0")])

    assert (first.changed, first.from_version, second.from_version) == (True, None, "1.0.0")
    assert (device.current_version(), device.previous_version()) == ("1.1.0", "1.0.0")
    assert _same_files(device, "1.1.0", kit.artifacts["1.1.0"])
    state = device.read_state()
    assert (state.installed_version, state.release_counter) == ("1.1.0", 2)
    assert state.artifact_sha256 == sha256_file(kit.artifacts["1.1.0"] / "sits-manifest.json")
    assert [(h.action, h.result, h.version) for h in state.history] == [
        ("install", "ok", "1.0.0"),
        ("install", "ok", "1.1.0"),
    ]
    assert reloader.calls == [("1.0.0", "update"), ("1.1.0", "update")]
    assert list(device.staging_dir.iterdir()) == []


def test_the_same_release_again_is_a_replay(device, kit):
    manifest = kit.release("1.0.0", 1)
    updater = Updater(device)
    updater.install(manifest, artifact=kit.artifacts["1.0.0"])
    with pytest.raises(ReplayError, match="not above the installed 1"):
        updater.install(manifest, artifact=kit.artifacts["1.0.0"])
    assert device.current_version() == "1.0.0"


def test_an_older_release_is_a_replay(device, kit):
    updater = Updater(device)
    updater.install(kit.release("1.1.0", 5), artifact=kit.artifacts["1.1.0"])
    with pytest.raises(ReplayError, match="not above the installed 5"):
        updater.install(kit.release("1.0.0", 4), artifact=kit.artifacts["1.0.0"])
    assert device.current_version() == "1.1.0"
    assert device.installed_versions() == ["1.1.0"]
    last = device.read_state().history[-1]  # a refusal leaves state.json as it was
    assert (last.action, last.result, last.version) == ("install", "ok", "1.1.0")


@pytest.mark.parametrize(
    ("setup", "error", "message"),
    [
        ("expired", ExpiredError, "expired"),
        ("unsigned", SignatureError, "not signed"),
        ("wrong-key", SignatureError, "unknown key"),
        ("threshold", SignatureError, "2 required"),
        ("no-keys", KeyFileError, "no trusted release keys"),
    ],
)
def test_untrusted_releases_are_refused(device, kit, setup, error, message):
    other = ec.generate_private_key(ec.SECP256R1())
    keys = {"unsigned": (), "wrong-key": (other,)}.get(setup)
    manifest = kit.release("1.0.0", 1, keys=keys)
    clock = (lambda: datetime.now(UTC) + timedelta(days=31)) if setup == "expired" else None
    if setup == "no-keys":
        shutil.rmtree(device.keys_dir)
    if setup == "threshold":
        _trust(device, other)
    if setup == "threshold":
        (device.keys_dir / "threshold").write_text("2\n")
    updater = Updater(device, clock=clock)
    with pytest.raises(error, match=message):
        updater.install(manifest, artifact=kit.artifacts["1.0.0"])
    assert device.current_version() is None
    assert device.installed_versions() == []


def test_k_of_n_signatures_install(device, kit):
    other = ec.generate_private_key(ec.SECP256R1())
    _trust(device, other)
    manifest = kit.release("1.0.0", 1, keys=(kit.key, other))
    (device.keys_dir / "threshold").write_text("2\n")
    Updater(device).install(manifest, artifact=kit.artifacts["1.0.0"])
    assert device.current_version() == "1.0.0"


def test_a_flipped_bit_in_the_patch_is_refused(device, kit, tmp_path):
    updater = _install_first(device, kit)
    patch = tmp_path / "bad.patch"
    data = bytearray(kit.patches[("1.0.0", "1.1.0")].read_bytes())
    data[len(data) // 2] ^= 0x01
    patch.write_bytes(bytes(data))
    with pytest.raises(HashMismatchError):
        updater.install(kit.release("1.1.0", 2, base="1.0.0"), patch=patch)
    assert device.current_version() == "1.0.0"
    assert device.installed_versions() == ["1.0.0"]


def test_a_patch_for_another_base_is_refused(device, kit):
    updater = _install_first(device, kit)
    with pytest.raises(BaseMismatchError, match=r"patch is for base 1\.1\.0"):
        updater.install(kit.release("1.2.0", 2, base="1.1.0"), patch=kit.patches[("1.1.0", "1.2.0")])
    assert device.current_version() == "1.0.0"


def test_an_artifact_with_a_foreign_file_is_refused(device, kit, tmp_path):
    mixed = tmp_path / "mixed"
    shutil.copytree(kit.artifacts["1.1.0"], mixed)
    (mixed / "tokenizer.json").unlink()
    shutil.copyfile(kit.artifacts["1.0.0"] / "model.safetensors", mixed / "model.safetensors")
    with pytest.raises(HashMismatchError, match="missing"):
        Updater(device).install(kit.release("1.1.0", 1), artifact=mixed)
    assert device.installed_versions() == []
    assert list(device.staging_dir.iterdir()) == []


def test_a_symlink_in_the_artifact_is_refused(device, kit, tmp_path):
    linked = tmp_path / "linked"
    shutil.copytree(kit.artifacts["1.0.0"], linked)
    (linked / "config.json").unlink()
    (linked / "config.json").symlink_to(kit.artifacts["1.0.0"] / "config.json")
    with pytest.raises(UnsafePathError, match="symlink"):
        Updater(device).install(kit.release("1.0.0", 1), artifact=linked)
    assert device.installed_versions() == []


def test_install_needs_exactly_one_source(device, kit):
    with pytest.raises(AgentError, match="exactly one"):
        Updater(device).install(kit.release("1.0.0", 1))


def test_a_version_the_server_refuses_is_pointed_back(device, kit):
    reloader = RecordingReloader()
    updater = _install_first(device, kit, reloader)
    reloader.ok = False
    refused = r"refused version 1\.1\.0: smoke test failed; still serving 1\.0\.0"
    with pytest.raises(AgentError, match=refused):
        updater.install(kit.release("1.1.0", 2, base="1.0.0"), patch=kit.patches[("1.0.0", "1.1.0")])
    assert (device.current_version(), device.previous_version()) == ("1.0.0", None)
    state = device.read_state()
    assert state.installed_version == "1.0.0"
    assert state.history[-1].reason.startswith("the server refused 1.1.0")
    # Not left promoted, so no rollback can pick it; the counter floor stays (security-model.md).
    assert device.installed_versions() == ["1.0.0"]
    assert ("1.1.0" not in state.versions, state.in_progress, state.release_counter) == (True, None, 2)


def test_rollback_and_forward_again(device, kit):
    reloader = RecordingReloader()
    updater = _install_first(device, kit, reloader)
    forward = kit.release("1.1.0", 2, base="1.0.0")
    updater.install(forward, patch=kit.patches[("1.0.0", "1.1.0")])

    back = updater.rollback()

    assert (back.version, back.from_version, back.changed) == ("1.0.0", "1.1.0", True)
    assert (device.current_version(), device.previous_version()) == ("1.0.0", "1.1.0")
    assert reloader.calls[-1] == ("1.0.0", "rollback")
    assert device.read_state().release_counter == 2  # the floor stays where it was
    with pytest.raises(ReplayError):  # a new release must still beat counter 2
        updater.install(kit.release("1.2.0", 2), artifact=kit.artifacts["1.2.0"])
    # Not even the release accepted for 1.1.0 brings it back: only the operator's rollback does.
    with pytest.raises(ReplayError):
        updater.install(forward, patch=kit.patches[("1.0.0", "1.1.0")])
    assert device.current_version() == "1.0.0"
    assert updater.rollback(to="1.1.0").changed
    assert updater.rollback(to="1.1.0").changed is False


def test_rollback_refuses_unknown_and_tampered_versions(device, kit):
    updater = _install_first(device, kit)
    updater.install(kit.release("1.1.0", 2, base="1.0.0"), patch=kit.patches[("1.0.0", "1.1.0")])
    with pytest.raises(AgentError, match="no verified release recorded"):
        updater.rollback(to="0.9.0")
    weights = device.version_dir("1.0.0") / "model.safetensors"
    weights.chmod(0o644)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        updater.rollback()
    assert device.current_version() == "1.1.0"
    assert device.read_state().history[-1].action == "rollback"


def test_rollback_without_previous_is_a_clear_error(device, kit):
    updater = _install_first(device, kit)
    with pytest.raises(AgentError, match="no previous version"):
        updater.rollback()


def test_self_rollback_never_swings_back_to_a_failed_version(device, kit):
    updater = _install_first(device, kit)
    updater.install(kit.release("1.1.0", 2, base="1.0.0"), patch=kit.patches[("1.0.0", "1.1.0")])

    result = updater.self_rollback()

    assert (result.version, result.from_version) == ("1.0.0", "1.1.0")
    state = device.read_state()
    assert state.versions["1.1.0"].failed
    assert state.history[-1].action == "self-rollback"
    with pytest.raises(AgentError, match="no healthy previous version"):
        updater.self_rollback()
    assert device.current_version() == "1.0.0"
    with pytest.raises(AgentError, match="failed on this device and is never rolled back to"):
        updater.rollback(to="1.1.0")  # not even by an operator's explicit choice
    assert device.current_version() == "1.0.0"


def test_gc_through_the_updater_keeps_the_pointers(device, kit):
    updater = _install_first(device, kit)
    updater.install(kit.release("1.1.0", 2, base="1.0.0"), patch=kit.patches[("1.0.0", "1.1.0")])
    updater.install(kit.release("1.2.0", 3, base="1.1.0"), patch=kit.patches[("1.1.0", "1.2.0")])
    assert updater.collect_garbage(keep=1) == ["1.0.0"]
    assert device.installed_versions() == ["1.1.0", "1.2.0"]
    assert sorted(device.read_state().versions) == ["1.1.0", "1.2.0"]


def test_a_retry_after_an_interruption_still_reloads_the_server(device, kit):
    def interrupt(step: str) -> None:
        if step == "current-set":
            raise KeyboardInterrupt  # stands in for the process dying right after the switch

    _install_first(device, kit)
    manifest = kit.release("1.1.0", 2, base="1.0.0")
    patch = kit.patches[("1.0.0", "1.1.0")]
    with pytest.raises(KeyboardInterrupt):
        Updater(device, on_step=interrupt).install(manifest, patch=patch)
    assert device.current_version() == "1.1.0"

    reloader = RecordingReloader()
    again = Updater(device, reloader=reloader).install(manifest, patch=patch)

    assert again.changed is False
    assert reloader.calls == [("1.1.0", "update")]
    state = device.read_state()
    assert (state.installed_version, state.pending) == ("1.1.0", None)
