"""Attacks on a device's install, in the spirit of tuf-conformance and Uptane's attack list.

Each is refused, and a refusal changes nothing on disk (the store is byte-identical):
rollback and replay (full and patch), freeze (expired), mix-and-match (files of two releases),
a partial bundle, a wrong key, an artifact id that is not its manifest's hash, endless data (a
patch declaring more than was signed, a bsdiff control block that never ends), NaN in a manifest.
"""

from __future__ import annotations

import bz2
import hashlib
import json
import logging
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import zstandard
from cryptography.hazmat.primitives.asymmetric import ec

from deployer.agent.ota.updater import Updater
from deployer.config.models import Config
from deployer.core.patch_format import Codec
from deployer.core.release import PatchRef, make_release
from deployer.errors import (
    ExpiredError,
    FormatError,
    HashMismatchError,
    KeyFileError,
    ReplayError,
    SignatureError,
)
from deployer.push.fleet import _check_signed_enough
from deployer.release.delta import create_patch
from deployer.release.sign import add_signature, envelope_for
from tests.attacks.conftest import snapshot
from tests.release.helpers import forge_patch, split_patch


def _on(device, kit, *versions: str) -> Updater:
    """A device that installed 1.0.0 (counter 1) and then each of `versions` as patches."""
    updater = Updater(device)
    updater.install(kit.release("1.0.0", 1), artifact=kit.artifacts["1.0.0"])
    previous = "1.0.0"
    for counter, version in enumerate(versions, start=2):
        updater.install(kit.release(version, counter, base=previous), patch=kit.patches[(previous, version)])
        previous = version
    return updater


def _refused(device, error: type[Exception], match: str, install) -> None:
    before = snapshot(device.root)
    with pytest.raises(error, match=match):
        install()
    assert snapshot(device.root) == before  # state.json included: not even rewritten


def test_replay_of_an_older_full_release_is_refused(device, kit):
    old = kit.release("1.0.0", 1)
    updater = Updater(device)
    updater.install(old, artifact=kit.artifacts["1.0.0"])
    updater.install(kit.release("1.1.0", 2, base="1.0.0"), patch=kit.patches[("1.0.0", "1.1.0")])
    _refused(
        device,
        ReplayError,
        "not above the installed 2",
        lambda: updater.install(old, artifact=kit.artifacts["1.0.0"]),
    )
    assert device.current_version() == "1.1.0"


def test_replay_of_an_older_patch_release_is_refused(device, kit):
    updater = _on(device, kit, "1.1.0")
    older = kit.release("1.1.0", 2, base="1.0.0")  # the very release 1.1.0 came with (re-signed)
    updater.install(kit.release("1.2.0", 3, base="1.1.0"), patch=kit.patches[("1.1.0", "1.2.0")])
    _refused(
        device,
        ReplayError,
        "not above",
        lambda: updater.install(older, patch=kit.patches[("1.0.0", "1.1.0")]),
    )
    assert device.current_version() == "1.2.0"


def test_replay_after_the_operators_rollback_does_not_undo_it(device, kit):
    updater = Updater(device)
    updater.install(kit.release("1.0.0", 1), artifact=kit.artifacts["1.0.0"])
    forward = kit.release("1.1.0", 2, base="1.0.0")
    updater.install(forward, patch=kit.patches[("1.0.0", "1.1.0")])
    updater.rollback()
    _refused(
        device,
        ReplayError,
        "not above",
        lambda: updater.install(forward, patch=kit.patches[("1.0.0", "1.1.0")]),
    )
    assert device.current_version() == "1.0.0"


def test_a_fleet_rollback_is_a_new_release_with_a_higher_counter(device, kit):
    updater = _on(device, kit, "1.1.0")
    result = updater.install(kit.release("1.0.0", 3), artifact=kit.artifacts["1.0.0"])
    assert (result.changed, device.current_version(), device.read_state().release_counter) == (
        True,
        "1.0.0",
        3,
    )


def test_freeze_an_expired_release_is_refused(device, kit):
    manifest = kit.release("1.0.0", 1)
    late = Updater(device, clock=lambda: datetime.now(UTC) + timedelta(days=31))
    _refused(device, ExpiredError, "expired", lambda: late.install(manifest, artifact=kit.artifacts["1.0.0"]))


