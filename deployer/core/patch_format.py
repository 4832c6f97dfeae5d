"""The sits patch container: its layout, its header model, and a bounded, distrustful header reader.

Layout (docs/patch-format.md has it byte by byte)::

    "SITSPAT2" | u64 LE header_len | header (zstd frame of canonical JSON) | payload | sha256(all before)

The payload is a few compressed streams back to back; each segment of a target file reads its bytes
from one of them, in header order. The header is read and validated completely before any payload
byte is touched: every size is bounded (the compressed header's declared size before it is
decompressed), every range must lie inside the file it points into, every stream byte must be
claimed by exactly one segment, and every file name must be a plain relative path. Only the
standard library and zstandard are used here; the device agent imports it.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import BinaryIO

import zstandard

from deployer.core.canonical import canonical_json, parse_json
from deployer.errors import FormatError, SitsError, UnsafePathError

FORMAT_VERSION = 2
MAGIC_STEM = b"SITSPAT"
MAGIC = MAGIC_STEM + str(FORMAT_VERSION).encode()
PREFIX_BYTES = len(MAGIC) + 8
TRAILER_BYTES = 32
# Tensor codecs work on blocks of this many bytes, so applying needs a few blocks of memory.
BLOCK_BYTES = 1024 * 1024
# Both the compressed header and the JSON it decompresses to.
MAX_HEADER_BYTES = 16 * 1024 * 1024
HEADER_LEVEL = 19
MAX_FILE_BYTES = 1 << 40
MAX_FILES = 10_000
MAX_SEGMENTS = 1_000_000
# Decoders refuse zstd frames with a larger window (a writer keeps to it): memory stays bounded.
ZSTD_MAX_WINDOW = 8 * 1024 * 1024
# Every stream is decoded at once, each with its own decoder state: few of them keep memory small.
MAX_STREAMS = 8
# bsdiff and zstd_base segments hold their (compressed) stream bytes and, for zstd_base, the base
# range in memory while they are decoded, so both are capped: apply memory stays bounded whatever
# the patch says. The writer (release/delta.py) makes whole segments of at most 16 MiB.
MAX_WHOLE_BYTES = 16 * 1024 * 1024
# A whole segment's stream bytes: its bsdiff or zstd frame, chosen only when it beats the raw
# bytes, so never much more than the segment (bzip2 and zstd add well under this).
WHOLE_OVERHEAD_BYTES = 4096
ITEM_SIZES = (1, 2, 4, 8)

_SHA256 = re.compile(r"[0-9a-f]{64}")


class Codec(StrEnum):
    """How one segment of a target file is rebuilt from a base range and the bytes of its stream."""

    COPY = "copy"  # the base range, unchanged; reads no stream
    RAW = "raw"  # the target bytes themselves; no base
    XOR = "xor"  # target XOR base
    PLANES = "planes"  # byte planes of zigzag(target - base) as little-endian integers, per block
    XOR_PLANES = "xor_planes"  # byte planes of target XOR base, per block
    SPARSE = "sparse"  # per block: the changed elements as gap codes, and their planes differences
    BSDIFF = "bsdiff"  # a whole bsdiff4 patch of the base range
    ZSTD_BASE = "zstd_base"  # a whole zstd frame with the base range as its dictionary (--patch-from)

    @property
    def uses_base(self) -> bool:
        """Whether the segment reads a range of the base file."""
        return self is not Codec.RAW

    @property
    def same_length(self) -> bool:
        """Whether the base range must be exactly as long as the segment."""
        return self not in (Codec.RAW, Codec.BSDIFF, Codec.ZSTD_BASE)

    @property
    def whole(self) -> bool:
        """Whether the segment is decoded in one piece (base range and output in memory)."""
        return self in (Codec.BSDIFF, Codec.ZSTD_BASE)

    @property
    def reads_length(self) -> bool:
        """Whether the segment reads exactly `length` bytes of its stream (one per output byte)."""
        return self in (Codec.RAW, Codec.XOR, Codec.PLANES, Codec.XOR_PLANES)


class Coder(StrEnum):
    """How a payload stream is compressed."""

    ZSTD = "zstd"  # one or more zstd frames
    BZ2 = "bz2"  # one bzip2 stream: it beats zstd on the few small values of one-byte differences


@dataclass(frozen=True)
class FileRef:
    """A file's expected content: its sha256 and size."""

    sha256: str
    size: int


