"""Make a sits patch from two artifact directories (controller side).

Tensor-aware: safetensors and GGUF files are split into their header and their tensors; a tensor whose bytes
are unchanged becomes a `copy` segment (no payload); a changed tensor is encoded with whichever
codec comes out smallest (XOR, byte planes of the integer difference, sparse positions + values,
bsdiff4 for small tensors, plain replacement; all but bsdiff4 entropy-coded with zstd). Tensors
up to FULL_TRIAL_BYTES are tried with every codec; larger ones pick their codec on an evenly spaced
sample and are then encoded once. Other files go whole through bsdiff4 (or zstd when larger).
The format is in docs/patch-format.md; deployer.core.patch_apply is the inverse.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import bsdiff4
import numpy as np
import zstandard

from deployer.core.gguf_io import GGUFHeader, read_gguf_header
from deployer.core.hashing import CHUNK, sha256_file
from deployer.core.patch_apply import UINT_BY_SIZE, inside
from deployer.core.patch_format import (
    BLOCK_BYTES,
    MAGIC,
    MAX_BSDIFF_BYTES,
    Codec,
    FileRef,
    PatchHeader,
    Segment,
    TargetFile,
    encode_header,
    list_files,
)
from deployer.core.safetensors_io import SafetensorsHeader, read_header
from deployer.errors import SitsError

# Byte planes are close to their order-0 entropy at low zstd levels; higher ones only add time.
# Non-tensor segments (safetensors headers, configs, tokenizer) are small: they get SMALL_LEVEL.
ZSTD_LEVEL = 3
SMALL_LEVEL = 19
_ITEM_CODECS = (Codec.PLANES_ZSTD, Codec.XOR_PLANES_ZSTD, Codec.SPARSE_ZSTD)
FULL_TRIAL_BYTES = 8 * 1024 * 1024
BSDIFF_TENSOR_BYTES = 64 * 1024
BSDIFF_SPARSE_BYTES = 1024 * 1024
BSDIFF_FILE_BYTES = 16 * 1024 * 1024
SAMPLE_WINDOWS = 8
SAMPLE_WINDOW_BYTES = 256 * 1024
# Sparse costs 4 bytes of position per changed element: past this fraction it cannot win.
SPARSE_MAX_FRACTION = 0.3


@dataclass(frozen=True)
class PatchSummary:
    """What create_patch wrote: sizes, and how many segments each codec encoded."""

    path: Path
    size: int
    sha256: str
    target_bytes: int
    files: int
    segments: int
    codecs: dict[str, int]


@dataclass(frozen=True)
class _Job:
    """One segment to encode: `new` bytes of the target, `old` bytes of the base (or None)."""

    name: str
    new: np.ndarray
    old: np.ndarray | None
    base_offset: int
    item_size: int
    tensor: bool


@dataclass(frozen=True)
class _Options:
    """How to encode: the zstd level and the codecs allowed."""

    level: int
    allowed: frozenset[Codec]


@dataclass(frozen=True)
class _Encoded:
    codec: Codec
    blob: bytes


def create_patch(
    base_dir: Path,
    target_dir: Path,
    out: Path,
    *,
    level: int = ZSTD_LEVEL,
    workers: int = 2,
    codecs: Collection[Codec] | None = None,
) -> PatchSummary:
    """Write a patch that turns `base_dir` into `target_dir` at `out` (atomically).

    `codecs` limits the codecs tried for changed segments (raw_zstd when none of them applies);
    for tests and ablations. `level` is the zstd level; `workers` encode tensors in parallel.

    Raises UnsafePathError (symlinks or odd names in a directory), FormatError (a safetensors
    file that lies about its layout) and SitsError (I/O failures).
    """
    base_files, target_files = list_files(base_dir), list_files(target_dir)
    plans = [
        _plan_file(rel, base_dir if rel in base_files else None, target_dir) for rel in sorted(target_files)
    ]
    fd, payload_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".payload", dir=out.parent)
    payload = Path(payload_name)
    try:
        with os.fdopen(fd, "wb") as pf, ThreadPoolExecutor(max_workers=workers) as pool:
            opts = _Options(level, frozenset(codecs) if codecs is not None else frozenset(Codec))
            targets = [_encode_file(plan, pf, pool, opts) for plan in plans]
            payload_size = pf.tell()
        used = {t.path for t in targets if any(s.codec.uses_base for s in t.segments)}
        base = {
            rel: FileRef(sha256_file(base_dir / rel), (base_dir / rel).stat().st_size) for rel in sorted(used)
        }
        header = PatchHeader(base, tuple(targets), payload_size)
        digest = _write_patch(out, encode_header(header), payload)
    finally:
        payload.unlink(missing_ok=True)
    codecs = Counter(s.codec.value for t in targets for s in t.segments)
    return PatchSummary(
        out,
        out.stat().st_size,
        digest,
        sum(t.size for t in targets),
        len(targets),
        sum(codecs.values()),
        dict(sorted(codecs.items())),
    )


@dataclass(frozen=True)
class _FilePlan:
    path: str
    sha256: str
    size: int
    jobs: tuple[_Job, ...]


def _plan_file(rel: str, base_dir: Path | None, target_dir: Path) -> _FilePlan:
    new_path = inside(target_dir, rel)
    new = _map(new_path)
    old_path = inside(base_dir, rel) if base_dir is not None else None
    old = _map(old_path) if old_path is not None else None
    tables = _tensor_tables(old_path, new_path) if old_path is not None and old is not None else None
    if tables is not None:
        jobs = tuple(_tensor_jobs(*tables, old, new))
    else:
        jobs = (_Job("<file>", new, old, 0, 1, tensor=False),)
    return _FilePlan(rel, sha256_file(new_path), len(new), jobs)


def _map(path: Path) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")


TensorTable = SafetensorsHeader | GGUFHeader
_TABLE_READERS = {".safetensors": read_header, ".gguf": read_gguf_header}


def _tensor_tables(old_path: Path, new_path: Path) -> tuple[TensorTable, TensorTable] | None:
    """Both files' validated tensor tables when they are safetensors or GGUF files, else None."""
    reader = _TABLE_READERS.get(new_path.suffix)
    if reader is None or old_path.suffix != new_path.suffix:
        return None
    return reader(old_path), reader(new_path)  # a lying header is an error, not a silent fallback


