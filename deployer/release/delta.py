"""Make a sits patch from two artifact directories (controller side).

Tensor-aware: safetensors and GGUF files are split into their header and their tensors. A tensor
whose bytes are unchanged becomes a `copy` segment (runs of them merge into one); a changed tensor
is encoded with whichever codec comes out smallest: XOR, byte planes of the zigzagged integer
difference, gap-coded positions and differences of the changed elements, plain replacement, and
(when its size changed and it is small) bsdiff4 or zstd with the base as dictionary. Tensors up to
FULL_TRIAL_BYTES are tried with every codec; larger ones pick their codec on an evenly spaced
sample. Other files go whole through bsdiff4, zstd with the base as dictionary, or plain
replacement, whichever is smallest.

The codecs' output goes into at most three solid streams ("lanes"), so hundreds of small changed
tensors share one entropy coder instead of paying a frame each: segments that feed little data
(small tensors, sparse changes, configs) go to zstd at a high level; larger differences of one-byte
elements (int8, packed int4) to bzip2 where it wins; the rest to zstd at a fast level. The format,
and the rules in full, are in docs/patch-format.md; deployer.core.patch_apply is the inverse.
"""

from __future__ import annotations

import bz2
import hashlib
import mmap
import struct
import tempfile
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import bsdiff4
import numpy as np
import zstandard

from deployer.core.fsutil import atomic_open
from deployer.core.gguf_io import GGUFHeader, read_gguf_header
from deployer.core.hashing import CHUNK, sha256_file
from deployer.core.patch_apply import UINT_BY_SIZE, inside, zigzag
from deployer.core.patch_format import (
    BLOCK_BYTES,
    GAP_ESCAPE,
    MAGIC,
    MAX_WHOLE_BYTES,
    Codec,
    Coder,
    FileRef,
    PatchHeader,
    Segment,
    Stream,
    TargetFile,
    encode_header,
    list_files,
)
from deployer.core.safetensors_io import SafetensorsHeader, read_header
from deployer.errors import SitsError

# Byte planes are close to their order-0 entropy at low zstd levels; higher ones only add time,
# except on small segments (safetensors headers, configs, small tensors), which get SMALL_LEVEL.
ZSTD_LEVEL = 3
SMALL_LEVEL = 19
# Segments that feed at most this many bytes to their stream (small tensors, sparse changes) go to
# the SMALL_LEVEL lane.
SMALL_STREAM_BYTES = 64 * 1024
# Levels above 19 use windows larger than ZSTD_MAX_WINDOW, which readers refuse.
MAX_ZSTD_LEVEL = 19
# Differences of one-byte elements are a few small values: zstd's Huffman stage cannot spend less
# than a bit on a byte, bzip2's run-length and move-to-front stages can. It is tried on such data
# when zstd shrinks it at least this many times (and not on floats, where it is slow and no better).
BZ2_MIN_RATIO = 2
BZ2_LEVEL = 9
_ITEM_CODECS = (Codec.PLANES, Codec.XOR_PLANES, Codec.SPARSE)
FULL_TRIAL_BYTES = 8 * 1024 * 1024
WHOLE_TENSOR_BYTES = 64 * 1024
WHOLE_FILE_BYTES = 16 * 1024 * 1024
SAMPLE_WINDOWS = 8
SAMPLE_WINDOW_BYTES = 256 * 1024
# Sparse feeds a gap byte besides the value of each changed element: past half of them changed it
# feeds more than planes does and does not win.
SPARSE_MAX_FRACTION = 0.5


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


