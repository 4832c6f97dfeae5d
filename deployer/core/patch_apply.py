"""Apply a sits patch to a base directory, streamed, into a staging directory the caller gives.

The patch is opened once (`open_patch`) and everything reads that one open file: its length, its
sha256 (for the signed release) and trailing checksum in one pass, the header, the payload. A
writer of the upload directory who swaps the file afterwards changes nothing we read.

Order: header validated (patch_format) -> whole-patch checksum -> the header's target files
against what the caller expects (the signed release: same names, sizes and sha256) and its
`before_write` check (disk space) -> every base file's size and sha256 -> each target file rebuilt
block by block into a temp file, never past its declared size, fsynced, its sha256 compared with
the header's, then renamed into place -> every payload stream read to its exact end. The payload
streams are decoded side by side, each segment taking its bytes from its own stream.

Memory stays bounded whatever the patch says: a few BLOCK_BYTES blocks, one decoder per stream,
and for a bsdiff or zstd_base segment (at most MAX_WHOLE_BYTES, header-checked) its stream bytes
plus, for zstd_base, its base range. bsdiff's control, diff and extra blocks are decompressed
incrementally, each never past what the segment still needs. On any failure every file this call
wrote is removed. Only the standard library, numpy and zstandard are used: the device agent
imports this.
"""

from __future__ import annotations

import bz2
import contextlib
import hashlib
import os
import stat
import struct
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, cast

import numpy as np
import zstandard

from deployer.core.hashing import CHUNK, sha256_file
from deployer.core.patch_format import (
    BLOCK_BYTES,
    GAP_ESCAPE,
    SPARSE_BLOCK_PREFIX,
    TRAILER_BYTES,
    ZSTD_MAX_WINDOW,
    Codec,
    Coder,
    FileRef,
    PatchHeader,
    Segment,
    Stream,
    TargetFile,
    payload_start,
    read_header_from,
)
from deployer.errors import (
    BaseMismatchError,
    FormatError,
    HashMismatchError,
    SitsError,
    UnsafePathError,
)

# Stream bytes come as one bytearray per read (filled in place); the rest takes any of these.
Data = bytes | bytearray | memoryview

# Little-endian integers of each item size: safetensors data is little-endian.
UINT_BY_SIZE = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}
_INT_BY_SIZE = {1: "<i1", 2: "<i2", 4: "<i4", 8: "<i8"}


@dataclass(frozen=True)
class AppliedFile:
    """One file written into the staging directory, verified against the patch header."""

    path: str
    sha256: str
    size: int


@dataclass(frozen=True)
class AppliedPatch:
    """What apply_patch wrote, in header order."""

    files: tuple[AppliedFile, ...]


@dataclass
class PatchFile:
    """One open patch file: what is hashed is what is applied."""

    file: BinaryIO
    path: Path
    size: int
    _digests: tuple[str, str] | None = field(default=None, repr=False)

    def sha256(self) -> str:
        """sha256 of the whole file (what a release signs), computed once."""
        return self._hash()[0]

    def check_checksum(self) -> None:
        """Compare the trailing sha256 with the bytes before it. Raises HashMismatchError."""
        if self.size < TRAILER_BYTES or self._hash()[1] != self._trailer():
            raise HashMismatchError(
                f"{self.path}: checksum mismatch (the patch is corrupt or was altered)",
                hint="make or download the patch again",
            )

    def _hash(self) -> tuple[str, str]:
        """(sha256 of everything, sha256 of everything but the trailer), in one read."""
        if self._digests is None:
            whole, body = hashlib.sha256(), hashlib.sha256()
            body_end = max(self.size - TRAILER_BYTES, 0)
            self.file.seek(0)
            pos = 0
            while chunk := self.file.read(CHUNK):
                whole.update(chunk)
                if pos < body_end:
                    body.update(chunk[: body_end - pos])
                pos += len(chunk)
            if pos != self.size:
                raise FormatError(f"{self.path}: changed size while it was read")
            self._digests = whole.hexdigest(), body.hexdigest()
        return self._digests

    def _trailer(self) -> str:
        self.file.seek(self.size - TRAILER_BYTES)
        return self.file.read(TRAILER_BYTES).hex()