@dataclass(frozen=True)
class Stream:
    """`length` bytes of the payload, compressed with `coder`, that decode to `size` bytes."""

    coder: Coder
    length: int
    size: int


@dataclass(frozen=True)
class Segment:
    """`length` bytes of a target file, rebuilt with `codec` from a base range and stream bytes.

    `base_offset` is in the base file of the same path. The segment reads the next `stream_bytes`
    decoded bytes of stream number `stream` (None for copy). `item_size` is the element size the
    codec works in (1 when the codec does not care).
    """

    name: str
    codec: Codec
    length: int
    base_offset: int
    base_length: int
    item_size: int
    stream: int | None
    stream_bytes: int


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
    streams: tuple[Stream, ...]
    targets: tuple[TargetFile, ...]

    @property
    def payload_size(self) -> int:
        """Bytes of payload: the streams, back to back."""
        return sum(s.length for s in self.streams)

    def stream_offset(self, index: int) -> int:
        """Where stream `index` starts in the payload."""
        return sum(s.length for s in self.streams[:index])


def payload_start(header_len: int) -> int:
    """Absolute offset of the payload in a patch whose compressed header is `header_len` bytes."""
    return PREFIX_BYTES + header_len


SPARSE_BLOCK_PREFIX = 8  # u32 count, u32 gap_len
GAP_ESCAPE = 255  # a gap code byte that adds 255 to the gap and does not end it


