"""The one small interface every transport offers: run, put, get, close (and stream, for output
that arrives while a command runs, as `logs --follow` shows it).

`put` is written once, here, on top of a few file primitives each transport supplies: upload into
`<remote>.part`, resume from the verified prefix of a partial file left by a dropped connection,
check the remote sha256, then rename into place, so the final path only ever holds verified bytes.
Raises only errors from `deployer.errors`:

- TransportError: the device cannot be reached, the connection dropped past all retries, a command
  timed out, or a remote file operation failed;
- HashMismatchError: the bytes that arrived are not the bytes that were sent;
- UnsafePathError (local transport): a remote path escapes the device's root.
"""

from __future__ import annotations

import posixpath
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from deployer.core.hashing import CHUNK, sha256_file
from deployer.core.ratelimit import Throttle
from deployer.errors import HashMismatchError, TransportError

PART_SUFFIX = ".part"
Progress = Callable[[int, int], None]  # (bytes done, bytes total)


@dataclass(frozen=True)
class RunResult:
    """What a remote command did."""

    rc: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def check(self, what: str) -> RunResult:
        """Return self when the command succeeded; raise TransportError naming `what` otherwise."""
        if self.rc != 0:
            detail = (self.stderr or self.stdout).strip()[-500:]
            raise TransportError(f"{what} failed with exit code {self.rc}: {detail or '(no output)'}")
        return self