def test_wrong_key_is_refused(device, kit):
    manifest = kit.release("1.0.0", 1, keys=(ec.generate_private_key(ec.SECP256R1()),))
    updater = Updater(device)
    _refused(
        device,
        SignatureError,
        "unknown key",
        lambda: updater.install(manifest, artifact=kit.artifacts["1.0.0"]),
    )


def test_mix_and_match_files_of_two_releases_are_refused(device, kit, tmp_path):
    mixed = tmp_path / "mixed"
    shutil.copytree(kit.artifacts["1.0.0"], mixed)
    shutil.copyfile(kit.artifacts["1.1.0"] / "model.safetensors", mixed / "model.safetensors")
    updater = Updater(device)
    _refused(
        device,
        HashMismatchError,
        "model.safetensors",
        lambda: updater.install(kit.release("1.0.0", 1), artifact=mixed),
    )


def test_a_partial_bundle_is_refused(device, kit, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(kit.artifacts["1.0.0"], partial)
    (partial / "tokenizer.json").unlink()
    updater = Updater(device)
    _refused(
        device,
        HashMismatchError,
        "missing",
        lambda: updater.install(kit.release("1.0.0", 1), artifact=partial),
    )


def _signed(kit, body, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.write_bytes(add_signature(envelope_for(body), kit.key).to_bytes())
    return path


def test_artifact_id_that_is_not_its_manifest_hash_is_refused(device, kit, tmp_path):
    body = make_release(kit.artifacts["1.0.0"], counter=1, expires_in=timedelta(days=1))
    lying = body.model_copy(update={"artifact": body.artifact.model_copy(update={"sha256": "ab" * 32})})
    manifest = _signed(kit, lying, tmp_path, "lying.json")
    updater = Updater(device)
    _refused(
        device,
        FormatError,
        "is not the sha256 of its sits-manifest.json",
        lambda: updater.install(manifest, artifact=kit.artifacts["1.0.0"]),
    )


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_nan_or_infinity_in_a_signed_manifest_is_a_format_error(device, kit, tmp_path, constant):
    envelope = json.loads(kit.release("1.0.0", 1).read_text())
    envelope["signed"]["quality"] = {"top1_agreement": "@"}
    path = tmp_path / "nan.json"
    path.write_text(json.dumps(envelope).replace('"@"', constant))
    updater = Updater(device)
    _refused(
        device,
        FormatError,
        "not allowed|out of range",
        lambda: updater.install(path, artifact=kit.artifacts["1.0.0"]),
    )


def _patch_release(kit, patch: Path, tmp_path: Path, counter: int = 2) -> Path:
    """A correctly signed 1.1.0 release that carries `patch` (whatever it holds) from 1.0.0."""
    base = make_release(kit.artifacts["1.0.0"], counter=1, expires_in=timedelta(days=1)).artifact.sha256
    ref = PatchRef(
        base_version="1.0.0",
        base_sha256=base,
        sha256=hashlib.sha256(patch.read_bytes()).hexdigest(),
        size=patch.stat().st_size,
    )
    body = make_release(kit.artifacts["1.1.0"], counter=counter, expires_in=timedelta(days=1), patch=ref)
    return _signed(kit, body, tmp_path, f"patch-{counter}.json")


def test_endless_data_a_patch_declaring_more_than_was_signed_writes_nothing(device, kit, tmp_path):
    updater = _on(device, kit)
    patch = tmp_path / "huge.patch"
    shutil.copyfile(kit.patches[("1.0.0", "1.1.0")], patch)
    header, streams = split_patch(patch)
    target = next(t for t in header["targets"] if t["path"] == "model.safetensors")
    target["size"] += 1 << 30  # a 1 GiB raw segment at the end, whose bytes never come
    target["segments"].append(
        {
            "name": "pad",
            "codec": "raw",
            "length": 1 << 30,
            "base_offset": 0,
            "base_length": 0,
            "item_size": 1,
            "stream": 0,
            "stream_bytes": 1 << 30,
        }
    )
    header["streams"][0]["size"] += 1 << 30
    forge_patch(patch, header, streams)
    manifest = _patch_release(kit, patch, tmp_path)
    _refused(
        device,
        FormatError,
        "the release says .* nothing was written",
        lambda: updater.install(manifest, patch=patch),
    )


def test_endless_data_a_bsdiff_control_block_that_never_ends(device, kit, tmp_path):
    updater = _on(device, kit)
    patch = tmp_path / "bsdiff.patch"
    create_patch(kit.artifacts["1.0.0"], kit.artifacts["1.1.0"], patch, codecs={Codec.BSDIFF})
    header, streams = split_patch(patch)
    target = next(t for t in header["targets"] if t["path"] == "sits-manifest.json")
    (segment,) = target["segments"]
    assert segment["codec"] == "bsdiff"
    # Zero-progress entries (0, 0, 0) for far more than the segment's bytes: 100x in 1 kB.
    control = bz2.compress(b"\0" * 24 * 100 * (segment["length"] + 2))
    empty = bz2.compress(b"")
    blob = (
        b"BSDIFF40"
        + b"".join(n.to_bytes(8, "little") for n in (len(control), len(empty), segment["length"]))
        + control
        + empty
        + empty
    )
    streams, header = _replace_whole(header, streams, segment, blob)
    forge_patch(patch, header, streams)
    manifest = _patch_release(kit, patch, tmp_path)
    _refused(device, FormatError, "bsdiff control entry", lambda: updater.install(manifest, patch=patch))


def _replace_whole(header, streams, segment, blob: bytes):
    """Put `blob` as the whole-segment payload of `segment`, in a zstd stream."""
    old_stream = segment["stream"]
    header["streams"][old_stream]["size"] -= segment["stream_bytes"]
    frame = zstandard.ZstdCompressor(level=1).compress(blob)
    if header["streams"][old_stream]["size"] == 0:
        header["streams"][old_stream] = {"coder": "zstd", "length": len(frame), "size": len(blob)}
        streams[old_stream] = frame
    else:
        header["streams"].append({"coder": "zstd", "length": len(frame), "size": len(blob)})
        streams.append(frame)
        segment["stream"] = len(streams) - 1
    segment["stream_bytes"] = len(blob)
    return streams, header


def test_one_junk_public_key_is_skipped_with_a_warning_naming_it(device, kit, caplog):
    (device.keys_dir / "junk.pub").write_text("not a key\n")
    with caplog.at_level(logging.WARNING, logger="sits.agent"):
        Updater(device).install(kit.release("1.0.0", 1), artifact=kit.artifacts["1.0.0"])
    assert device.current_version() == "1.0.0"
    assert any(
        "junk.pub" in r.getMessage() and "not a PEM public key" in r.getMessage() for r in caplog.records
    )


def test_only_junk_public_keys_is_a_clear_error_naming_them(device, kit):
    for path in device.keys_dir.glob("*.pub"):
        path.write_text("junk\n")
    updater = Updater(device)
    _refused(
        device,
        KeyFileError,
        "release.pub: not a PEM public key",
        lambda: updater.install(kit.release("1.0.0", 1), artifact=kit.artifacts["1.0.0"]),
    )


def _trusting(*keys: Path) -> Config:
    """A controller config whose signing.trusted_keys are `keys` (the files devices receive)."""
    return Config.model_validate(
        {
            "application": "attacks",
            "model": {"name": "tiny", "version": "1.0.0", "source": "x"},
            "signing": {"trusted_keys": [str(k) for k in keys]},
            "fleet": {"devices": [{"name": "d", "transport": "local"}]},
        }
    )


def test_the_controllers_pre_send_check_skips_a_junk_key_as_the_device_does(device, kit, tmp_path, caplog):
    junk = tmp_path / "junk.pub"
    junk.write_text("not a key\n")
    shutil.copyfile(junk, device.keys_dir / "junk.pub")
    manifest = kit.release("1.0.0", 1)
    with caplog.at_level(logging.WARNING):
        _check_signed_enough(_trusting(kit.public_key, junk), manifest)  # would send: the device takes it
        Updater(device).install(manifest, artifact=kit.artifacts["1.0.0"])
    assert device.current_version() == "1.0.0"
    warned = {r.name for r in caplog.records if "junk.pub: not a PEM public key" in r.getMessage()}
    assert warned == {"sits.deployer", "sits.agent"}


def test_the_pre_send_check_refuses_only_junk_keys_naming_them_as_the_device_does(tmp_path, kit):
    junk = tmp_path / "junk.pub"
    junk.write_text("not a key\n")
    with pytest.raises(KeyFileError, match=r"unusable key files in signing.trusted_keys: .*junk\.pub"):
        _check_signed_enough(_trusting(junk), kit.release("1.0.0", 1))
