"""The distrustful GGUF header reader: real files read right, lying files refused with the file named."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import pytest

from deployer.core.gguf_io import GGML_TYPES, MAX_STRING_BYTES, is_gguf, read_gguf_header
from deployer.errors import FormatError

Q8_0, F32 = 8, 0


def _string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def _gguf_bytes(
    tensors: list[tuple[str, tuple[int, ...], int, int]],
    *,
    data: int = 64,
    magic: bytes = b"GGUF",
    version: int = 3,
    kv: bytes = b"",
    n_kv: int = 0,
) -> bytes:
    """A GGUF file whose header says exactly what the test wants it to say, true or not."""
    out = magic + struct.pack("<IQQ", version, len(tensors), n_kv) + kv
    for name, shape, type_id, offset in tensors:
        out += _string(name) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *shape)
        out += struct.pack("<IQ", type_id, offset)
    out += b"\0" * (-len(out) % 32)
    return out + b"\0" * data


def _write(tmp_path: Path, content: bytes) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    return path


def test_a_consistent_table_is_read_in_data_order(tmp_path):
    content = _gguf_bytes([("b", (32, 1), Q8_0, 64), ("a", (4,), F32, 0)], data=100)
    header = read_gguf_header(_write(tmp_path, content))
    assert [(t.name, t.dtype, t.length, t.itemsize) for t in header.tensors] == [
        ("a", "F32", 16, 4),
        ("b", "Q8_0", 34, 1),
    ]
    assert header.tensors[1].offset == header.data_start + 64
    assert is_gguf(header.path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"GGUX" + b"\0" * 60, "bad magic"),
        (_gguf_bytes([], version=9), "unsupported GGUF version 9"),
        (b"GGUF\x03\0\0\0" + b"\x01", "truncated"),
        (_gguf_bytes([("w", (32,), 99, 0)]), "unknown ggml type 99"),
        (_gguf_bytes([("w", (33,), Q8_0, 0)]), "not whole Q8_0 blocks"),
        (_gguf_bytes([("w", (32,), Q8_0, 16)]), "not aligned"),
        (_gguf_bytes([("w", (32, 4), Q8_0, 0)]), "past the end of the file"),
        (_gguf_bytes([("a", (8,), F32, 0), ("b", (8,), F32, 0)]), "overlaps"),
        (_gguf_bytes([("a", (8,), F32, 0), ("a", (8,), F32, 32)]), "appears twice"),
        (_gguf_bytes([("w", (1, 1, 1, 1, 1), F32, 0)]), "5 dimensions"),
        (_gguf_bytes([], n_kv=10**9), "implausible counts"),
        (_gguf_bytes([], n_kv=1, kv=struct.pack("<Q", MAX_STRING_BYTES + 1)), "too long"),
        (_gguf_bytes([], n_kv=1, kv=_string("k") + struct.pack("<I", 77)), "unknown value type 77"),
        (
            _gguf_bytes([], n_kv=1, kv=_string("general.alignment") + struct.pack("<II", 4, 24)),
            "not a power of two",
        ),
    ],
)
def test_lying_headers_are_refused_naming_the_file(tmp_path, content, message):
    path = _write(tmp_path, content)
    with pytest.raises(FormatError, match=message) as info:
        read_gguf_header(path)
    assert str(path) in info.value.message


def test_the_type_table_matches_the_gguf_package():
    for type_id, ggml_type in GGML_TYPES.items():
        qtype = gguf.GGMLQuantizationType(type_id)
        assert (qtype.name, gguf.GGML_QUANT_SIZES[qtype]) == (
            ggml_type.name,
            (ggml_type.block, ggml_type.block_bytes),
        )


@pytest.mark.slow
def test_the_shipped_smollm2_gguf_reads_like_the_gguf_package_reads_it():
    from deployer.build.demo_model import smollm2_gguf_path

    path = smollm2_gguf_path()
    ours = read_gguf_header(path)
    theirs = gguf.GGUFReader(path)
    assert ours.string("general.architecture") == "llama"
    assert ours.string("tokenizer.chat_template").startswith("{% for message in messages %}")
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    by_name = ours.by_name()
    assert len(by_name) == len(theirs.tensors) == 272
    for t in theirs.tensors:
        mine = by_name[t.name]
        assert (mine.offset, mine.length, mine.dtype) == (
            t.data_offset,
            t.n_bytes,
            t.tensor_type.name,
        )
