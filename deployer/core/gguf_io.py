"""A bounded, distrustful reader of GGUF headers (metadata and tensor table).

llama.cpp reads the tensors; this module decides first whether a file may be read at all: the
magic and version are known, every count and string length is bounded and fits the file, every
tensor has a known ggml type, a sane shape whose first dimension is a whole number of blocks, an
aligned offset, and a byte range inside the data section that overlaps no other tensor. Builds,
patches and the device agent all go through it, so a lying header is rejected in one place.

Only the standard library is used: the device agent imports it without the `gguf` package.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from deployer.core.tensor_layout import check_tensor_layout
from deployer.errors import FormatError

__all__ = [
    "GGML_TYPES",
    "GGUF_FILE",
    "GGMLType",
    "GGUFHeader",
    "GGUFTensor",
    "is_gguf",
    "read_gguf_header",
]

# The weights file of a GGUF artifact (docs/artifact-format.md).
GGUF_FILE = "model.gguf"
MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_TENSORS = 65_536
MAX_KV = 65_536
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_STRING_BYTES = 16 * 1024 * 1024
MAX_ARRAY_ITEMS = 16 * 1024 * 1024
# Metadata (tokenizer included) larger than this is refused: real files hold a few MB.
MAX_HEADER_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class GGMLType:
    """A ggml tensor type: `block` elements take `block_bytes` bytes; `itemsize` is the element
    size of unquantized types (what the delta codecs work in) and 1 for block-quantized ones."""

    name: str
    block: int
    block_bytes: int

    @property
    def itemsize(self) -> int:
        """Bytes per element for plain types; 1 (bytes) for block-quantized types."""
        return self.block_bytes if self.block == 1 else 1


# ggml type id -> type (ggml.h; sizes checked against gguf.GGML_QUANT_SIZES in the tests).
GGML_TYPES: dict[int, GGMLType] = {
    0: GGMLType("F32", 1, 4),
    1: GGMLType("F16", 1, 2),
    2: GGMLType("Q4_0", 32, 18),
    3: GGMLType("Q4_1", 32, 20),
    6: GGMLType("Q5_0", 32, 22),
    7: GGMLType("Q5_1", 32, 24),
    8: GGMLType("Q8_0", 32, 34),
    9: GGMLType("Q8_1", 32, 40),
    10: GGMLType("Q2_K", 256, 84),
    11: GGMLType("Q3_K", 256, 110),
    12: GGMLType("Q4_K", 256, 144),
    13: GGMLType("Q5_K", 256, 176),
    14: GGMLType("Q6_K", 256, 210),
    15: GGMLType("Q8_K", 256, 292),
    24: GGMLType("I8", 1, 1),
    25: GGMLType("I16", 1, 2),
    26: GGMLType("I32", 1, 4),
    27: GGMLType("I64", 1, 8),
    28: GGMLType("F64", 1, 8),
    30: GGMLType("BF16", 1, 2),
}

# GGUF metadata value types: id -> struct format of a scalar (strings and arrays are handled apart).
_SCALARS: dict[int, str] = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
_SCALARS.update({10: "<Q", 11: "<q", 12: "<d"})
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's place in a GGUF file. `shape` is in ggml order (ne0 first, the row length);
    `offset` is absolute in the file; `dtype` is the ggml type name (e.g. "Q8_0")."""

    name: str
    ggml_type: GGMLType
    shape: tuple[int, ...]
    offset: int
    length: int

    @property
    def dtype(self) -> str:
        """The ggml type name."""
        return self.ggml_type.name

    @property
    def itemsize(self) -> int:
        """Element size for the delta codecs (see GGMLType.itemsize)."""
        return self.ggml_type.itemsize


@dataclass(frozen=True)
class GGUFHeader:
    """A validated GGUF header: metadata, tensors in data order (by offset), and where data starts."""

    path: Path
    version: int
    metadata: dict[str, object]
    tensors: tuple[GGUFTensor, ...]
    alignment: int
    data_start: int
    file_size: int

    def by_name(self) -> dict[str, GGUFTensor]:
        """Tensors keyed by name."""
        return {t.name: t for t in self.tensors}

    def string(self, key: str) -> str | None:
        """A string metadata value, or None when absent or not a string."""
        value = self.metadata.get(key)
        return value if isinstance(value, str) else None

    def integer(self, key: str) -> int | None:
        """An integer metadata value, or None when absent or not an integer."""
        value = self.metadata.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None


