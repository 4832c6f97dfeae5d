"""Device-side verification: each tampered, foreign, stale, replayed or mixed release is refused."""

from __future__ import annotations

import base64
import json
from datetime import timedelta

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from deployer.core.redact import Secret
from deployer.core.release import Envelope, PatchRef, SignatureEntry, make_release, parse_envelope
from deployer.core.verify import (
    Installed,
    TrustedKeys,
    apply_verified_patch,
    check_patch,
    load_trusted_keys,
    verify_artifact_dir,
    verify_patch_file,
    verify_release,
)
from deployer.errors import (
    BaseMismatchError,
    ExpiredError,
    FormatError,
    HashMismatchError,
    KeyFileError,
    ReplayError,
    SignatureError,
)
from deployer.release.sign import add_signature, envelope_for, generate_key, load_private_key
from tests.release.helpers import NOW, artifact_id, sha


def _verify(fleet, envelope: Envelope, trusted: TrustedKeys | None = None, **installed):
    state = Installed(**({"counter": 1, "artifact_sha256": artifact_id(fleet.v1)} | installed))
    return verify_release(envelope, trusted or fleet.trusted(), now=NOW, installed=state)


def test_a_good_release_verifies_with_its_patch_and_files(fleet):
    release = _verify(fleet, fleet.release())
    assert release.counter == 2
    assert release.artifact.sha256 == artifact_id(fleet.v2)
    assert set(release.artifact.files) >= {"model.safetensors", "tokenizer.json", "sits-manifest.json"}
    verify_patch_file(fleet.patch, release)
    verify_artifact_dir(fleet.v2, release)


def test_envelope_bytes_round_trip_exactly(fleet):
    envelope = fleet.release()
    again = parse_envelope(envelope.to_bytes(), "test")
    assert again.signed_bytes() == envelope.signed_bytes()
    _verify(fleet, again)


def test_every_flipped_bit_of_the_manifest_is_refused(fleet):
    data = fleet.release().to_bytes()
    for position in range(0, len(data), 3):
        flipped = bytearray(data)
        flipped[position] ^= 0x01
        with pytest.raises((SignatureError, FormatError)):
            _verify(fleet, parse_envelope(bytes(flipped), "flipped"))


def test_flipped_bit_in_the_signed_counter(fleet):
    envelope = fleet.release(counter=6)
    signed = dict(envelope.signed, counter=7)  # 6 -> 7 is one bit
    with pytest.raises(SignatureError, match="does not verify"):
        _verify(fleet, Envelope(signed=signed, signatures=envelope.signatures))


def test_flipped_bit_in_the_signature(fleet):
    envelope = fleet.release()
    raw = bytearray(base64.b64decode(envelope.signatures[0].sig))
    raw[-1] ^= 0x01
    entry = SignatureEntry(keyid=envelope.signatures[0].keyid, sig=base64.b64encode(raw).decode())
    with pytest.raises(SignatureError, match="does not verify"):
        _verify(fleet, Envelope(signed=envelope.signed, signatures=[entry]))


def test_wrong_key_claiming_a_trusted_key_id(fleet):
    envelope = fleet.release(signers=(2,))  # key 2 is not trusted...
    trusted_id = next(iter(fleet.trusted().keys))
    forged = [SignatureEntry(keyid=trusted_id, sig=envelope.signatures[0].sig)]  # ...posing as key 0
    with pytest.raises(SignatureError, match="does not verify"):
        _verify(fleet, Envelope(signed=envelope.signed, signatures=forged))


def test_unknown_key_id(fleet):
    with pytest.raises(SignatureError, match="unknown key id"):
        _verify(fleet, fleet.release(signers=(2,)))


def test_unsigned_release(fleet):
    with pytest.raises(SignatureError, match="not signed"):
        _verify(fleet, fleet.release(signers=()))