class _Mapped:
    """A file mapped read-only as uint8 (`data`), whose pages a pass hands back when done with a range.

    A pass touches every page of both artifacts; left mapped, they all count in the process's RSS
    (4 GB for a pair of 2 GB artifacts, 10 GB at 8B) although they are only page cache. Dropping a
    range (MADV_DONTNEED) unmaps it from this process alone: a later read faults it back in from
    the page cache, so it is safe while another thread reads a neighbouring range.
    """

    def __init__(self, path: Path) -> None:
        self._mm: mmap.mmap | None = None
        self.data = np.zeros(0, dtype=np.uint8)
        if path.stat().st_size:
            with path.open("rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self.data = np.frombuffer(self._mm, dtype=np.uint8)

    def release(self, view: np.ndarray) -> None:
        """Drop the pages under `view` if it is a range of this file (copies are left alone)."""
        start = view.ctypes.data - self.data.ctypes.data
        if self._mm is None or not view.nbytes or not 0 <= start < len(self.data):
            return
        aligned = start - start % mmap.PAGESIZE
        self._mm.madvise(mmap.MADV_DONTNEED, aligned, min(start + view.nbytes, len(self.data)) - aligned)


@dataclass(frozen=True)
class _Job:
    """One segment to encode: `new` bytes of the target, `old` bytes of the base (or None), and the
    mapped files they are ranges of."""

    name: str
    new: np.ndarray
    old: np.ndarray | None
    base_offset: int
    item_size: int
    tensor: bool
    files: tuple[_Mapped, ...] = field(default=(), compare=False)

    def release(self, start: int = 0, end: int | None = None) -> None:
        """Hand this job's pages of the mapped files back, bytes [start, end) of it (see _Mapped)."""
        for f in self.files:
            for view in (self.new, self.old):
                if view is not None:
                    f.release(view[start:end])


@dataclass(frozen=True)
class _Lane:
    """A payload stream as the writer fills it: its coder and level."""

    coder: Coder
    level: int


@dataclass(frozen=True)
class _Choice:
    """How one job is encoded, and the lane of the stream it goes to (None for copy);
    `blob` keeps a whole (bsdiff, zstd_base) blob."""

    codec: Codec
    lane: _Lane | None
    blob: bytes = b""


@dataclass(frozen=True)
class _Options:
    """How to encode: the fast zstd lane and the codecs allowed."""

    fast: _Lane
    allowed: frozenset[Codec]


_STRONG = _Lane(Coder.ZSTD, SMALL_LEVEL)
_BZ2 = _Lane(Coder.BZ2, BZ2_LEVEL)


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

    `codecs` limits the codecs tried for changed segments (raw when none of them applies);
    for tests and ablations. `level` is the zstd level of large tensors; `workers` choose codecs
    and fill the payload streams in parallel.

    Raises UnsafePathError (symlinks or odd names in a directory), FormatError (a safetensors
    file that lies about its layout) and SitsError (I/O failures).
    """
    base_files, target_files = list_files(base_dir), list_files(target_dir)
    plans = [
        _plan_file(rel, base_dir if rel in base_files else None, target_dir) for rel in sorted(target_files)
    ]
    opts = _Options(_Lane(Coder.ZSTD, level), frozenset(codecs) if codecs is not None else frozenset(Codec))
    jobs = [job for plan in plans for job in plan.jobs]
    with (
        tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp,
        ThreadPoolExecutor(max_workers=workers) as pool,
    ):
        choices = list(pool.map(lambda j: _chosen(j, opts), jobs))
        lanes = list(dict.fromkeys(c.lane for c in choices if c.lane is not None))
        paths = [Path(tmp) / f"stream{i}" for i in range(len(lanes))]
        filled = list(pool.map(lambda i: _fill_stream(paths[i], lanes[i], jobs, choices), range(len(lanes))))
        segments = [
            _segment(i, job, choice, lanes, filled)
            for i, (job, choice) in enumerate(zip(jobs, choices, strict=True))
        ]
        targets = _targets(plans, segments)
        streams = tuple(
            Stream(lane.coder, f.length, sum(f.sizes.values())) for lane, f in zip(lanes, filled, strict=True)
        )
        header = PatchHeader(_base_refs(base_dir, targets), streams, targets)
        digest = _write_patch(out, encode_header(header), paths)
    counts = Counter(s.codec.value for t in targets for s in t.segments)
    return PatchSummary(
        out,
        out.stat().st_size,
        digest,
        sum(t.size for t in targets),
        len(targets),
        sum(counts.values()),
        dict(sorted(counts.items())),
    )


def _targets(plans: list[_FilePlan], segments: list[Segment]) -> tuple[TargetFile, ...]:
    """Each file's segments (one per job, in job order), with unchanged runs merged."""
    rest = iter(segments)
    return tuple(
        TargetFile(plan.path, plan.sha256, plan.size, _merge_copies([next(rest) for _ in plan.jobs]))
        for plan in plans
    )


def _base_refs(base_dir: Path, targets: tuple[TargetFile, ...]) -> dict[str, FileRef]:
    """Hash and size of every base file that some segment reads."""
    used = sorted({t.path for t in targets if any(s.codec.uses_base for s in t.segments)})
    return {rel: FileRef(sha256_file(base_dir / rel), (base_dir / rel).stat().st_size) for rel in used}


@dataclass(frozen=True)
class _FilePlan:
    path: str
    sha256: str
    size: int
    jobs: tuple[_Job, ...]


def _plan_file(rel: str, base_dir: Path | None, target_dir: Path) -> _FilePlan:
    new_path = inside(target_dir, rel)
    files = [_Mapped(new_path)]
    new = files[0].data
    old_path = inside(base_dir, rel) if base_dir is not None else None
    if old_path is not None:
        files.append(_Mapped(old_path))
    old = files[1].data if old_path is not None else None
    tables = _tensor_tables(old_path, new_path) if old_path is not None else None
    if tables is not None and old is not None:
        jobs: tuple[_Job, ...] = tuple(_tensor_jobs(*tables, old, new))
    else:
        jobs = (_Job("<file>", new, old, 0, 1, tensor=False),)
    jobs = tuple(replace(job, files=tuple(files)) for job in jobs)
    return _FilePlan(rel, sha256_file(new_path), len(new), jobs)


TensorTable = SafetensorsHeader | GGUFHeader
_TABLE_READERS: dict[str, Callable[[Path], TensorTable]] = {
    ".safetensors": read_header,
    ".gguf": read_gguf_header,
}


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
    """The header, diffed against the base file's header; padding, against the same bytes of the base
    (identical when the layout is, so it joins the copies around it)."""
    if start == 0:
        return _Job("<header>", new[:end], old[:old_data], 0, 1, tensor=False)
    return _Job("<gap>", new[start:end], old[start:end] if end <= len(old) else None, start, 1, tensor=False)


def _chosen(job: _Job, opts: _Options) -> _Choice:
    """_choose, then the job's pages handed back: the next pass maps them again as it reads."""
    try:
        return _choose(job, opts)
    finally:
        job.release()


def _choose(job: _Job, opts: _Options) -> _Choice:
    """The smallest codec for one job (see the module docstring), and the lane of its stream."""
    old, new = job.old, job.new
    if old is not None and len(old) == len(new) and _equal(job):
        return _Choice(Codec.COPY, None)
    codecs = [c for c in _candidates(job) if c in opts.allowed] or [Codec.RAW]
    # Whole-piece codecs make their blob now: their jobs are small, so never sampled.
    blobs = {c: _WHOLE[c](job) for c in codecs if c.whole}
    best, lane = codecs[0], opts.fast if job.tensor and len(new) > SMALL_STREAM_BYTES else _STRONG
    if len(codecs) > 1:
        trial = _sample(job) if job.tensor and len(new) > FULL_TRIAL_BYTES else job
        # Tensors rank their codecs at the fast level: the order rarely changes, the time does.
        judge = opts.fast if job.tensor else _STRONG
        tries = {
            c: _Trial(len(blobs[c]), len(blobs[c])) if c.whole else _try(trial, c, judge) for c in codecs
        }
        best = min(tries, key=lambda c: tries[c].size)
        volume = tries[best].volume * len(new) // max(len(trial.new), 1)
        if job.tensor and volume <= SMALL_STREAM_BYTES:
            lane = _STRONG
        elif job.tensor and not best.whole and _bz2_wins(best, trial, tries[best]):
            lane = _BZ2
    if best.whole:  # compressed already: the fast lane passes it through
        return _Choice(best, opts.fast, blobs[best])
    return _Choice(best, lane)


def _equal(job: _Job) -> bool:
    """Whether the job's base and target bytes are the same, compared a block at a time:
    np.array_equal on a whole tensor allocates a bool per byte (600 MB for a 3B model's embedding)."""
    return all(np.array_equal(old, new) for old, new in _blocks(job))


@dataclass(frozen=True)
class _Trial:
    """A codec tried on a job: its compressed size, and the stream bytes it fed the compressor."""

    size: int
    volume: int


def _bz2_wins(codec: Codec, trial: _Job, zstd: _Trial) -> bool:
    """Whether bzip2 beats the fast zstd level on differences of one-byte elements."""
    if trial.item_size != 1 or zstd.volume < BZ2_MIN_RATIO * zstd.size:
        return False
    return _try(trial, codec, _BZ2).size < zstd.size


def _try(job: _Job, codec: Codec, lane: _Lane) -> _Trial:
    comp = _compressor(lane, len(job.new))
    size = volume = 0
    for chunk in _STREAMS[codec](job):
        volume += len(chunk)
        size += len(comp.compress(chunk))
    return _Trial(size + len(comp.flush()), volume)


def _candidates(job: _Job) -> list[Codec]:
    old, new = job.old, job.new
    codecs = [Codec.RAW]
    if old is None:
        return codecs
    if job.tensor and len(old) == len(new):
        # No bsdiff: on bytes that did not move, its diff stage is the planes codec.
        # Byte planes of one-byte elements are the elements: xor_planes would repeat xor.
        codecs += [Codec.XOR, Codec.PLANES] + ([Codec.XOR_PLANES] if job.item_size > 1 else [])
        sample = _sample(job) if len(new) > FULL_TRIAL_BYTES else job
        if _changed_fraction(sample) <= SPARSE_MAX_FRACTION:
            codecs.append(Codec.SPARSE)
    elif max(len(old), len(new)) <= min(
        WHOLE_TENSOR_BYTES if job.tensor else WHOLE_FILE_BYTES, MAX_WHOLE_BYTES
    ):
        codecs += [Codec.BSDIFF, Codec.ZSTD_BASE]
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


def _bsdiff(job: _Job) -> bytes:
    assert job.old is not None
    return bsdiff4.diff(job.old.tobytes(), job.new.tobytes())


def _zstd_base(job: _Job) -> bytes:
    """`zstd --patch-from`: one frame, the base range as its dictionary, its size declared."""
    assert job.old is not None
    base = zstandard.ZstdCompressionDict(job.old.tobytes(), dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    # A window over base and target lets matches reach back into the whole base range.
    params = zstandard.ZstdCompressionParameters.from_level(
        SMALL_LEVEL, source_size=len(job.old) + len(job.new), write_content_size=1
    )
    return zstandard.ZstdCompressor(compression_params=params, dict_data=base).compress(job.new.tobytes())


_WHOLE: dict[Codec, Callable[[_Job], bytes]] = {Codec.BSDIFF: _bsdiff, Codec.ZSTD_BASE: _zstd_base}


def _payload(choice: _Choice, job: _Job) -> Iterator[bytes]:
    """The bytes a segment reads from its stream."""
    if choice.codec.whole:
        yield choice.blob
    else:
        yield from _STREAMS[choice.codec](job)


def _compressor(lane: _Lane, size: int = 0) -> bz2.BZ2Compressor | zstandard.ZstdCompressionObj:
    """A compressor for `lane`; `size` (about the input's; 0 when unknown) lets zstd size its
    tables to small inputs."""
    if lane.coder is Coder.BZ2:
        return bz2.BZ2Compressor(lane.level)
    params = zstandard.ZstdCompressionParameters.from_level(min(lane.level, MAX_ZSTD_LEVEL), source_size=size)
    return zstandard.ZstdCompressor(compression_params=params).compressobj()


@dataclass(frozen=True)
class _Filled:
    """A payload stream written to `path`: its compressed length and what each job put in it."""

    path: Path
    length: int
    sizes: dict[int, int]


def _fill_stream(path: Path, lane: _Lane, jobs: list[_Job], choices: list[_Choice]) -> _Filled:
    """Compress, in job order, the bytes of every job routed to `lane` into one stream."""
    comp = _compressor(lane)
    sizes: dict[int, int] = {}
    with path.open("wb") as f:
        for i, (job, choice) in enumerate(zip(jobs, choices, strict=True)):
            if choice.lane != lane:
                continue
            sizes[i] = 0
            for chunk in _payload(choice, job):
                sizes[i] += len(chunk)
                f.write(comp.compress(chunk))
            job.release()
        f.write(comp.flush())
        return _Filled(path, f.tell(), sizes)


def _segment(i: int, job: _Job, choice: _Choice, lanes: list[_Lane], filled: list[_Filled]) -> Segment:
    uses_base = choice.codec.uses_base and job.old is not None
    stream = lanes.index(choice.lane) if choice.lane is not None else None
    return Segment(
        job.name,
        choice.codec,
        len(job.new),
        job.base_offset if uses_base else 0,
        len(job.old) if uses_base and job.old is not None else 0,
        job.item_size if choice.codec in _ITEM_CODECS else 1,
        stream,
        filled[stream].sizes[i] if stream is not None else 0,
    )


def _merge_copies(segments: list[Segment]) -> tuple[Segment, ...]:
    """Adjacent copies of adjacent base ranges become one copy: unchanged runs cost one entry."""
    merged: list[Segment] = []
    for seg in segments:
        prev = merged[-1] if merged else None
        if (
            prev is not None
            and prev.codec is seg.codec is Codec.COPY
            and prev.base_offset + prev.base_length == seg.base_offset
        ):
            length = prev.length + seg.length
            merged[-1] = replace(prev, name="<copy>", length=length, base_length=length)
        else:
            merged.append(seg)
    return tuple(merged)


def _blocks(job: _Job) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The job's base and target bytes a block at a time, each block's pages handed back once the
    consumer asks for the next: a pass over a tensor holds a block of it, not all of it."""
    assert job.old is not None
    for start in range(0, len(job.new), BLOCK_BYTES):
        yield job.old[start : start + BLOCK_BYTES], job.new[start : start + BLOCK_BYTES]
        job.release(start, start + BLOCK_BYTES)


def _raw_stream(job: _Job) -> Iterator[bytes]:
    for start in range(0, len(job.new), CHUNK):
        yield job.new[start : start + CHUNK].tobytes()
        job.release(start, start + CHUNK)


def _xor_stream(job: _Job) -> Iterator[bytes]:
    for old, new in _blocks(job):
        yield np.bitwise_xor(old, new).tobytes()


def _planes_stream(job: _Job) -> Iterator[bytes]:
    k = job.item_size
    kind = UINT_BY_SIZE[k]
    for old, new in _blocks(job):
        diff = np.asarray(new).view(kind) - np.asarray(old).view(kind)
        yield _planes(zigzag(diff, k).view(np.uint8), k)


def _xor_planes_stream(job: _Job) -> Iterator[bytes]:
    for old, new in _blocks(job):
        yield _planes(np.bitwise_xor(old, new), job.item_size)


def _planes(data: np.ndarray, k: int) -> bytes:
    """Byte j of every k-byte element, for j = 0..k-1: similar bytes end up next to each other."""
    return data.reshape(-1, k).T.tobytes()


def _sparse_stream(job: _Job) -> Iterator[bytes]:
    k = job.item_size
    kind = UINT_BY_SIZE[k]
    for old, new in _blocks(job):
        old_items, new_items = np.asarray(old).view(kind), np.asarray(new).view(kind)
        positions = np.flatnonzero(old_items != new_items)
        codes = _gap_codes(np.diff(positions, prepend=-1) - 1)
        yield struct.pack("<II", len(positions), len(codes))
        yield codes.tobytes()
        yield _planes(zigzag(new_items[positions] - old_items[positions], k).view(np.uint8), k)


def _gap_codes(gaps: np.ndarray) -> np.ndarray:
    """Each gap g as g // 255 escape bytes (255) and a final byte g % 255: small gaps, one byte."""
    escapes = gaps // GAP_ESCAPE
    codes = np.full(int(escapes.sum()) + len(gaps), GAP_ESCAPE, dtype=np.uint8)
    codes[np.cumsum(escapes + 1) - 1] = gaps % GAP_ESCAPE
    return codes


_STREAMS: dict[Codec, Callable[[_Job], Iterator[bytes]]] = {
    Codec.RAW: _raw_stream,
    Codec.XOR: _xor_stream,
    Codec.PLANES: _planes_stream,
    Codec.XOR_PLANES: _xor_planes_stream,
    Codec.SPARSE: _sparse_stream,
}


def _write_patch(out: Path, header: bytes, streams: list[Path]) -> str:
    """Prefix, header, the streams and the trailing sha256, written durably to `out`. Returns the sha."""
    digest = hashlib.sha256()
    try:
        with atomic_open(out) as f:
            for part in (MAGIC, struct.pack("<Q", len(header)), header):
                digest.update(part)
                f.write(part)
            for path in streams:
                with path.open("rb") as sf:
                    while chunk := sf.read(CHUNK):
                        digest.update(chunk)
                        f.write(chunk)
            f.write(digest.digest())
    except OSError as exc:
        raise SitsError(f"{out}: cannot write the patch: {exc.strerror or exc}") from exc
    return digest.hexdigest()