def sparse_stream_bounds(length: int, item_size: int) -> tuple[int, int]:
    """Fewest and most stream bytes a sparse segment of `length` bytes can read."""
    blocks = -(-length // BLOCK_BYTES)
    items = length // item_size
    return SPARSE_BLOCK_PREFIX * blocks, SPARSE_BLOCK_PREFIX * blocks + items * (
        1 + item_size
    ) + items // GAP_ESCAPE


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
    """The header as written into a patch file: one zstd frame (size declared) of canonical JSON."""
    raw = canonical_json(
        {
            "format": "sits-patch",
            "format_version": FORMAT_VERSION,
            "base": {p: {"sha256": r.sha256, "size": r.size} for p, r in header.base.items()},
            "streams": [{"coder": s.coder.value, "length": s.length, "size": s.size} for s in header.streams],
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
    return zstandard.ZstdCompressor(level=HEADER_LEVEL, write_content_size=True).compress(raw)


def _segment_dict(s: Segment) -> dict[str, object]:
    return {
        "name": s.name,
        "codec": s.codec.value,
        "length": s.length,
        "base_offset": s.base_offset,
        "base_length": s.base_length,
        "item_size": s.item_size,
        "stream": s.stream,
        "stream_bytes": s.stream_bytes,
    }


def read_header(path: Path) -> tuple[PatchHeader, int]:
    """Read and validate the header of the patch at `path`; return it and the compressed header length.

    Raises what read_header_from raises.
    """
    try:
        with path.open("rb") as f:
            return read_header_from(f, os.fstat(f.fileno()).st_size, path)
    except OSError as exc:
        raise FormatError(f"{path}: cannot read the patch: {exc.strerror or exc}") from exc


def read_header_from(f: BinaryIO, file_size: int, path: Path) -> tuple[PatchHeader, int]:
    """The header of the open patch `f` (`file_size` bytes), read from its start, validated.

    Reads at most MAX_HEADER_BYTES + 16 bytes whatever the file claims, and decompresses at most
    MAX_HEADER_BYTES. Raises FormatError (malformed, truncated, another format version, sizes out
    of bounds) or UnsafePathError (a file name escapes).
    """
    try:
        f.seek(0)
        prefix = f.read(PREFIX_BYTES)
        _check_magic(prefix, path)
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
    header = parse_header(decompress_header(raw, where=str(path)), where=str(path))
    expected = PREFIX_BYTES + header_len + header.payload_size + TRAILER_BYTES
    if expected != file_size:
        raise FormatError(
            f"{path}: the patch is {file_size} bytes but its header describes {expected}",
            hint="the patch is truncated or has trailing bytes; make or download it again",
        )
    return header, header_len


def _check_magic(prefix: bytes, path: Path) -> None:
    if len(prefix) < PREFIX_BYTES or not prefix.startswith(MAGIC_STEM):
        raise FormatError(f"{path}: not a sits patch (bad magic or shorter than {PREFIX_BYTES} bytes)")
    if prefix[: len(MAGIC)] != MAGIC:
        version = prefix[len(MAGIC_STEM) : len(MAGIC)].decode("ascii", "replace")
        raise FormatError(
            f"{path}: sits patch format version {version!r}; this reader knows only version {FORMAT_VERSION}",
            hint="make the patch again with the sits-deployer version that the device runs",
        )


def decompress_header(raw: bytes, *, where: str = "patch") -> bytes:
    """The JSON bytes of a compressed header: one zstd frame declaring at most MAX_HEADER_BYTES.

    The declared size is checked before anything is decompressed, and zstd refuses a frame whose
    content disagrees with it, so a hostile header cannot make the reader allocate more.
    Raises FormatError.
    """
    try:
        declared = zstandard.get_frame_parameters(raw).content_size
    except zstandard.ZstdError as exc:
        raise FormatError(f"{where}: header is not a zstd frame ({exc})") from exc
    if declared == zstandard.CONTENTSIZE_UNKNOWN:
        raise FormatError(f"{where}: header does not declare its decompressed size")
    if declared > MAX_HEADER_BYTES:
        raise FormatError(
            f"{where}: header declares {declared} bytes once decompressed; the limit is {MAX_HEADER_BYTES}"
        )
    try:
        data = zstandard.ZstdDecompressor().decompress(raw, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise FormatError(f"{where}: header does not decompress ({exc})") from exc
    if len(data) != declared:
        raise FormatError(f"{where}: header decompresses to {len(data)} bytes, not {declared}")
    return data


def parse_header(raw: bytes, *, where: str = "patch") -> PatchHeader:
    """Validate header JSON bytes into a PatchHeader. Raises FormatError or UnsafePathError."""
    if len(raw) > MAX_HEADER_BYTES:
        raise FormatError(f"{where}: header is larger than {MAX_HEADER_BYTES} bytes")
    doc = parse_json(raw, f"{where}: header")
    _keys(doc, {"format", "format_version", "base", "streams", "targets"}, where)
    if doc["format"] != "sits-patch" or doc["format_version"] != FORMAT_VERSION:
        raise FormatError(
            f"{where}: unsupported patch format {doc['format']!r} v{doc['format_version']!r}",
            hint=f"this reader knows sits-patch v{FORMAT_VERSION}; upgrade the agent",
        )
    base = _base_files(doc["base"], where)
    streams = _streams(doc["streams"], where)
    targets = doc["targets"]
    if not isinstance(targets, list) or len(targets) > MAX_FILES:
        raise FormatError(f"{where}: targets must be a list of at most {MAX_FILES} files")
    parsed = tuple(_target(t, base, streams, where) for t in targets)
    paths = [t.path for t in parsed]
    if len(set(paths)) != len(paths):
        raise FormatError(f"{where}: a target file is listed twice")
    if sum(len(t.segments) for t in parsed) > MAX_SEGMENTS:
        raise FormatError(f"{where}: more than {MAX_SEGMENTS} segments")
    _check_stream_use(streams, parsed, where)
    return PatchHeader(base, streams, parsed)


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


def _streams(doc: object, where: str) -> tuple[Stream, ...]:
    if not isinstance(doc, list) or len(doc) > MAX_STREAMS:
        raise FormatError(f"{where}: streams must be a list of at most {MAX_STREAMS}")
    streams = []
    for i, item in enumerate(doc):
        at = f"{where}: stream {i}"
        spec = _keys(item, {"coder", "length", "size"}, at)
        try:
            coder = Coder(spec["coder"])
        except ValueError:
            raise FormatError(f"{at}: unknown coder {spec['coder']!r}") from None
        streams.append(
            Stream(
                coder,
                _size(spec["length"], f"{at} length", MAX_FILE_BYTES),
                _size(spec["size"], f"{at} size", MAX_FILE_BYTES),
            )
        )
    return tuple(streams)


def _target(doc: object, base: dict[str, FileRef], streams: tuple[Stream, ...], where: str) -> TargetFile:
    spec = _keys(doc, {"path", "sha256", "size", "segments"}, f"{where}: target")
    path = check_relative_path(spec["path"], f"{where}: target")
    at = f"{where}: target {path!r}"
    size = _size(spec["size"], f"{at} size", MAX_FILE_BYTES)
    if not isinstance(spec["segments"], list):
        raise FormatError(f"{at}: segments must be a list")
    segments = tuple(
        _segment(s, base.get(path), len(streams), f"{at} segment {i}") for i, s in enumerate(spec["segments"])
    )
    if sum(s.length for s in segments) != size:
        raise FormatError(f"{at}: segments add up to {sum(s.length for s in segments)}, not {size}")
    return TargetFile(path, _sha(spec["sha256"], f"{at} sha256"), size, segments)


def _segment(doc: object, base: FileRef | None, streams: int, where: str) -> Segment:
    keys = {"name", "codec", "length", "base_offset", "base_length", "item_size", "stream", "stream_bytes"}
    spec = _keys(doc, keys, where)
    try:
        codec = Codec(spec["codec"])
    except ValueError:
        raise FormatError(f"{where}: unknown codec {spec['codec']!r}") from None
    if not isinstance(spec["name"], str) or len(spec["name"]) > 1024:
        raise FormatError(f"{where}: name must be a string of at most 1024 characters")
    stream = spec["stream"]
    if codec is Codec.COPY and stream is not None:
        raise FormatError(f"{where}: a copy segment reads no stream (stream must be null)")
    if codec is not Codec.COPY and (
        not isinstance(stream, int) or isinstance(stream, bool) or not 0 <= stream < streams
    ):
        raise FormatError(f"{where}: stream {stream!r} is not one of the {streams} streams")
    seg = Segment(
        spec["name"],
        codec,
        _size(spec["length"], f"{where} length", MAX_FILE_BYTES),
        _size(spec["base_offset"], f"{where} base_offset", MAX_FILE_BYTES),
        _size(spec["base_length"], f"{where} base_length", MAX_FILE_BYTES),
        _size(spec["item_size"], f"{where} item_size", 8),
        stream,
        _size(spec["stream_bytes"], f"{where} stream_bytes", MAX_FILE_BYTES),
    )
    _check_segment(seg, base, where)
    return seg


def _check_segment(seg: Segment, base: FileRef | None, where: str) -> None:
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
    _check_stream_bytes(seg, where)


def _check_stream_bytes(seg: Segment, where: str) -> None:
    """How many stream bytes each codec may read: exact where it is fixed, bounded otherwise."""
    if seg.codec is Codec.COPY:
        low, high = 0, 0
    elif seg.codec.reads_length:
        low, high = seg.length, seg.length
    elif seg.codec is Codec.SPARSE:
        low, high = sparse_stream_bounds(seg.length, seg.item_size)
    else:
        if max(seg.length, seg.base_length) > MAX_WHOLE_BYTES:
            raise FormatError(f"{where}: {seg.codec.value} segments are limited to {MAX_WHOLE_BYTES} bytes")
        low, high = 1, 2 * seg.length + WHOLE_OVERHEAD_BYTES
    if not low <= seg.stream_bytes <= high:
        raise FormatError(
            f"{where}: codec {seg.codec.value} reads {seg.stream_bytes} stream bytes; "
            f"a segment of {seg.length} bytes reads {low} to {high}"
        )


def _check_stream_use(streams: tuple[Stream, ...], targets: tuple[TargetFile, ...], where: str) -> None:
    """Every decoded byte of every stream is read by exactly one segment."""
    used = [0] * len(streams)
    for t in targets:
        for s in t.segments:
            if s.stream is not None:
                used[s.stream] += s.stream_bytes
    for i, (stream, n) in enumerate(zip(streams, used, strict=True)):
        if n != stream.size:
            raise FormatError(f"{where}: stream {i} decodes to {stream.size} bytes but segments read {n}")
