"""The sits patch container: its layout, its header model, and a bounded, distrustful header reader.

Layout (docs/patch-format.md has it byte by byte)::

    "SITSPAT1" | u64 LE header_len | header (canonical JSON) | payload | sha256(all preceding bytes)

The header is read and validated completely before any payload byte is touched: every size is
bounded, every range must lie inside the file it points into, and every file name must be a plain
relative path. Only the standard library is used here; the device agent imports it.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path, PurePosixPath

from deployer.core.canonical import canonical_json
from deployer.errors import FormatError, SitsError, UnsafePathError

MAGIC = b"SITSPAT1"
PREFIX_BYTES = len(MAGIC) + 8
TRAILER_BYTES = 32
FORMAT_VERSION = 1
# Tensor codecs work on blocks of this many bytes, so applying needs a few blocks of memory.
BLOCK_BYTES = 1024 * 1024
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_FILE_BYTES = 1 << 40
MAX_FILES = 10_000
MAX_SEGMENTS = 1_000_000
# bsdiff4 decodes a segment in one piece, so its segments are capped to keep apply memory bounded.
MAX_BSDIFF_BYTES = 256 * 1024 * 1024
ITEM_SIZES = (1, 2, 4, 8)

_SHA256 = re.compile(r"[0-9a-f]{64}")


class Codec(StrEnum):
    """How one segment of a target file is rebuilt."""

    COPY = "copy"  # the base range, unchanged
    XOR_ZSTD = "xor_zstd"  # zstd(target XOR base)
    PLANES_ZSTD = "planes_zstd"  # zstd(byte planes of (target - base) as unsigned integers), per block
    XOR_PLANES_ZSTD = "xor_planes_zstd"  # zstd(byte planes of target XOR base), per block
    SPARSE_ZSTD = "sparse_zstd"  # zstd(per block: count, positions, new values)
    BSDIFF = "bsdiff"  # bsdiff4 of the base range, in one piece
    RAW_ZSTD = "raw_zstd"  # zstd(target), no base

    @property
    def uses_base(self) -> bool:
        """Whether the segment reads a range of the base file."""
        return self is not Codec.RAW_ZSTD

    @property
    def same_length(self) -> bool:
        """Whether the base range must be exactly as long as the segment."""
        return self not in (Codec.RAW_ZSTD, Codec.BSDIFF)


@dataclass(frozen=True)
class FileRef:
    """A file's expected content: its sha256 and size."""

    sha256: str
    size: int


@dataclass(frozen=True)
class Segment:
    """`length` bytes of a target file, rebuilt with `codec` from a base range and a payload blob.

    Offsets: `base_offset` is in the base file of the same path, `blob_offset` in the payload.
    `item_size` is the element size the codec works in (1 when the codec does not care).
    """

    name: str
    codec: Codec
    length: int
    base_offset: int
    base_length: int
    blob_offset: int
    blob_length: int
    item_size: int


@dataclass(frozen=True)
class TargetFile:
    """A file of the target artifact, as the concatenation of its segments."""

    path: str
    sha256: str
    size: int
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class PatchHeader:
    """A validated patch header. `base` lists every base file the patch reads."""

    base: dict[str, FileRef]
    targets: tuple[TargetFile, ...]
    payload_size: int


def payload_start(header_len: int) -> int:
    """Absolute offset of the payload in a patch whose header JSON is `header_len` bytes."""
    return PREFIX_BYTES + header_len