def is_gguf(path: Path) -> bool:
    """True when `path` starts with the GGUF magic (nothing else is checked)."""
    try:
        with path.open("rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse and validate the header of the GGUF file `path`.

    Raises FormatError naming the file and the problem: a bad magic or version, counts or
    lengths past the limits or the file, a truncated header, an unknown tensor type, a shape
    that is not whole blocks, misaligned, overlapping or out-of-file tensor data.
    """
    try:
        file_size = path.stat().st_size
        with path.open("rb") as f:
            reader = _Reader(f, path, min(file_size, MAX_HEADER_BYTES))
            return _parse(reader, path, file_size)
    except OSError as exc:
        raise FormatError(f"{path}: cannot read: {exc.strerror or exc}") from exc


def _parse(r: _Reader, path: Path, file_size: int) -> GGUFHeader:
    if r.raw(4) != MAGIC:
        raise FormatError(f"{path}: not a GGUF file (bad magic)", hint="point at a .gguf model file")
    version = r.uint("<I")
    if version not in VERSIONS:
        raise FormatError(f"{path}: unsupported GGUF version {version}", hint="re-export with a current gguf")
    n_tensors, n_kv = r.uint("<Q"), r.uint("<Q")
    if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
        raise FormatError(f"{path}: implausible counts ({n_tensors} tensors, {n_kv} metadata keys)")
    metadata: dict[str, object] = {}
    for _ in range(n_kv):
        key = r.string()
        if key in metadata:
            raise FormatError(f"{path}: metadata key {key!r} appears twice")
        metadata[key] = r.value(r.uint("<I"), key)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise FormatError(f"{path}: general.alignment {alignment!r} is not a power of two")
    infos = [_tensor_info(r, path) for _ in range(n_tensors)]
    data_start = -(-r.position // alignment) * alignment
    tensors = sorted((_place(path, info, data_start, alignment) for info in infos), key=lambda t: t.offset)
    check_tensor_layout(path, tensors, data_start, file_size)
    return GGUFHeader(path, version, metadata, tuple(tensors), alignment, data_start, file_size)


def _tensor_info(r: _Reader, path: Path) -> tuple[str, GGMLType, tuple[int, ...], int]:
    name = r.string()
    n_dims = r.uint("<I")
    if not 1 <= n_dims <= MAX_DIMS:
        raise FormatError(f"{path}: tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
    shape = tuple(r.uint("<Q") for _ in range(n_dims))
    type_id = r.uint("<I")
    ggml_type = GGML_TYPES.get(type_id)
    if ggml_type is None:
        raise FormatError(
            f"{path}: tensor {name!r} has unknown ggml type {type_id}",
            hint="this reader knows " + ", ".join(t.name for t in GGML_TYPES.values()),
        )
    return name, ggml_type, shape, r.uint("<Q")


def _place(
    path: Path, info: tuple[str, GGMLType, tuple[int, ...], int], data_start: int, alignment: int
) -> GGUFTensor:
    name, ggml_type, shape, relative = info
    if shape[0] % ggml_type.block:
        raise FormatError(
            f"{path}: tensor {name!r} rows of {shape[0]} are not whole {ggml_type.name} blocks "
            f"of {ggml_type.block}"
        )
    if relative % alignment:
        raise FormatError(f"{path}: tensor {name!r} offset {relative} is not aligned to {alignment}")
    length = math.prod(shape) // ggml_type.block * ggml_type.block_bytes
    return GGUFTensor(name, ggml_type, shape, data_start + relative, length)


class _Reader:
    """Sequential reads from the header, never past `limit` bytes."""

    def __init__(self, f: BinaryIO, path: Path, limit: int) -> None:
        self._f, self._path, self._limit = f, path, limit
        self.position = 0

    def raw(self, n: int) -> bytes:
        if self.position + n > self._limit:
            raise FormatError(
                f"{self._path}: the GGUF header runs past the end of the file (or {MAX_HEADER_BYTES} bytes)",
                hint="the file is truncated or corrupt; rebuild or re-download it",
            )
        data = self._f.read(n)
        if len(data) != n:
            raise FormatError(f"{self._path}: the GGUF header is truncated")
        self.position += n
        return data

    def scalar(self, fmt: str) -> int | float | bool:
        return struct.unpack(fmt, self.raw(struct.calcsize(fmt)))[0]

    def uint(self, fmt: str) -> int:
        """A count, length or type id: an unsigned integer field ("<I" or "<Q")."""
        return int(self.scalar(fmt))

    def string(self) -> str:
        n = self.uint("<Q")
        if n > MAX_STRING_BYTES:
            raise FormatError(f"{self._path}: a string of {n} bytes in the header is too long")
        try:
            return self.raw(n).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FormatError(f"{self._path}: a header string is not UTF-8 ({exc})") from exc

    def value(self, vtype: int, key: str, *, in_array: bool = False) -> object:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY and not in_array:  # nested arrays do not occur in model files
            item_type, count = self.uint("<I"), self.uint("<Q")
            if count > MAX_ARRAY_ITEMS:
                raise FormatError(f"{self._path}: metadata {key!r} is an array of {count} items (too many)")
            if item_type in _SCALARS:  # one read for the whole array
                fmt = _SCALARS[item_type]
                return list(struct.unpack(f"<{count}{fmt[1]}", self.raw(count * struct.calcsize(fmt))))
            return [self.value(item_type, key, in_array=True) for _ in range(count)]
        raise FormatError(f"{self._path}: metadata {key!r} has unknown value type {vtype}")
