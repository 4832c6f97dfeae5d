"""Every hostile or broken patch is refused with its own error, and nothing escapes staging."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from deployer.core.canonical import canonical_json
from deployer.core.patch_apply import apply_patch
from deployer.core.patch_format import MAGIC, PREFIX_BYTES, TRAILER_BYTES
from deployer.errors import (
    BaseMismatchError,
    FormatError,
    HashMismatchError,
    IntegrityError,
    UnsafePathError,
)
from tests.release.helpers import tree


def _split(patch: Path) -> tuple[dict[str, Any], bytes]:
    data = patch.read_bytes()
    (header_len,) = struct.unpack("<Q", data[8:16])
    header = json.loads(data[PREFIX_BYTES : PREFIX_BYTES + header_len])
    return header, data[PREFIX_BYTES + header_len : -TRAILER_BYTES]


def _forge(path: Path, header: dict[str, Any], payload: bytes, *, header_len: int | None = None) -> Path:
    """A patch with any header, and a correct checksum: only the header's lies are left to catch."""
    raw = canonical_json(header)
    body = MAGIC + struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + payload
    path.write_bytes(body + hashlib.sha256(body).digest())
    return path


@pytest.fixture
def env(fleet, tmp_path):
    """A copy of the patch, an empty staging dir, and a snapshot of everything around it."""
    patch = tmp_path / "p.patch"
    patch.write_bytes(fleet.patch.read_bytes())
    staging = tmp_path / "staging"
    staging.mkdir()
    return patch, staging


def _refused(exc_type, patch: Path, base: Path, staging: Path, match: str):
    before_base = tree(base)
    with pytest.raises(exc_type, match=match):
        apply_patch(patch, base, staging)
    assert tree(base) == before_base
    assert list(staging.iterdir()) == []


def test_flipped_bit_in_payload_is_a_checksum_mismatch(fleet, env):
    patch, staging = env
    data = bytearray(patch.read_bytes())
    data[len(data) - TRAILER_BYTES - 10] ^= 0x04
    patch.write_bytes(bytes(data))
    _refused(HashMismatchError, patch, fleet.v1, staging, "checksum mismatch")


def test_flipped_bit_anywhere_is_refused(fleet, env):
    patch, staging = env
    original = patch.read_bytes()
    for position in range(0, len(original), max(1, len(original) // 97)):
        for bit in (0, 5):
            data = bytearray(original)
            data[position] ^= 1 << bit
            patch.write_bytes(bytes(data))
            with pytest.raises(IntegrityError):
                apply_patch(patch, fleet.v1, staging)
            assert list(staging.iterdir()) == []


def test_truncated_patch(fleet, env):
    patch, staging = env
    patch.write_bytes(patch.read_bytes()[:-100])
    _refused(FormatError, patch, fleet.v1, staging, "truncated")


def test_header_length_claiming_huge_size(fleet, env, tmp_path):
    patch, staging = env
    header, payload = _split(patch)
    _forge(patch, header, payload, header_len=2**62)
    _refused(FormatError, patch, fleet.v1, staging, "header claims")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("size", 2**60, "not a size"),
        ("payload_size", 2**39, "header describes"),
        ("blob_length", 2**30, "not a size"),
        ("length", 2**33, "base range is"),
        ("base_offset", 2**33, "past the base file"),
    ],
)
def test_header_claiming_huge_sizes(fleet, env, field, value, match):
    patch, staging = env
    header, payload = _split(patch)
    target = next(t for t in header["targets"] if t["path"] == "model.safetensors")
    segment = next(s for s in target["segments"] if s["codec"] != "copy")
    if field == "size":
        target["size"] = value
    elif field == "payload_size":
        header["payload_size"] = value
    else:
        segment[field] = value
    _forge(patch, header, payload)
    _refused(FormatError, patch, fleet.v1, staging, match)


@pytest.mark.parametrize("name", ["../escape.json", "/etc/escape.json", "a/../../b", "c:/x", "a//b"])
def test_unsafe_target_names(fleet, env, name):
    patch, staging = env
    header, payload = _split(patch)
    header["targets"][0]["path"] = name
    _forge(patch, header, payload)
    _refused(UnsafePathError, patch, fleet.v1, staging, "not a plain relative path")
    assert not (staging.parent / "escape.json").exists()


def test_unsafe_base_names(fleet, env):
    patch, staging = env
    header, payload = _split(patch)
    header["base"]["../../etc/passwd"] = next(iter(header["base"].values()))
    _forge(patch, header, payload)
    _refused(UnsafePathError, patch, fleet.v1, staging, "not a plain relative path")


def test_symlinked_base_file(fleet, env, tmp_path):
    patch, staging = env
    base = tmp_path / "base"
    base.mkdir()
    for f in fleet.v1.iterdir():
        (base / f.name).write_bytes(f.read_bytes())
    (base / "model.safetensors").unlink()
    (base / "model.safetensors").symlink_to(fleet.v1 / "model.safetensors")
    _refused(UnsafePathError, patch, base, staging, "symlink")


def test_symlink_inside_staging_is_not_followed(fleet, env, tmp_path):
    patch, staging = env
    outside = tmp_path / "outside.json"
    outside.write_text("precious")
    (staging / "config.json").symlink_to(outside)
    with pytest.raises(UnsafePathError, match="symlink"):
        apply_patch(patch, fleet.v1, staging)
    assert outside.read_text() == "precious"
    assert sorted(p.name for p in staging.iterdir()) == ["config.json"]


def test_symlinked_staging_directory(fleet, env, tmp_path):
    patch, staging = env
    link = tmp_path / "link"
    link.symlink_to(staging)
    with pytest.raises(UnsafePathError, match="symlink"):
        apply_patch(patch, fleet.v1, link)
    assert list(staging.iterdir()) == []


def test_wrong_base(fleet, env):
    patch, staging = env
    _refused(BaseMismatchError, patch, fleet.v2, staging, "differs from the one the patch was made")


def test_missing_base_file(fleet, env, tmp_path):
    patch, staging = env
    base = tmp_path / "base"
    base.mkdir()
    _refused(BaseMismatchError, patch, base, staging, "is missing")


def test_output_not_matching_its_hash_is_not_kept(fleet, env):
    patch, staging = env
    header, payload = _split(patch)
    target = next(t for t in header["targets"] if t["path"] == "model.safetensors")
    target["sha256"] = "0" * 64
    _forge(patch, header, payload)
    _refused(HashMismatchError, patch, fleet.v1, staging, "nothing was installed")


def test_bsdiff_claiming_more_output_than_its_segment(fleet, env):
    patch, staging = env
    header, payload = _split(patch)
    segment = next(s for t in header["targets"] for s in t["segments"] if s["codec"] == "bsdiff")
    blob = bytearray(payload)
    start = segment["blob_offset"]
    blob[start + 24 : start + 32] = struct.pack("<q", 2**40)
    _forge(patch, header, bytes(blob))
    _refused(FormatError, patch, fleet.v1, staging, "bsdiff header disagrees")


def test_nothing_written_outside_staging(fleet, env, tmp_path):
    patch, staging = env
    before = {p for p in tmp_path.rglob("*") if staging not in p.parents}
    apply_patch(patch, fleet.v1, staging)
    after = {p for p in tmp_path.rglob("*") if staging not in p.parents}
    assert after == before
    assert not [p for p in staging.rglob("*") if p.name.endswith(".partial")]
    assert sorted(p.name for p in staging.iterdir()) == sorted(p.name for p in fleet.v2.iterdir())