def test_threshold_k_of_n(fleet):
    two_of_three = fleet.trusted(threshold=2, count=3)
    with pytest.raises(SignatureError, match="2 required"):
        _verify(fleet, fleet.release(signers=(0,)), two_of_three)
    # The same key twice is still one signer.
    doubled = fleet.release(signers=(0,))
    doubled = Envelope(signed=doubled.signed, signatures=doubled.signatures * 2)
    with pytest.raises(SignatureError, match="2 required"):
        _verify(fleet, doubled, two_of_three)
    assert _verify(fleet, fleet.release(signers=(0, 2)), two_of_three).counter == 2


def test_rotation_old_and_new_keys_both_trusted(fleet):
    both = fleet.trusted(count=3)
    assert _verify(fleet, fleet.release(signers=(1,)), both)
    assert _verify(fleet, fleet.release(signers=(2,)), both)


def test_expired_release(fleet):
    envelope = fleet.release(expires_in=timedelta(seconds=-1))
    with pytest.raises(ExpiredError, match="expired at"):
        _verify(fleet, envelope)


def test_replayed_older_release(fleet):
    with pytest.raises(ReplayError, match="not above the installed 2"):
        _verify(fleet, fleet.release(counter=2), counter=2)
    with pytest.raises(ReplayError, match="not above the installed 5"):
        _verify(fleet, fleet.release(counter=3), counter=5)


def test_deliberate_rollback_is_a_new_release_with_a_higher_counter(fleet):
    # Naming v2 again, after v3 (counter 7) was installed, is fine with counter 8.
    release = _verify(fleet, fleet.release(counter=8, patch=False), counter=7)
    assert release.patch is None


def test_base_mismatch(fleet):
    with pytest.raises(BaseMismatchError, match="this device has"):
        _verify(fleet, fleet.release(), artifact_sha256=artifact_id(fleet.v2))


def test_patch_length_and_hash(fleet, tmp_path):
    release = _verify(fleet, fleet.release())
    truncated = tmp_path / "t.patch"
    truncated.write_bytes(fleet.patch.read_bytes()[:-1])
    with pytest.raises(FormatError, match="truncated"):
        verify_patch_file(truncated, release)
    flipped = bytearray(fleet.patch.read_bytes())
    flipped[100] ^= 0x10
    other = tmp_path / "f.patch"
    other.write_bytes(bytes(flipped))
    with pytest.raises(HashMismatchError, match="is not the release's"):
        verify_patch_file(other, release)
    with pytest.raises(FormatError, match="carries no patch"):
        check_patch(_verify(fleet, fleet.release(patch=False)), 1, sha(fleet.patch))


def test_mixed_files_from_two_releases(fleet, tmp_path):
    release = _verify(fleet, fleet.release())
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for f in fleet.v2.iterdir():
        (mixed / f.name).write_bytes(f.read_bytes())
    (mixed / "model.safetensors").write_bytes((fleet.v1 / "model.safetensors").read_bytes())
    with pytest.raises(HashMismatchError, match="two releases mixed"):
        verify_artifact_dir(mixed, release)
    (mixed / "model.safetensors").write_bytes((fleet.v2 / "model.safetensors").read_bytes())
    (mixed / "extra.bin").write_bytes(b"smuggled")
    with pytest.raises(HashMismatchError, match="unexpected"):
        verify_artifact_dir(mixed, release)


def test_malformed_signed_part_is_refused_after_signature(fleet):
    key = fleet.keys[0]
    envelope = add_signature(Envelope(signed={"kind": "sits-release"}, signatures=[]), key)
    with pytest.raises(FormatError, match="malformed release"):
        _verify(fleet, envelope)