@contextlib.contextmanager
def open_patch(path: Path) -> Iterator[PatchFile]:
    """Open the patch at `path` once, refusing symlinks and anything but a regular file.

    Raises FormatError (cannot read) or UnsafePathError.
    """
    try:
        # Non-blocking: a named pipe without a writer would block the open itself, before fstat
        # can refuse it, while the caller holds the store lock. Reads of a regular file ignore it.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: the last component is a symlink
            raise UnsafePathError(f"{path}: the patch is a symlink; refusing to follow it") from exc
        raise FormatError(f"{path}: cannot read the patch: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise UnsafePathError(f"{path}: the patch is not a regular file")
        yield PatchFile(f, path, info.st_size)


# What a caller expects of the target files: {path: (sha256, size)}, e.g. the signed release's.
Expected = Mapping[str, FileRef]


def apply_patch(
    patch: Path,
    base_dir: Path,
    out_dir: Path,
    *,
    expect: Expected | None = None,
    before_write: Callable[[PatchHeader], None] | None = None,
) -> AppliedPatch:
    """Rebuild the target artifact from `base_dir` and `patch` into the existing dir `out_dir`.

    Raises what apply_open_patch raises.
    """
    with open_patch(patch) as pf:
        return apply_open_patch(pf, base_dir, out_dir, expect=expect, before_write=before_write)


def apply_open_patch(
    pf: PatchFile,
    base_dir: Path,
    out_dir: Path,
    *,
    expect: Expected | None = None,
    before_write: Callable[[PatchHeader], None] | None = None,
) -> AppliedPatch:
    """Rebuild the target artifact from `base_dir` and the open patch `pf` into `out_dir`.

    `expect` (the signed file list) must match the header's targets exactly before anything is
    written; `before_write` sees the validated header first (e.g. to check disk space).
    Raises FormatError (malformed or truncated patch, targets other than expected),
    HashMismatchError (corrupt patch or an output that does not match), BaseMismatchError (base
    files differ from those the patch was made for), UnsafePathError (names escaping a directory,
    symlinks). Writes nothing outside `out_dir`; on failure removes what it wrote.
    """
    header, header_len = read_header_from(pf.file, pf.size, pf.path)
    pf.check_checksum()
    if expect is not None:
        check_targets(header, expect, str(pf.path))
    if before_write is not None:
        before_write(header)
    check_base(header, base_dir)
    _check_dir(out_dir, "output directory")
    written: list[Path] = []
    try:
        streams = _open_streams(header, pf.file, payload_start(header_len), str(pf.path))
        files = tuple(_write_target(t, streams, base_dir, out_dir, written) for t in header.targets)
        for stream in streams:
            stream.check_end()
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    return AppliedPatch(files)


def check_targets(header: PatchHeader, expect: Expected, where: str) -> None:
    """The header's target files are exactly `expect`: names, sizes and sha256. Raises FormatError."""
    targets = {t.path: FileRef(t.sha256, t.size) for t in header.targets}
    missing, extra = sorted(set(expect) - set(targets)), sorted(set(targets) - set(expect))
    if missing or extra:
        raise FormatError(
            f"{where}: the patch writes other files than the release lists (missing {missing}, "
            f"unexpected {extra}); nothing was written",
            hint="the patch is for another release; make it again for this one",
        )
    for name, want in sorted(expect.items()):
        got = targets[name]
        if got != want:
            raise FormatError(
                f"{where}: the patch declares {name} as {got.size} bytes, sha256 {got.sha256[:16]}...; "
                f"the release says {want.size} bytes, {want.sha256[:16]}...; nothing was written",
                hint="the patch is for another release; make it again for this one",
            )


def check_base(header: PatchHeader, base_dir: Path) -> None:
    """Check every base file the patch reads. Raises BaseMismatchError or UnsafePathError."""
    for rel, ref in header.base.items():
        path = inside(base_dir, rel, must_exist=False)
        if not path.exists():
            raise BaseMismatchError(
                f"{base_dir}: base file {rel} is missing; the patch needs it",
                hint="apply the patch to the version it was made from, or send the full artifact",
            )
        size = path.stat().st_size
        if size != ref.size or sha256_file(path) != ref.sha256:
            raise BaseMismatchError(
                f"{path}: base file differs from the one the patch was made for "
                f"(size {size}, expected {ref.size} and sha256 {ref.sha256[:16]}...)",
                hint="apply the patch to the version it was made from, or send the full artifact",
            )


def inside(root: Path, rel: str, *, must_exist: bool = True) -> Path:
    """`root / rel`, refusing symlinks on the way and anything that is not a regular file.

    `rel` has already passed check_relative_path. Raises UnsafePathError.
    """
    _check_dir(root, "directory")
    path = root
    parts = rel.split("/")
    for i, part in enumerate(parts):
        path = path / part
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            if must_exist:
                raise UnsafePathError(f"{path}: does not exist") from None
            return root.joinpath(*parts)
        last = i == len(parts) - 1
        if stat.S_ISLNK(mode) or (last and not stat.S_ISREG(mode)) or (not last and not stat.S_ISDIR(mode)):
            raise UnsafePathError(
                f"{path}: is a symlink or not a regular file; refusing to follow it",
                hint="artifact and staging directories hold only regular files",
            )
    return path


def _check_dir(path: Path, what: str) -> None:
    try:
        mode = path.lstat().st_mode
    except OSError as exc:
        raise SitsError(f"{path}: {what} is not usable: {exc.strerror or exc}") from exc
    if stat.S_ISLNK(mode) or not stat.S_ISDIR(mode):
        raise UnsafePathError(f"{path}: {what} is a symlink or not a directory")


def zigzag(diff: np.ndarray, k: int) -> np.ndarray:
    """Unsigned k-byte differences as zigzag codes: 0, -1, 1, -2, ... -> 0, 1, 2, 3, ...

    Small differences of either sign become small numbers, so their high byte planes are zero.
    """
    signed = diff.view(_INT_BY_SIZE[k])
    return ((signed << 1) ^ (signed >> (8 * k - 1))).view(UINT_BY_SIZE[k])


def unzigzag(codes: np.ndarray, k: int) -> np.ndarray:
    """The inverse of zigzag: k-byte zigzag codes back to unsigned differences."""
    return (codes >> 1) ^ (-(codes & 1).view(_INT_BY_SIZE[k])).view(UINT_BY_SIZE[k])


def _write_target(
    target: TargetFile,
    streams: list[_StreamReader],
    base_dir: Path,
    out_dir: Path,
    written: list[Path],
) -> AppliedFile:
    dest = _output_path(out_dir, target.path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
    tmp = Path(tmp_name)
    written.append(tmp)
    digest = hashlib.sha256()
    size = 0
    with os.fdopen(fd, "wb") as out, _open_base(base_dir, target) as base:
        for seg in target.segments:
            for block in _decode_segment(seg, streams, base, target.path):
                size += len(block)
                if size > target.size:  # the decoders keep to their lengths; this is the backstop
                    raise FormatError(f"{target.path}: the patch writes more than its {target.size} bytes")
                digest.update(block)
                out.write(block)
        out.flush()
        os.fsync(out.fileno())
    if digest.hexdigest() != target.sha256:
        raise HashMismatchError(
            f"{target.path}: rebuilt file has sha256 {digest.hexdigest()[:16]}..., the patch "
            f"promises {target.sha256[:16]}...; nothing was installed",
            hint="the patch or the base is corrupt; make the patch again or send the full artifact",
        )
    tmp.replace(dest)
    written.append(dest)
    return AppliedFile(target.path, target.sha256, target.size)


def _output_path(out_dir: Path, rel: str) -> Path:
    parent = out_dir
    for part in rel.split("/")[:-1]:
        parent = parent / part
        if parent.is_symlink():
            raise UnsafePathError(f"{parent}: is a symlink inside the staging directory")
        parent.mkdir(exist_ok=True)
        _check_dir(parent, "staging subdirectory")
    dest = parent / rel.split("/")[-1]
    if dest.is_symlink() or (dest.exists() and not dest.is_file()):
        raise UnsafePathError(f"{dest}: exists as a symlink or directory in the staging directory")
    return dest


@contextlib.contextmanager
def _open_base(base_dir: Path, target: TargetFile) -> Iterator[BinaryIO | None]:
    if not any(s.codec.uses_base for s in target.segments):
        yield None
        return
    with inside(base_dir, target.path).open("rb") as f:
        yield f


def _decode_segment(
    seg: Segment, streams: list[_StreamReader], base: BinaryIO | None, where: str
) -> Iterator[Data]:
    at = f"{where} [{seg.name}]"
    if seg.codec is Codec.COPY:
        for start in range(0, seg.length, BLOCK_BYTES):
            yield _read_base(base, seg.base_offset + start, min(BLOCK_BYTES, seg.length - start))
        return
    assert seg.stream is not None
    data = _Limited(streams[seg.stream], seg.stream_bytes, at)
    if seg.codec is Codec.BSDIFF:
        yield from _bsdiff_blocks(data.read_exact(seg.stream_bytes), base, seg, at)
    elif seg.codec is Codec.ZSTD_BASE:
        old = _read_base(base, seg.base_offset, seg.base_length)
        yield _zstd_base_apply(old, data.read_exact(seg.stream_bytes), seg, at)
    else:
        for start in range(0, seg.length, BLOCK_BYTES):
            n = min(BLOCK_BYTES, seg.length - start)
            old = _read_base(base, seg.base_offset + start, n) if seg.codec.uses_base else b""
            yield _decode_block(seg, old, data, n, at)
    if data.left:
        raise FormatError(
            f"{at}: the segment leaves {data.left} of its {seg.stream_bytes} stream bytes unread"
        )


def _decode_block(seg: Segment, old: bytes, data: _Limited, n: int, at: str) -> Data:
    if seg.codec is Codec.RAW:
        return data.read_exact(n)
    if seg.codec is Codec.XOR:
        return np.bitwise_xor(_u8(old), _u8(data.read_exact(n))).tobytes()
    if seg.codec is Codec.SPARSE:
        return _sparse_block(seg.item_size, old, data, at)
    k = seg.item_size
    # Byte plane j holds byte j of every element: undo the split, then undo the difference.
    joined = np.ascontiguousarray(_u8(data.read_exact(n)).reshape(k, n // k).T)
    if seg.codec is Codec.XOR_PLANES:
        return np.bitwise_xor(_u8(old), joined.reshape(-1)).tobytes()
    kind = UINT_BY_SIZE[k]
    return (np.frombuffer(old, dtype=kind) + unzigzag(joined.view(kind).reshape(-1), k)).tobytes()


def _sparse_block(k: int, old: bytes, data: _Limited, at: str) -> bytes:
    items = len(old) // k
    count, gap_len = struct.unpack("<II", data.read_exact(SPARSE_BLOCK_PREFIX))
    if count > items or gap_len > count + items // GAP_ESCAPE:
        raise FormatError(
            f"{at}: sparse block claims {count} changes in {items} elements ({gap_len} gap bytes)"
        )
    positions = sparse_positions(_u8(data.read_exact(gap_len)), count, items, at)
    kind = UINT_BY_SIZE[k]
    diff = np.ascontiguousarray(_u8(data.read_exact(k * count)).reshape(k, count).T).view(kind).reshape(-1)
    out = np.frombuffer(old, dtype=kind).copy()
    out[positions] += unzigzag(diff, k)
    return out.tobytes()


def sparse_positions(codes: np.ndarray, count: int, items: int, at: str) -> np.ndarray:
    """Element positions from gap codes: per change, GAP_ESCAPE bytes (255 each) then a byte below it.

    Raises FormatError unless there are exactly `count` gaps and every position is below `items`.
    """
    ends = np.flatnonzero(codes < GAP_ESCAPE)
    if len(ends) != count or (len(codes) and codes[-1] == GAP_ESCAPE):
        raise FormatError(f"{at}: sparse gap codes do not make {count} positions")
    # A position is every gap before it plus one per earlier change.
    positions = np.cumsum(codes, dtype=np.int64)[ends] + np.arange(count)
    if count and positions[-1] >= items:
        raise FormatError(f"{at}: sparse position {positions[-1]} is past the block's {items} elements")
    return positions


def _bsdiff_blocks(raw: Data, base: BinaryIO | None, seg: Segment, at: str) -> Iterator[bytes]:
    """bsdiff4's patch format, applied incrementally: blocks of at most BLOCK_BYTES.

    Every length is checked before it is used; the control, diff and extra blocks are bzip2
    streams fed a CHUNK at a time from views of `raw` (never copies of it) and decompressed only
    as far as the next control entry needs, so a small block that expands hugely costs time
    bounded by the segment, never memory. The base range is read from the open base file as
    entries need it.
    """
    if len(raw) < 32 or raw[:8] != b"BSDIFF40":
        raise FormatError(f"{at}: bsdiff payload has no BSDIFF40 header")
    len_control, len_diff, len_dst = (_offtin(raw[i : i + 8]) for i in (8, 16, 24))
    if len_dst != seg.length or min(len_control, len_diff) < 0 or (32 + len_control + len_diff > len(raw)):
        raise FormatError(f"{at}: bsdiff header disagrees with the segment ({len_dst} bytes)")
    view = memoryview(raw)
    control = _Bunzip(view[32 : 32 + len_control], f"{at} bsdiff control")
    diff = _Bunzip(view[32 + len_control : 32 + len_control + len_diff], f"{at} bsdiff diff")
    extra = _Bunzip(view[32 + len_control + len_diff :], f"{at} bsdiff extra")
    new_pos = old_pos = entries = 0
    out = bytearray()
    # Entries that do not move the output (x = y = 0) are allowed, as bsdiff may write them, but
    # counted: at most one entry per output byte (and one more), so a hostile block cannot spin.
    while not (new_pos == seg.length and control.at_end()):
        entries += 1
        entry = control.read_exact(24)
        x, y, z = (_offtin(entry[i : i + 8]) for i in (0, 8, 16))
        if x < 0 or y < 0 or new_pos + x + y > seg.length or entries > seg.length + 1:
            raise FormatError(f"{at}: bsdiff control entry {entries} ({x}, {y}, {z}) goes past the segment")
        for start in range(0, x, BLOCK_BYTES):
            n = min(BLOCK_BYTES, x - start)
            added = _u8(diff.read_exact(n)).copy()
            lo, hi = max(old_pos + start, 0), min(old_pos + start + n, seg.base_length)
            if lo < hi:  # bytes of the base range under this stretch are added; outside it, not
                old = _u8(_read_base(base, seg.base_offset + lo, hi - lo))
                added[lo - old_pos - start : hi - old_pos - start] += old
            out += added.tobytes()
            if len(out) >= BLOCK_BYTES:
                yield bytes(out)
                out.clear()
        for start in range(0, y, BLOCK_BYTES):
            out += extra.read_exact(min(BLOCK_BYTES, y - start))
            if len(out) >= BLOCK_BYTES:
                yield bytes(out)
                out.clear()
        new_pos, old_pos = new_pos + x + y, old_pos + x + z
    if not (diff.at_end() and extra.at_end()):
        raise FormatError(f"{at}: bsdiff diff or extra block holds more than the control block uses")
    if out:
        yield bytes(out)


def _offtin(b: Data) -> int:
    """bsdiff's signed 64-bit integer: little-endian magnitude, sign in the top bit."""
    (value,) = struct.unpack("<Q", b)
    return -(value & ~(1 << 63)) if value >> 63 else value


class _Bunzip:
    """One bzip2 block of a bsdiff payload, decompressed only as far as asked.

    The input is fed a CHUNK at a time, when the decoder asks for more: a decoder given all of it
    at once keeps its own copy of what it has not used yet, which for a whole segment doubles the
    memory the segment holds.
    """

    def __init__(self, data: memoryview, at: str) -> None:
        self._dec = bz2.BZ2Decompressor()
        self._data = data
        self._pos = 0
        self._at = at

    def read_exact(self, n: int) -> bytes:
        """Exactly `n` more bytes. Raises FormatError when the block ends first or is not bzip2."""
        parts, got = [], 0
        while got < n and (chunk := self._more(n - got)):
            parts.append(chunk)
            got += len(chunk)
        if got != n:
            raise FormatError(f"{self._at}: ends before the control block does (truncated?)")
        return b"".join(parts)

    def at_end(self) -> bool:
        """Whether the block is used up: nothing left to decompress, and nothing after it."""
        if self._more(1):
            return False
        return self._dec.eof and not self._dec.unused_data and self._pos == len(self._data)

    def _more(self, n: int) -> bytes:
        """Up to `n` more decompressed bytes; empty once the block or its input ends."""
        try:
            while not self._dec.eof:
                feed: Data = b""
                if self._dec.needs_input:
                    if self._pos == len(self._data):
                        return b""
                    feed = self._data[self._pos : self._pos + CHUNK]
                    self._pos += len(feed)
                if out := self._dec.decompress(feed, max_length=n):
                    return out
        except OSError as exc:
            raise FormatError(f"{self._at}: not valid bzip2 ({exc})") from exc
        return b""


def _zstd_base_apply(old: bytes, raw: Data, seg: Segment, at: str) -> bytes:
    """One zstd frame whose dictionary is the base range. Its declared size must be the segment's
    (at most MAX_WHOLE_BYTES) before anything is decompressed, and zstd refuses a frame whose
    content disagrees with it, so this never allocates more."""
    try:
        declared = zstandard.get_frame_parameters(raw).content_size
        if declared != seg.length:
            raise FormatError(f"{at}: zstd_base frame declares {declared} bytes, the segment {seg.length}")
        base = zstandard.ZstdCompressionDict(old, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
        dec = zstandard.ZstdDecompressor(dict_data=base, max_window_size=ZSTD_MAX_WINDOW)
        return dec.decompress(raw, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise FormatError(f"{at}: zstd_base payload does not decode ({exc})") from exc


def _read_base(base: BinaryIO | None, offset: int, n: int) -> bytes:
    assert base is not None
    base.seek(offset)
    data = base.read(n)
    if len(data) != n:
        raise BaseMismatchError(f"{base.name}: base file is shorter than the patch expects")
    return data


def _u8(data: Data) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


class _Region:
    """A read-only window [start, start+length) of an open file, for a stream decoder."""

    def __init__(self, f: BinaryIO, start: int, length: int) -> None:
        self._f, self._pos, self._end = f, start, start + length

    def read(self, n: int = -1) -> bytes:
        """Read up to `n` bytes (all that is left if n < 0), never past the window."""
        left = self._end - self._pos
        n = left if n < 0 else min(n, left, CHUNK * 4)
        if n <= 0:
            return b""
        self._f.seek(self._pos)
        data = self._f.read(n)
        self._pos += len(data)
        return data


class _StreamReader:
    """One payload stream, decoded as segments ask for it; errors become FormatError."""

    def __init__(self, stream: Stream, region: _Region, at: str) -> None:
        self.at = at
        self._region = region
        self._bz2 = bz2.BZ2Decompressor() if stream.coder is Coder.BZ2 else None
        self._zstd = (
            # zstandard only calls read() on its source, which _Region provides.
            zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW).stream_reader(
                cast(BinaryIO, region), read_across_frames=True
            )
            if stream.coder is Coder.ZSTD
            else None
        )

    def read(self, n: int) -> bytearray:
        """Up to `n` decoded bytes; fewer only at the end of the stream. Decoded at most a block at
        a time into one buffer, so a whole segment's bytes are held once (not again as the pieces
        of a join)."""
        out = bytearray(n)
        got = 0
        try:
            with memoryview(out) as view:
                while got < n and (chunk := self._read(min(n - got, BLOCK_BYTES))):
                    view[got : got + len(chunk)] = chunk
                    got += len(chunk)
        except (zstandard.ZstdError, OSError, EOFError) as exc:
            raise FormatError(f"{self.at}: payload stream is not valid ({exc})") from exc
        del out[got:]
        return out

    def check_end(self) -> None:
        """Every segment is done: the stream must end here, with nothing after it (bytes after a
        zstd stream's last frame are read as another frame, so they fail or decode to more)."""
        if self.read(1):
            raise FormatError(f"{self.at}: payload stream holds more than its segments read")
        if self._bz2 is not None and (self._bz2.unused_data or self._region.read(1)):
            raise FormatError(f"{self.at}: payload stream has bytes after its end")

    def _read(self, n: int) -> bytes:
        if self._zstd is not None:
            return self._zstd.read(n)
        assert self._bz2 is not None
        # Feed input only when the decoder asks: its output stays bounded by n.
        while not self._bz2.eof:
            data = self._region.read(CHUNK) if self._bz2.needs_input else b""
            if self._bz2.needs_input and not data:
                raise EOFError("the bzip2 stream is truncated")
            if out := self._bz2.decompress(data, max_length=n):
                return out
        return b""


def _open_streams(header: PatchHeader, pf: BinaryIO, payload_at: int, where: str) -> list[_StreamReader]:
    return [
        _StreamReader(s, _Region(pf, payload_at + header.stream_offset(i), s.length), f"{where} stream {i}")
        for i, s in enumerate(header.streams)
    ]


class _Limited:
    """The next `left` bytes of a stream: what one segment may read, and must read entirely."""

    def __init__(self, stream: _StreamReader, left: int, at: str) -> None:
        self._stream, self.left, self._at = stream, left, at

    def read_exact(self, n: int) -> bytearray:
        """Exactly `n` bytes. Raises FormatError past the segment's share or the stream's end."""
        if n > self.left:
            raise FormatError(f"{self._at}: the segment reads past its {self.left} remaining stream bytes")
        data = self._stream.read(n)
        if len(data) != n:
            raise FormatError(f"{self._at}: payload stream ends before the segment does")
        self.left -= n
        return data