@dataclass(frozen=True)
class PutResult:
    """What an upload did. `bytes_sent` counts file bytes written in every attempt."""

    remote_path: str
    size: int
    sha256: str
    bytes_sent: int
    resumed_from: int
    unchanged: bool  # the remote file already had this content: nothing was sent


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts and jittered exponential backoff ("full jitter") for connection errors only."""

    attempts: int = 3
    base_delay_s: float = 0.5
    max_delay_s: float = 8.0

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """The wait before each attempt: 0 for the first, then uniform in [0, min(max, base*2^k)]."""
        rng = rng or random.Random()
        for attempt in range(max(1, self.attempts)):
            cap = min(self.max_delay_s, self.base_delay_s * (2 ** (attempt - 1)))
            yield 0.0 if attempt == 0 else rng.uniform(0, cap)


class ConnectionDropped(Exception):
    """Internal: the connection went away mid-operation; the operation may be resumed after reconnecting."""


class Transport(ABC):
    """Commands and files on one device. Use as a context manager, or call `close()`."""

    label: str  # the device, for messages
    retry: RetryPolicy
    # Caps uploads (deploy.yaml's bandwidth: the device's rate and the fleet's push total).
    throttle: Throttle | None = None

    @abstractmethod
    def run(self, cmd: str | Sequence[str], timeout: float = 60.0) -> RunResult:
        """Run a shell command (a string) or an argv (quoted for the shell) and wait for it.

        A non-zero exit is a result, not an error. Raises TransportError when the device cannot be
        reached, the connection drops, or the command outlives `timeout` seconds.
        """

    @abstractmethod
    def close(self) -> None:
        """Release the connection; the transport reconnects if used again."""

    def stream(self, cmd: str, write: Callable[[str], None]) -> int:
        """Run a shell command and pass its output (stdout and stderr) to `write` as it arrives;
        return its exit status. It runs until it ends or Ctrl-C (KeyboardInterrupt, after the
        command was stopped). Raises TransportError where the transport cannot stream."""
        raise TransportError(f"{self.label}: this transport cannot stream a command's output")

    def put(
        self, local_path: Path, remote_path: str, *, resume: bool = True, progress: Progress | None = None
    ) -> PutResult:
        """Upload `local_path` to `remote_path`, verified by sha256, resuming a partial upload.

        The data goes to `<remote_path>.part`; after a dropped connection the upload reconnects and,
        when the partial file's bytes match the start of the local file, sends only the rest. The
        final name appears (atomic rename) only once the remote sha256 matches the local one. A
        remote file that already has this content is left alone (`unchanged`, nothing sent).
        """
        size = local_path.stat().st_size
        digest = sha256_file(local_path)
        if self._remote_sha256(remote_path) == digest:
            return PutResult(remote_path, size, digest, 0, 0, unchanged=True)
        self._makedirs(posixpath.dirname(remote_path) or "/")
        part = remote_path + PART_SUFFIX
        meter = _Meter(size, progress)

        def attempt() -> None:
            meter.start(self._resume_offset(local_path, part, size) if resume else 0)
            self._write(local_path, part, meter.offset, meter.add)

        self._with_reconnect(attempt, f"upload of {local_path} to {remote_path}")
        self._verify_and_promote(part, remote_path, digest)
        return PutResult(remote_path, size, digest, meter.sent, meter.offset, unchanged=False)

    def get(self, remote_path: str, local_path: Path) -> str:
        """Download a file; `local_path` appears only once its sha256 matches the remote one (returned)."""
        expected = self._remote_sha256(remote_path)
        if expected is None:
            raise TransportError(f"{self.label}: {remote_path} does not exist on the device")
        local_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = local_path.with_name(local_path.name + PART_SUFFIX)
        self._with_reconnect(lambda: self._read(remote_path, tmp), f"download of {remote_path}")
        return replace_verified(tmp, local_path, expected, self.label)

    def _with_reconnect(self, operation: Callable[[], None], what: str) -> None:
        """Run `operation`, reconnecting (with backoff) and running it again when the connection drops."""
        last: ConnectionDropped | None = None
        for delay in self.retry.delays():
            time.sleep(delay)
            try:
                operation()
                return
            except ConnectionDropped as exc:
                last = exc
                self.close()  # the next attempt reconnects
        raise TransportError(
            f"{self.label}: {what} failed after {self.retry.attempts} attempts: {last}",
            hint="check the device's network; run the same command again, an interrupted upload resumes",
        )

    def _resume_offset(self, local_path: Path, part: str, size: int) -> int:
        """Where to continue: the partial file's length if its bytes are our prefix, else 0."""
        have = self._size(part)
        if not have or have > size:
            return 0
        if self._remote_sha256(part, length=have) != sha256_file(local_path, length=have):
            return 0
        return have

    def _verify_and_promote(self, part: str, remote_path: str, digest: str) -> None:
        remote = self._remote_sha256(part)
        if remote != digest:
            self._remove(part)
            raise HashMismatchError(
                f"{self.label}: {remote_path} arrived with sha256 {remote}, expected {digest}; "
                "the partial file was removed",
                hint="run the upload again; if it keeps failing, check the device's disk",
            )
        self._rename(part, remote_path)

    def _paced(self, write: Callable[[bytes], object]) -> Callable[[bytes], object]:
        """`write` held to this transport's rate cap (itself when there is none)."""
        return write if self.throttle is None else self.throttle.writer(write)

    # File primitives each transport supplies. Connection loss inside them raises ConnectionDropped.

    @abstractmethod
    def _size(self, remote_path: str) -> int | None:
        """Size of a remote file, or None when it does not exist."""

    @abstractmethod
    def _remote_sha256(self, remote_path: str, length: int | None = None) -> str | None:
        """sha256 of a remote file (or of its first `length` bytes), or None when it does not exist."""

    @abstractmethod
    def _write(
        self, local_path: Path, remote_path: str, offset: int, on_bytes: Callable[[int], None]
    ) -> None:
        """Write local bytes from `offset` to the same offset of the remote file (truncating when 0)."""

    @abstractmethod
    def _read(self, remote_path: str, local_path: Path) -> None:
        """Copy a remote file to `local_path` (overwriting it)."""

    @abstractmethod
    def _rename(self, src: str, dst: str) -> None:
        """Atomically replace `dst` with `src`."""

    @abstractmethod
    def _remove(self, remote_path: str) -> None:
        """Delete a remote file if it exists."""

    @abstractmethod
    def _makedirs(self, remote_dir: str) -> None:
        """Create a remote directory and its parents."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class _Meter:
    """Counts bytes sent over every attempt and reports the position within the file."""

    def __init__(self, size: int, progress: Progress | None) -> None:
        self.size = size
        self.progress = progress
        self.offset = 0
        self.position = 0
        self.sent = 0

    def start(self, offset: int) -> None:
        self.offset = self.position = offset

    def add(self, n: int) -> None:
        self.sent += n
        self.position += n
        if self.progress:
            self.progress(self.position, self.size)


def copy_range(
    src: Path, dst_write: Callable[[bytes], object], offset: int, on_bytes: Callable[[int], None]
) -> None:
    """Stream `src` from `offset` into a writer in CHUNK pieces, reporting each piece's length."""
    with src.open("rb") as f:
        f.seek(offset)
        while chunk := f.read(CHUNK):
            dst_write(chunk)
            on_bytes(len(chunk))


def replace_verified(tmp: Path, final: Path, expected: str, label: str) -> str:
    """Move a downloaded temp file into place once its sha256 equals `expected`; return the digest."""
    digest = sha256_file(tmp)
    if digest != expected:
        tmp.unlink(missing_ok=True)
        raise HashMismatchError(
            f"{label}: download of {final.name} has sha256 {digest}, the device reports {expected}",
            hint="download it again; if it keeps failing the file is changing on the device",
        )
    tmp.replace(final)
    return digest