def test_keygen_writes_an_encrypted_key_and_never_overwrites(tmp_path):
    pair = generate_key(tmp_path / "k.key", tmp_path / "k.pub", passphrase=Secret("correct horse"))
    pem = (tmp_path / "k.key").read_bytes()
    assert b"ENCRYPTED PRIVATE KEY" in pem
    assert (tmp_path / "k.key").stat().st_mode & 0o777 == 0o600
    key = load_private_key(tmp_path / "k.key", Secret("correct horse"))
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert list(load_trusted_keys([tmp_path / "k.pub"]).keys) == [pair.keyid]
    with pytest.raises(KeyFileError, match="wrong passphrase"):
        load_private_key(tmp_path / "k.key", Secret("wrong horse!"))
    with pytest.raises(KeyFileError, match="no passphrase was given"):
        load_private_key(tmp_path / "k.key", None)
    with pytest.raises(KeyFileError, match="refusing to overwrite"):
        generate_key(tmp_path / "k.key", tmp_path / "k2.pub", passphrase=Secret("correct horse"))
    with pytest.raises(KeyFileError, match="no passphrase"):
        generate_key(tmp_path / "n.key", tmp_path / "n.pub", passphrase=None)
    generate_key(tmp_path / "u.key", tmp_path / "u.pub", passphrase=None, unencrypted=True)
    assert b"ENCRYPTED" not in (tmp_path / "u.key").read_bytes()


def test_trusted_keys_refuse_a_non_p256_key(tmp_path):
    from cryptography.hazmat.primitives import serialization

    pem = (
        ec.generate_private_key(ec.SECP384R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    path = tmp_path / "p384.pub"
    path.write_bytes(pem)
    with pytest.raises(KeyFileError, match="P-256"):
        load_trusted_keys([path])
    with pytest.raises(KeyFileError, match="threshold"):
        TrustedKeys({}, 1)


def test_envelope_parser_bounds():
    with pytest.raises(FormatError, match="larger than"):
        parse_envelope(b" " * (5 * 1024 * 1024), "big")
    with pytest.raises(FormatError, match="not valid JSON"):
        parse_envelope(b"{", "broken")
    with pytest.raises(FormatError, match="malformed release envelope"):
        parse_envelope(json.dumps({"signed": {}, "signatures": [], "x": 1}).encode(), "extra")


def test_apply_verified_patch_end_to_end(fleet, tmp_path):
    staging = tmp_path / "staging"
    staging.mkdir()
    state = Installed(1, artifact_id(fleet.v1))
    release = apply_verified_patch(
        fleet.release(), fleet.patch, fleet.v1, staging, fleet.trusted(), now=NOW, installed=state
    )
    assert release.artifact.sha256 == artifact_id(staging)


def test_release_naming_other_files_than_its_patch_makes(fleet, tmp_path):
    # A release of v1's files that carries the v1->v2 patch: refused from the patch header's
    # target list, before a byte is written.
    ref = fleet.release().signed["patch"]
    body = make_release(fleet.v1, counter=2, expires_in=timedelta(days=1), now=NOW, patch=PatchRef(**ref))
    envelope = add_signature(envelope_for(body), fleet.keys[0])
    staging = tmp_path / "staging"
    staging.mkdir()
    state = Installed(1, artifact_id(fleet.v1))
    with pytest.raises(FormatError, match=r"the release says .* nothing was written"):
        apply_verified_patch(
            envelope, fleet.patch, fleet.v1, staging, fleet.trusted(), now=NOW, installed=state
        )
    assert list(staging.iterdir()) == []


def test_non_canonical_base64_spelling_of_a_valid_signature(fleet):
    # ECDSA signatures are random: sign until one has base64 padding (its DER length % 3 != 0).
    envelope = next(e for e in (fleet.release() for _ in range(100)) if e.signatures[0].sig.endswith("="))
    sig = envelope.signatures[0].sig
    der = base64.b64decode(sig)
    padded = sig.rstrip("=")
    # Flip the unused low bits of the last base64 digit: same bytes, different spelling.
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    last = alphabet.index(padded[-1]) ^ 1
    spelled = padded[:-1] + alphabet[last] + sig[len(padded) :]
    assert base64.b64decode(spelled) == der and spelled != sig
    forged = [SignatureEntry(keyid=envelope.signatures[0].keyid, sig=spelled)]
    with pytest.raises(SignatureError, match="does not verify"):
        _verify(fleet, Envelope(signed=envelope.signed, signatures=forged))
