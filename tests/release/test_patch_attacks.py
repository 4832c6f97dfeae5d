"""Every hostile or broken patch is refused with its own error, and nothing escapes staging."""

from __future__ import annotations

import bz2
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard
from safetensors.numpy import save_file

from deployer.core.canonical import canonical_json
from deployer.core.patch_apply import apply_patch
from deployer.core.patch_format import MAX_HEADER_BYTES, TRAILER_BYTES, Codec
from deployer.errors import (
    BaseMismatchError,
    FormatError,
    HashMismatchError,
    IntegrityError,
    UnsafePathError,
)
from deployer.release.delta import create_patch
from tests.release.helpers import decode_stream, encode_stream, forge_patch, split_patch, stream_range, tree


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


def _changed(header: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The weights file and the index of its first segment that reads a stream."""
    target = next(t for t in header["targets"] if t["path"] == "model.safetensors")
    return target, next(i for i, s in enumerate(target["segments"]) if s["codec"] != "copy")


def _rewrite(patch: Path, path: str, index: int, edit) -> None:
    """Replace the stream bytes that one segment reads with edit(them), keeping every size consistent."""
    header, streams = split_patch(patch)
    stream, start, end = stream_range(header, path, index)
    spec = header["streams"][stream]
    data = decode_stream(spec["coder"], streams[stream])
    new = edit(data[start:end])
    data = data[:start] + new + data[end:]
    streams[stream] = encode_stream(spec["coder"], data)
    spec["length"], spec["size"] = len(streams[stream]), len(data)
    target = next(t for t in header["targets"] if t["path"] == path)
    target["segments"][index]["stream_bytes"] = len(new)
    forge_patch(patch, header, streams)


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


def test_header_length_claiming_huge_size(fleet, env):
    patch, staging = env
    header, streams = split_patch(patch)
    forge_patch(patch, header, streams, header_len=2**62)
    _refused(FormatError, patch, fleet.v1, staging, "header claims")


def test_header_declaring_a_huge_decompressed_size(fleet, env):
    """A small compressed header that would inflate past the cap is refused before inflating."""
    patch, staging = env
    header, streams = split_patch(patch)
    bomb = zstandard.ZstdCompressor(level=1).compress(canonical_json(header) + b" " * MAX_HEADER_BYTES)
    forge_patch(patch, header, streams, raw_header=bomb)
    assert patch.stat().st_size < MAX_HEADER_BYTES // 100
    _refused(FormatError, patch, fleet.v1, staging, "header declares")


def test_header_without_a_declared_size(fleet, env):
    patch, staging = env
    header, streams = split_patch(patch)
    raw = zstandard.ZstdCompressor(write_content_size=False).compress(canonical_json(header))
    forge_patch(patch, header, streams, raw_header=raw)
    _refused(FormatError, patch, fleet.v1, staging, "does not declare its decompressed size")


def test_header_that_is_not_zstd(fleet, env):
    patch, staging = env
    header, streams = split_patch(patch)
    forge_patch(patch, header, streams, raw_header=canonical_json(header))
    _refused(FormatError, patch, fleet.v1, staging, "header is not a zstd frame")


def test_another_format_version_is_refused(fleet, env):
    patch, staging = env
    header, streams = split_patch(patch)
    forge_patch(patch, header, streams, magic=b"SITSPAT1")
    _refused(FormatError, patch, fleet.v1, staging, "format version '1'; this reader knows only version 2")
    header["format_version"] = 1
    forge_patch(patch, header, streams)
    _refused(FormatError, patch, fleet.v1, staging, "unsupported patch format")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("size", 2**60, "not a size"),
        ("stream length", 2**39, "header describes"),
        ("stream size", 2**40, "decodes to 1099511627776 bytes but segments read"),
        ("stream_bytes", 2**30, "stream bytes; a segment of"),
        ("stream", 7, "is not one of the"),
        ("length", 2**33, "base range is"),
        ("base_offset", 2**33, "past the base file"),
    ],
)
def test_header_claiming_huge_sizes(fleet, env, field, value, match):
    patch, staging = env
    header, streams = split_patch(patch)
    target, index = _changed(header)
    segment = target["segments"][index]
    if field == "size":
        target["size"] = value
    elif field.startswith("stream "):
        header["streams"][segment["stream"]][field.split()[1]] = value
    else:
        segment[field] = value
    forge_patch(patch, header, streams)
    _refused(FormatError, patch, fleet.v1, staging, match)


def test_copy_segment_naming_a_stream(fleet, env):
    patch, staging = env
    header, streams = split_patch(patch)
    target, _ = _changed(header)
    next(s for s in target["segments"] if s["codec"] == "copy")["stream"] = 0
    forge_patch(patch, header, streams)
    _refused(FormatError, patch, fleet.v1, staging, "a copy segment reads no stream")


def test_stream_holding_more_than_its_segments_read(fleet, env):
    patch, staging = env
    header, streams = split_patch(patch)
    spec = header["streams"][0]
    streams[0] = encode_stream(spec["coder"], decode_stream(spec["coder"], streams[0]) + b"extra")
    spec["length"] = len(streams[0])
    forge_patch(patch, header, streams)
    _refused(FormatError, patch, fleet.v1, staging, "holds more than its segments read")


def test_stream_ending_early(fleet, env):
    patch, staging = env
    header, streams = split_patch(patch)
    spec = header["streams"][-1]
    streams[-1] = encode_stream(spec["coder"], decode_stream(spec["coder"], streams[-1])[:-3])
    spec["length"] = len(streams[-1])
    forge_patch(patch, header, streams)
    _refused(FormatError, patch, fleet.v1, staging, "ends before the segment does")


def test_stream_that_does_not_decode(fleet, env):
    patch, staging = env
    header, streams = split_patch(patch)
    streams[0] = b"\x00" * len(streams[0])
    forge_patch(patch, header, streams)
    _refused(FormatError, patch, fleet.v1, staging, "payload stream is not valid")


def _sparse_patch(tmp_path: Path) -> tuple[Path, Path, Path, int]:
    """A patch whose only changed tensor is one sparse segment: (patch, base, staging, its index)."""
    base, target, staging = tmp_path / "a", tmp_path / "b", tmp_path / "staging"
    for d in (base, target, staging):
        d.mkdir()
    weight = np.zeros(4096, np.int8)
    save_file({"w": weight}, str(base / "model.safetensors"))
    weight[::100] = 1
    save_file({"w": weight}, str(target / "model.safetensors"))
    patch = create_patch(base, target, tmp_path / "p.patch", codecs={Codec.SPARSE}).path
    segments = split_patch(patch)[0]["targets"][0]["segments"]
    index = next(i for i, s in enumerate(segments) if s["name"] == "w")
    assert segments[index]["codec"] == "sparse"
    return patch, base, staging, index


def _sparse_edit(count: int = 0, gap: int = 0, tail: bytes = b""):
    """An edit of one sparse block: add to its change count and to its first gap, append bytes."""

    def edit(data: bytes) -> bytes:
        (n,) = struct.unpack("<I", data[:4])
        return struct.pack("<I", n + count) + data[4:8] + bytes([data[8] + gap]) + data[9:] + tail

    return edit


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_sparse_edit(tail=b"\0" * 8), "leaves 8 of its"),
        (_sparse_edit(count=1), "gap codes do not make 42 positions"),
        (_sparse_edit(count=5000), "claims 5041 changes in 4096 elements"),
        (_sparse_edit(gap=200), "is past the block's 4096 elements"),
    ],
)
def test_malformed_sparse_segment(tmp_path, edit, match):
    patch, base, staging, index = _sparse_patch(tmp_path)
    _rewrite(patch, "model.safetensors", index, edit)
    _refused(FormatError, patch, base, staging, match)


def _bz2_patch(tmp_path: Path) -> tuple[Path, Path, Path, int]:
    """A patch with a bzip2 stream (int8 weights that all moved a step): (patch, base, staging, index)."""
    base, target, staging = tmp_path / "a", tmp_path / "b", tmp_path / "staging"
    for d in (base, target, staging):
        d.mkdir()
    rng = np.random.default_rng(5)
    weight = rng.integers(-100, 100, 1 << 20, dtype=np.int8)
    save_file({"w": weight}, str(base / "model.safetensors"))
    weight += rng.choice(np.array([-1, 1], np.int8), weight.size)
    save_file({"w": weight}, str(target / "model.safetensors"))
    patch = create_patch(base, target, tmp_path / "p.patch").path
    coders = [s["coder"] for s in split_patch(patch)[0]["streams"]]
    assert "bz2" in coders
    return patch, base, staging, coders.index("bz2")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda raw: raw + b"junk", "has bytes after its end"),
        (lambda raw: raw[:-20], "payload stream is not valid"),
        (lambda raw: raw + bz2.compress(b"more"), "has bytes after its end"),
    ],
)
def test_bz2_stream_with_bytes_after_its_end_or_cut_short(tmp_path, edit, match):
    patch, base, staging, index = _bz2_patch(tmp_path)
    header, streams = split_patch(patch)
    streams[index] = edit(streams[index])
    header["streams"][index]["length"] = len(streams[index])
    forge_patch(patch, header, streams)
    _refused(FormatError, patch, base, staging, match)


def _whole_patch(fleet, tmp_path: Path, codec: Codec) -> tuple[Path, Path, int]:
    """A patch whose sits-manifest.json is one `codec` segment, and that segment's index."""
    patch, staging = tmp_path / f"{codec.value}.patch", tmp_path / "staging"
    staging.mkdir()
    create_patch(fleet.v1, fleet.v2, patch, codecs={codec})
    target = next(t for t in split_patch(patch)[0]["targets"] if t["path"] == "sits-manifest.json")
    assert [s["codec"] for s in target["segments"]] == [codec.value]
    return patch, staging, 0


def test_bsdiff_claiming_more_output_than_its_segment(fleet, tmp_path):
    patch, staging, index = _whole_patch(fleet, tmp_path, Codec.BSDIFF)
    _rewrite(
        patch, "sits-manifest.json", index, lambda blob: blob[:24] + (2**40).to_bytes(8, "little") + blob[32:]
    )
    _refused(FormatError, patch, fleet.v1, staging, "bsdiff header disagrees")


def test_zstd_base_claiming_more_output_than_its_segment(fleet, tmp_path):
    patch, staging, index = _whole_patch(fleet, tmp_path, Codec.ZSTD_BASE)
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (1 << 20))
    _rewrite(patch, "sits-manifest.json", index, lambda _: bomb)
    _refused(FormatError, patch, fleet.v1, staging, "zstd_base frame declares 1048576 bytes")


