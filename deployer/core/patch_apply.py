"""Apply a sits patch to a base directory, streamed, into a staging directory the caller gives.

Order: header validated (patch_format) -> whole-patch checksum -> every base file's size and sha256
-> each target file rebuilt block by block into a temp file, fsynced, its sha256 compared with the
header's, then renamed into place. Memory stays at a few BLOCK_BYTES blocks (bsdiff segments, which
the header caps, are decoded whole). On any failure every file this call wrote is removed.
Only the standard library, numpy, zstandard and bsdiff4 are used: the device agent imports this.
"""

from __future__ import annotations

import bz2
import contextlib
import hashlib
import os
import stat
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import bsdiff4.core
import numpy as np
import zstandard

from deployer.core.hashing import CHUNK, sha256_file
from deployer.core.patch_format import (
    BLOCK_BYTES,
    TRAILER_BYTES,
    Codec,
    PatchHeader,
    Segment,
    TargetFile,
    payload_start,
    read_header,
)
from deployer.errors import (
    BaseMismatchError,
    FormatError,
    HashMismatchError,
    SitsError,
    UnsafePathError,
)

# Little-endian unsigned integers of each item size: safetensors data is little-endian.
UINT_BY_SIZE = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}


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


def apply_patch(patch: Path, base_dir: Path, out_dir: Path) -> AppliedPatch:
    """Rebuild the target artifact from `base_dir` and `patch` into the existing dir `out_dir`.

    Raises FormatError (malformed or truncated patch), HashMismatchError (corrupt patch or an
    output that does not match), BaseMismatchError (base files differ from those the patch was
    made for), UnsafePathError (names escaping a directory, symlinks). Writes nothing outside
    `out_dir`; on failure removes what it wrote.
    """
    header, header_len = read_header(patch)
    check_patch_checksum(patch)
    check_base(header, base_dir)
    _check_dir(out_dir, "output directory")
    written: list[Path] = []
    try:
        with patch.open("rb") as pf:
            files = tuple(
                _write_target(t, pf, payload_start(header_len), base_dir, out_dir, written)
                for t in header.targets
            )
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    return AppliedPatch(files)


def check_patch_checksum(patch: Path) -> None:
    """Compare the patch's trailing sha256 with its contents. Raises HashMismatchError."""
    size = patch.stat().st_size
    actual = sha256_file(patch, length=size - TRAILER_BYTES)
    with patch.open("rb") as f:
        f.seek(size - TRAILER_BYTES)
        declared = f.read(TRAILER_BYTES).hex()
    if actual != declared:
        raise HashMismatchError(
            f"{patch}: checksum mismatch (the patch is corrupt or was altered)",
            hint="make or download the patch again",
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


def _write_target(
    target: TargetFile,
    pf: BinaryIO,
    payload_at: int,
    base_dir: Path,
    out_dir: Path,
    written: list[Path],
) -> AppliedFile:
    dest = _output_path(out_dir, target.path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
    tmp = Path(tmp_name)
    written.append(tmp)
    digest = hashlib.sha256()
    with os.fdopen(fd, "wb") as out, _open_base(base_dir, target) as base:
        for seg in target.segments:
            for block in _decode_segment(seg, pf, payload_at, base, target.path):
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
    seg: Segment, pf: BinaryIO, payload_at: int, base: BinaryIO | None, where: str
) -> Iterator[bytes]:
    at = f"{where} [{seg.name}]"
    blob = _Region(pf, payload_at + seg.blob_offset, seg.blob_length)
    if seg.codec is Codec.BSDIFF:
        yield _bsdiff_apply(_read_base(base, seg.base_offset, seg.base_length), blob, seg, at)
        return
    stream = None
    if seg.codec is not Codec.COPY:
        stream = zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True)
    for start in range(0, seg.length, BLOCK_BYTES):
        n = min(BLOCK_BYTES, seg.length - start)
        old = _read_base(base, seg.base_offset + start, n) if seg.codec.uses_base else b""
        yield _decode_block(seg, old, stream, n, at)
    if stream is not None and _read_exact(stream, 1, at, allow_short=True):
        raise FormatError(f"{at}: payload decodes to more bytes than the segment holds")


