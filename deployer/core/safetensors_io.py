"""A bounded, distrustful reader of safetensors headers.

The `safetensors` library reads tensors; this module decides first whether a file may be read at
all: the header length fits the file, the JSON is sane, every tensor's byte range lies inside the
data section, ranges do not overlap, and sizes agree with dtype x shape. Builds, patches and the
device agent all go through it, so a lying header is rejected in one place.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

from deployer.core.canonical import parse_json
from deployer.core.tensor_layout import check_tensor_layout
from deployer.errors import FormatError

# Header JSON larger than this is refused outright (safetensors itself caps at 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's place in a safetensors file. `offset` is absolute in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated header: tensors in file order, the metadata, and where data starts."""

    path: Path
    data_start: int
    file_size: int
    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str]

    def by_name(self) -> dict[str, TensorEntry]:
        """Tensors keyed by name."""
        return {t.name: t for t in self.tensors}


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and validate the header of `path`. Raises FormatError naming the file and the problem."""
    try:
        file_size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise FormatError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
                raise FormatError(
                    f"{path}: header length {header_len} is larger than the file ({file_size} bytes)",
                    hint="the file is truncated or corrupt; rebuild or re-download it",
                )
            raw = f.read(header_len)
    except OSError as exc:
        raise FormatError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    header = parse_json(raw, f"{path}: header")
    if not isinstance(header, dict):
        raise FormatError(f"{path}: header is not a JSON object")
    data_start = 8 + header_len
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise FormatError(f"{path}: __metadata__ must map strings to strings")
    entries = [_entry(path, name, spec, data_start) for name, spec in header.items()]
    entries.sort(key=lambda e: e.offset)
    check_tensor_layout(path, entries, data_start, file_size)
    return SafetensorsHeader(path, data_start, file_size, tuple(entries), dict(metadata))


def _entry(path: Path, name: str, spec: object, data_start: int) -> TensorEntry:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise FormatError(f"{path}: tensor {name!r} has a malformed header entry")
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if dtype not in DTYPE_SIZES:
        raise FormatError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise FormatError(f"{path}: tensor {name!r} has an invalid shape {shape!r}")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and o >= 0 for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise FormatError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
    length = offsets[1] - offsets[0]
    if length != math.prod(shape) * DTYPE_SIZES[dtype]:
        raise FormatError(
            f"{path}: tensor {name!r} claims {length} bytes but {dtype}{shape} needs "
            f"{math.prod(shape) * DTYPE_SIZES[dtype]}"
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + offsets[0], length)