@pytest.mark.parametrize("name", ["../escape.json", "/etc/escape.json", "a/../../b", "c:/x", "a//b"])
def test_unsafe_target_names(fleet, env, name):
    patch, staging = env
    header, streams = split_patch(patch)
    header["targets"][0]["path"] = name
    forge_patch(patch, header, streams)
    _refused(UnsafePathError, patch, fleet.v1, staging, "not a plain relative path")
    assert not (staging.parent / "escape.json").exists()


def test_unsafe_base_names(fleet, env):
    patch, staging = env
    header, streams = split_patch(patch)
    header["base"]["../../etc/passwd"] = next(iter(header["base"].values()))
    forge_patch(patch, header, streams)
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
    header, streams = split_patch(patch)
    target = next(t for t in header["targets"] if t["path"] == "model.safetensors")
    target["sha256"] = "0" * 64
    forge_patch(patch, header, streams)
    _refused(HashMismatchError, patch, fleet.v1, staging, "nothing was installed")


def test_nothing_written_outside_staging(fleet, env, tmp_path):
    patch, staging = env
    before = {p for p in tmp_path.rglob("*") if staging not in p.parents}
    apply_patch(patch, fleet.v1, staging)
    after = {p for p in tmp_path.rglob("*") if staging not in p.parents}
    assert after == before
    assert not [p for p in staging.rglob("*") if p.name.endswith(".partial")]
    assert sorted(p.name for p in staging.iterdir()) == sorted(p.name for p in fleet.v2.iterdir())