def _tensor_jobs(
    old_header: TensorTable, new_header: TensorTable, old: np.ndarray, new: np.ndarray
) -> Iterator[_Job]:
    """The target file as gaps (header, padding) and tensors, each matched to its base by name."""
    old_by_name = old_header.by_name()
    cursor = 0
    for e in new_header.tensors:
        if e.offset > cursor:
            yield _gap_job(new, old, cursor, e.offset, old_header.data_start)
        b = old_by_name.get(e.name)
        base = old[b.offset : b.offset + b.length] if b is not None else None
        item = e.itemsize if b is None or b.dtype == e.dtype else 1
        yield _Job(e.name, new[e.offset : e.offset + e.length], base, b.offset if b else 0, item, tensor=True)
        cursor = e.offset + e.length
    if cursor < len(new):
        yield _gap_job(new, old, cursor, len(new), old_header.data_start)


def _gap_job(new: np.ndarray, old: np.ndarray, start: int, end: int, old_data: int) -> _Job:
    """Header bytes and padding: diffed against the base file's header region."""
    return _Job("<header>" if start == 0 else "<gap>", new[start:end], old[:old_data], 0, 1, tensor=False)


def _encode_file(plan: _FilePlan, pf: BinaryIO, pool: ThreadPoolExecutor, opts: _Options) -> TargetFile:
    segments: list[Segment] = []
    for job, enc in zip(plan.jobs, pool.map(lambda j: _encode_job(j, opts), plan.jobs), strict=True):
        offset = pf.tell()
        pf.write(enc.blob)
        uses_base = enc.codec.uses_base and job.old is not None
        segments.append(
            Segment(
                job.name,
                enc.codec,
                len(job.new),
                job.base_offset if uses_base else 0,
                len(job.old) if uses_base and job.old is not None else 0,
                offset,
                len(enc.blob),
                job.item_size if enc.codec in _ITEM_CODECS else 1,
            )
        )
    return TargetFile(plan.path, plan.sha256, plan.size, tuple(segments))


def _encode_job(job: _Job, opts: _Options) -> _Encoded:
    """Encode one segment with the smallest codec (see the module docstring)."""
    old, new = job.old, job.new
    if old is not None and len(old) == len(new) and np.array_equal(old, new):
        return _Encoded(Codec.COPY, b"")
    codecs = [c for c in _candidates(job) if c in opts.allowed] or [Codec.RAW_ZSTD]
    level = opts.level
    if len(codecs) == 1:
        return _Encoded(codecs[0], _encode(codecs[0], job, level))
    if len(new) <= FULL_TRIAL_BYTES:
        trials = [_Encoded(c, _encode(c, job, level)) for c in codecs]
        return min(trials, key=lambda e: len(e.blob))
    sample = _sample(job)
    best = min(codecs, key=lambda c: len(_encode(c, sample, level)))
    return _Encoded(best, _encode(best, job, level))