def _decode_block(seg: Segment, old: bytes, stream: BinaryIO | None, n: int, at: str) -> bytes:
    if seg.codec is Codec.COPY:
        return old
    assert stream is not None
    if seg.codec is Codec.RAW_ZSTD:
        return _read_exact(stream, n, at)
    if seg.codec is Codec.XOR_ZSTD:
        return np.bitwise_xor(_u8(old), _u8(_read_exact(stream, n, at))).tobytes()
    if seg.codec is Codec.SPARSE_ZSTD:
        return _sparse_block(seg.item_size, old, stream, at)
    k = seg.item_size
    # Byte plane j holds byte j of every element: undo the split, then undo the difference.
    joined = np.ascontiguousarray(_u8(_read_exact(stream, n, at)).reshape(k, n // k).T)
    if seg.codec is Codec.XOR_PLANES_ZSTD:
        return np.bitwise_xor(_u8(old), joined.reshape(-1)).tobytes()
    kind = UINT_BY_SIZE[k]
    return (np.frombuffer(old, dtype=kind) + joined.view(kind).reshape(-1)).tobytes()


def _sparse_block(k: int, old: bytes, stream: BinaryIO, at: str) -> bytes:
    items = len(old) // k
    (count,) = struct.unpack("<I", _read_exact(stream, 4, at))
    if count > items:
        raise FormatError(f"{at}: sparse block claims {count} changes in {items} elements")
    positions = np.frombuffer(_read_exact(stream, 4 * count, at), dtype="<u4")
    values = _u8(_read_exact(stream, k * count, at)).reshape(count, k)
    if count and (positions[-1] >= items or np.any(np.diff(positions.astype(np.int64)) <= 0)):
        raise FormatError(f"{at}: sparse positions are out of range or not increasing")
    out = _u8(old).copy().reshape(items, k)
    out[positions] = values
    return out.tobytes()


def _bsdiff_apply(old: bytes, blob: _Region, seg: Segment, at: str) -> bytes:
    """bsdiff4's patch, with every length checked before anything is decompressed or allocated."""
    raw = _read_exact(blob, seg.blob_length, at)
    if len(raw) < 32 or raw[:8] != b"BSDIFF40":
        raise FormatError(f"{at}: bsdiff payload has no BSDIFF40 header")
    len_control, len_diff, len_dst = (bsdiff4.core.decode_int64(raw[i : i + 8]) for i in (8, 16, 24))
    if len_dst != seg.length or min(len_control, len_diff) < 0 or (32 + len_control + len_diff > len(raw)):
        raise FormatError(f"{at}: bsdiff header disagrees with the segment ({len_dst} bytes)")
    blocks = (raw[32 : 32 + len_control], raw[32 + len_control : 32 + len_control + len_diff])
    control = _bunzip(blocks[0], 24 * (seg.length + 1), at)
    diff = _bunzip(blocks[1], seg.length, at)
    extra = _bunzip(raw[32 + len_control + len_diff :], seg.length, at)
    if len(control) % 24:
        raise FormatError(f"{at}: bsdiff control block is malformed")
    try:
        return bsdiff4.core.patch(old, len_dst, control, diff, extra)
    except (ValueError, MemoryError) as exc:
        raise FormatError(f"{at}: bsdiff payload does not apply ({exc})") from exc


def _bunzip(data: bytes, limit: int, at: str) -> bytes:
    dec = bz2.BZ2Decompressor()
    try:
        out = dec.decompress(data, max_length=limit + 1)
    except OSError as exc:
        raise FormatError(f"{at}: bsdiff block is not valid bzip2 ({exc})") from exc
    if len(out) > limit or not dec.eof:
        raise FormatError(f"{at}: bsdiff block is larger than the segment allows, or truncated")
    return out


def _read_base(base: BinaryIO | None, offset: int, n: int) -> bytes:
    assert base is not None
    base.seek(offset)
    data = base.read(n)
    if len(data) != n:
        raise BaseMismatchError(f"{base.name}: base file is shorter than the patch expects")
    return data


def _read_exact(stream: BinaryIO, n: int, at: str, *, allow_short: bool = False) -> bytes:
    parts: list[bytes] = []
    got = 0
    try:
        while got < n:
            chunk = stream.read(n - got)
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
    except zstandard.ZstdError as exc:
        raise FormatError(f"{at}: payload is not valid zstd ({exc})") from exc
    if got < n and not allow_short:
        raise FormatError(f"{at}: payload decodes to fewer bytes than the segment holds")
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _u8(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


class _Region:
    """A read-only window [start, start+length) of an open file, for the zstd stream reader."""

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