def check_relative_path(name: object, where: str) -> str:
    """Return `name` if it is a plain relative POSIX path inside its directory, else raise.

    Raises UnsafePathError for absolute paths, '..', backslashes, NUL or empty components.
    """
    if not isinstance(name, str) or not name:
        raise FormatError(f"{where}: a file name must be a non-empty string, got {name!r}")
    parts = name.split("/")
    if (
        name.startswith("/")
        or "\\" in name
        or "\0" in name
        or re.match(r"^[A-Za-z]:", name)
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise UnsafePathError(
            f"{where}: file name {name!r} is not a plain relative path",
            hint="names must not be absolute or contain '..'; the patch is refused",
        )
    return str(PurePosixPath(name))


def list_files(root: Path) -> dict[str, Path]:
    """Every regular file under `root` by relative POSIX path. Raises UnsafePathError on symlinks."""
    if not root.is_dir() or root.is_symlink():
        raise SitsError(f"{root}: not a directory", hint="pass an artifact directory")
    found: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if path.is_symlink():
                raise UnsafePathError(f"{path}: symlinks are not allowed in an artifact")
        for name in filenames:
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            found[check_relative_path(rel, str(root))] = Path(dirpath) / name
    return found


def encode_header(header: PatchHeader) -> bytes:
    """The canonical JSON bytes of a header, as written into a patch file."""
    return canonical_json(
        {
            "format": "sits-patch",
            "format_version": FORMAT_VERSION,
            "payload_size": header.payload_size,
            "base": {p: {"sha256": r.sha256, "size": r.size} for p, r in header.base.items()},
            "targets": [
                {
                    "path": t.path,
                    "sha256": t.sha256,
                    "size": t.size,
                    "segments": [_segment_dict(s) for s in t.segments],
                }
                for t in header.targets
            ],
        }
    )


def _segment_dict(s: Segment) -> dict[str, object]:
    return {
        "name": s.name,
        "codec": s.codec.value,
        "length": s.length,
        "base_offset": s.base_offset,
        "base_length": s.base_length,
        "blob_offset": s.blob_offset,
        "blob_length": s.blob_length,
        "item_size": s.item_size,
    }


def read_header(path: Path) -> tuple[PatchHeader, int]:
    """Read and validate the header of the patch at `path`; return it and the header JSON length.

    Reads at most MAX_HEADER_BYTES + 16 bytes whatever the file claims. Raises FormatError
    (malformed, truncated, sizes out of bounds) or UnsafePathError (a file name escapes).
    """
    try:
        file_size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(PREFIX_BYTES)
            if len(prefix) < PREFIX_BYTES or prefix[: len(MAGIC)] != MAGIC:
                raise FormatError(f"{path}: not a sits patch (bad magic or shorter than 16 bytes)")
            (header_len,) = struct.unpack("<Q", prefix[len(MAGIC) :])
            if header_len > MAX_HEADER_BYTES or PREFIX_BYTES + header_len > file_size:
                raise FormatError(
                    f"{path}: header claims {header_len} bytes; the file has {file_size} and the "
                    f"limit is {MAX_HEADER_BYTES}",
                    hint="the patch is truncated or corrupt; make or download it again",
                )
            raw = f.read(header_len)
    except OSError as exc:
        raise FormatError(f"{path}: cannot read the patch: {exc.strerror or exc}") from exc
    header = parse_header(raw, where=str(path))
    expected = PREFIX_BYTES + header_len + header.payload_size + TRAILER_BYTES
    if expected != file_size:
        raise FormatError(
            f"{path}: the patch is {file_size} bytes but its header describes {expected}",
            hint="the patch is truncated or has trailing bytes; make or download it again",
        )
    return header, header_len


def parse_header(raw: bytes, *, where: str = "patch") -> PatchHeader:
    """Validate header JSON bytes into a PatchHeader. Raises FormatError or UnsafePathError."""
    if len(raw) > MAX_HEADER_BYTES:
        raise FormatError(f"{where}: header is larger than {MAX_HEADER_BYTES} bytes")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise FormatError(f"{where}: header is not valid JSON ({exc})") from exc
    _keys(doc, {"format", "format_version", "payload_size", "base", "targets"}, where)
    if doc["format"] != "sits-patch" or doc["format_version"] != FORMAT_VERSION:
        raise FormatError(
            f"{where}: unsupported patch format {doc['format']!r} v{doc['format_version']!r}",
            hint=f"this reader knows sits-patch v{FORMAT_VERSION}; upgrade the agent",
        )
    payload_size = _size(doc["payload_size"], f"{where}: payload_size", MAX_FILE_BYTES)
    base = _base_files(doc["base"], where)
    targets = doc["targets"]
    if not isinstance(targets, list) or len(targets) > MAX_FILES:
        raise FormatError(f"{where}: targets must be a list of at most {MAX_FILES} files")
    parsed = tuple(_target(t, base, payload_size, where) for t in targets)
    paths = [t.path for t in parsed]
    if len(set(paths)) != len(paths):
        raise FormatError(f"{where}: a target file is listed twice")
    if sum(len(t.segments) for t in parsed) > MAX_SEGMENTS:
        raise FormatError(f"{where}: more than {MAX_SEGMENTS} segments")
    return PatchHeader(base, parsed, payload_size)


def _keys(doc: object, keys: set[str], where: str) -> dict:
    if not isinstance(doc, dict) or set(doc) != keys:
        got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise FormatError(f"{where}: expected an object with keys {sorted(keys)}, got {got}")
    return doc


def _size(value: object, where: str, limit: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
        raise FormatError(f"{where}: {value!r} is not a size between 0 and {limit}")
    return value


def _sha(value: object, where: str) -> str:
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise FormatError(f"{where}: {value!r} is not a lowercase hex sha256")
    return value


def _base_files(doc: object, where: str) -> dict[str, FileRef]:
    if not isinstance(doc, dict) or len(doc) > MAX_FILES:
        raise FormatError(f"{where}: base must map at most {MAX_FILES} file names to hashes")
    out: dict[str, FileRef] = {}
    for name, ref in doc.items():
        path = check_relative_path(name, f"{where}: base")
        spec = _keys(ref, {"sha256", "size"}, f"{where}: base {name!r}")
        out[path] = FileRef(
            _sha(spec["sha256"], f"{where}: base {name!r} sha256"),
            _size(spec["size"], f"{where}: base {name!r} size", MAX_FILE_BYTES),
        )
    return out


def _target(doc: object, base: dict[str, FileRef], payload_size: int, where: str) -> TargetFile:
    spec = _keys(doc, {"path", "sha256", "size", "segments"}, f"{where}: target")
    path = check_relative_path(spec["path"], f"{where}: target")
    at = f"{where}: target {path!r}"
    size = _size(spec["size"], f"{at} size", MAX_FILE_BYTES)
    if not isinstance(spec["segments"], list):
        raise FormatError(f"{at}: segments must be a list")
    segments = tuple(
        _segment(s, base.get(path), payload_size, f"{at} segment {i}") for i, s in enumerate(spec["segments"])
    )
    if sum(s.length for s in segments) != size:
        raise FormatError(f"{at}: segments add up to {sum(s.length for s in segments)}, not {size}")
    return TargetFile(path, _sha(spec["sha256"], f"{at} sha256"), size, segments)


def _segment(doc: object, base: FileRef | None, payload_size: int, where: str) -> Segment:
    keys = {"name", "codec", "length", "base_offset", "base_length"}
    keys |= {"blob_offset", "blob_length", "item_size"}
    spec = _keys(doc, keys, where)
    try:
        codec = Codec(spec["codec"])
    except ValueError:
        raise FormatError(f"{where}: unknown codec {spec['codec']!r}") from None
    if not isinstance(spec["name"], str) or len(spec["name"]) > 1024:
        raise FormatError(f"{where}: name must be a string of at most 1024 characters")
    seg = Segment(
        spec["name"],
        codec,
        _size(spec["length"], f"{where} length", MAX_FILE_BYTES),
        _size(spec["base_offset"], f"{where} base_offset", MAX_FILE_BYTES),
        _size(spec["base_length"], f"{where} base_length", MAX_FILE_BYTES),
        _size(spec["blob_offset"], f"{where} blob_offset", payload_size),
        _size(spec["blob_length"], f"{where} blob_length", payload_size),
        _size(spec["item_size"], f"{where} item_size", 8),
    )
    _check_segment(seg, base, payload_size, where)
    return seg


def _check_segment(seg: Segment, base: FileRef | None, payload_size: int, where: str) -> None:
    if seg.blob_offset + seg.blob_length > payload_size:
        raise FormatError(f"{where}: payload range ends past the payload ({payload_size} bytes)")
    if seg.item_size not in ITEM_SIZES or seg.length % seg.item_size:
        raise FormatError(f"{where}: item_size {seg.item_size} does not divide {seg.length}")
    if seg.codec.uses_base:
        if base is None:
            raise FormatError(f"{where}: codec {seg.codec.value} needs a base file, none listed")
        if seg.base_offset + seg.base_length > base.size:
            raise FormatError(f"{where}: base range ends past the base file ({base.size} bytes)")
    elif seg.base_offset or seg.base_length:
        raise FormatError(f"{where}: codec {seg.codec.value} must not name a base range")
    if seg.codec.same_length and seg.base_length != seg.length:
        raise FormatError(f"{where}: base range is {seg.base_length} bytes, segment {seg.length}")
    if seg.codec is Codec.COPY and seg.blob_length:
        raise FormatError(f"{where}: a copy segment carries no payload")
    if seg.codec is Codec.BSDIFF and max(seg.length, seg.base_length, seg.blob_length) > (MAX_BSDIFF_BYTES):
        raise FormatError(f"{where}: bsdiff segments are limited to {MAX_BSDIFF_BYTES} bytes")