def _candidates(job: _Job) -> list[Codec]:
    old, new = job.old, job.new
    codecs = [Codec.RAW_ZSTD]
    if old is None:
        return codecs
    size = max(len(old), len(new))
    sparse = len(old) == len(new) and _changed_fraction(
        _sample(job) if len(new) > FULL_TRIAL_BYTES else job
    ) <= (SPARSE_MAX_FRACTION)
    # bsdiff4's bzip2 stage beats zstd on sparse differences (quantized weights that barely moved).
    limit = (BSDIFF_SPARSE_BYTES if sparse else BSDIFF_TENSOR_BYTES) if job.tensor else BSDIFF_FILE_BYTES
    if size <= min(limit, MAX_BSDIFF_BYTES):
        codecs.append(Codec.BSDIFF)
    if len(old) == len(new) and job.tensor:
        codecs += [Codec.XOR_ZSTD, Codec.PLANES_ZSTD, Codec.XOR_PLANES_ZSTD]
        if sparse:
            codecs.append(Codec.SPARSE_ZSTD)
    return codecs


def _changed_fraction(job: _Job) -> float:
    assert job.old is not None
    k = job.item_size
    changed = np.any(job.old.reshape(-1, k) != job.new.reshape(-1, k), axis=1)
    return float(changed.mean()) if len(changed) else 0.0


def _sample(job: _Job) -> _Job:
    """Evenly spaced windows of the tensor, standing in for it when choosing a codec."""
    assert job.old is not None
    step = len(job.new) // SAMPLE_WINDOWS
    window = min(SAMPLE_WINDOW_BYTES, step) // 8 * 8
    starts = [i * step // 8 * 8 for i in range(SAMPLE_WINDOWS)]
    pick = np.concatenate([np.arange(s, s + window) for s in starts])
    return _Job(job.name, job.new[pick], job.old[pick], 0, job.item_size, job.tensor)


def _encode(codec: Codec, job: _Job, level: int) -> bytes:
    if codec is Codec.BSDIFF:
        assert job.old is not None
        return bsdiff4.diff(job.old.tobytes(), job.new.tobytes())
    return _zstd(_STREAMS[codec](job), level if job.tensor else SMALL_LEVEL)


def _zstd(chunks: Iterator[bytes], level: int) -> bytes:
    comp = zstandard.ZstdCompressor(level=level).compressobj()
    parts = [comp.compress(c) for c in chunks]
    parts.append(comp.flush())
    return b"".join(parts)


def _blocks(job: _Job) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    assert job.old is not None
    for start in range(0, len(job.new), BLOCK_BYTES):
        yield job.old[start : start + BLOCK_BYTES], job.new[start : start + BLOCK_BYTES]


def _raw_stream(job: _Job) -> Iterator[bytes]:
    for start in range(0, len(job.new), CHUNK):
        yield job.new[start : start + CHUNK].tobytes()


def _xor_stream(job: _Job) -> Iterator[bytes]:
    for old, new in _blocks(job):
        yield np.bitwise_xor(old, new).tobytes()


def _planes_stream(job: _Job) -> Iterator[bytes]:
    kind = UINT_BY_SIZE[job.item_size]
    for old, new in _blocks(job):
        diff = np.asarray(new).view(kind) - np.asarray(old).view(kind)
        yield _planes(diff.view(np.uint8), job.item_size)


def _xor_planes_stream(job: _Job) -> Iterator[bytes]:
    for old, new in _blocks(job):
        yield _planes(np.bitwise_xor(old, new), job.item_size)


def _planes(data: np.ndarray, k: int) -> bytes:
    """Byte j of every k-byte element, for j = 0..k-1: similar bytes end up next to each other."""
    return data.reshape(-1, k).T.tobytes()


def _sparse_stream(job: _Job) -> Iterator[bytes]:
    k = job.item_size
    for old, new in _blocks(job):
        old_items, new_items = old.reshape(-1, k), new.reshape(-1, k)
        positions = np.flatnonzero(np.any(old_items != new_items, axis=1))
        yield struct.pack("<I", len(positions))
        yield positions.astype("<u4").tobytes()
        yield new_items[positions].tobytes()


_STREAMS: dict[Codec, Callable[[_Job], Iterator[bytes]]] = {
    Codec.RAW_ZSTD: _raw_stream,
    Codec.XOR_ZSTD: _xor_stream,
    Codec.PLANES_ZSTD: _planes_stream,
    Codec.XOR_PLANES_ZSTD: _xor_planes_stream,
    Codec.SPARSE_ZSTD: _sparse_stream,
}


def _write_patch(out: Path, header: bytes, payload: Path) -> str:
    """Prefix, header, payload and trailing sha256 into a temp file, then rename. Returns the sha."""
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f, payload.open("rb") as pf:
            for part in (MAGIC, struct.pack("<Q", len(header)), header):
                digest.update(part)
                f.write(part)
            while chunk := pf.read(CHUNK):
                digest.update(chunk)
                f.write(chunk)
            trailer = digest.digest()
            f.write(trailer)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(out)
    except OSError as exc:
        raise SitsError(f"{out}: cannot write the patch: {exc.strerror or exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    return sha256_file(out)
