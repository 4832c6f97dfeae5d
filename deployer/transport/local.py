"""The transport for a device that is this machine, under a root prefix directory.

Device paths map below `root` (`/var/lib/sits/x` -> `<root>/var/lib/sits/x`), so a demo fleet is a
set of directories and a controller running on the device itself uses `root=/`. Commands run here
with `root` as the working directory and `SITS_ROOT=<root>` in their environment (and, unless set
already, SITS_KERNEL_CACHE_DIR at the machine's cache: see core/kernel_cache.py).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path, PurePosixPath

from deployer.core.hashing import sha256_file
from deployer.core.kernel_cache import KERNEL_CACHE_VARIABLE, shared_kernel_cache
from deployer.errors import TransportError, UnsafePathError
from deployer.transport.base import RetryPolicy, RunResult, Transport, copy_range

__all__ = ["LocalTransport"]


class LocalTransport(Transport):
    """Run commands and move files on this machine, with device paths under `root`."""

    def __init__(self, root: Path, *, label: str | None = None) -> None:
        self.root = root.resolve()
        self.label = label or f"local:{self.root}"
        self.retry = RetryPolicy(attempts=1)  # no connection to lose

    def path(self, remote_path: str) -> Path:
        """The local path of a device path; raises UnsafePathError for paths that leave the root."""
        device_path = PurePosixPath(remote_path)
        if not device_path.is_absolute() or ".." in device_path.parts:
            raise UnsafePathError(
                f"{self.label}: device path {remote_path!r} must be absolute and free of '..'",
                hint="use absolute device paths such as /var/lib/sits/staging/<file>",
            )
        return self.root.joinpath(*device_path.parts[1:])

    def _environment(self) -> dict[str, str]:
        """This process's environment with SITS_ROOT; agents of a local fleet share this machine,
        so they share one build of the CPU kernels rather than build one under each device root."""
        shared = {KERNEL_CACHE_VARIABLE: str(shared_kernel_cache())}
        return {**shared, **os.environ, "SITS_ROOT": str(self.root)}

    def run(self, cmd: str | Sequence[str], timeout: float = 60.0) -> RunResult:
        """Run a shell command here, in `root`, with SITS_ROOT set; see Transport.run."""
        command = cmd if isinstance(cmd, str) else shlex.join(cmd)
        try:
            done = subprocess.run(
                ["/bin/sh", "-c", command],
                cwd=self.root,
                env=self._environment(),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise TransportError(
                f"{self.label}: {command!r} did not finish within {timeout:g} s and was killed",
                hint="raise the timeout or look at what the command waits for",
            ) from exc
        except OSError as exc:
            raise TransportError(f"{self.label}: cannot run {command!r}: {exc}") from exc
        return RunResult(done.returncode, _text(done.stdout), _text(done.stderr))

    def stream(self, cmd: str, write: Callable[[str], None]) -> int:
        """See Transport.stream (in `root`, with SITS_ROOT set, as `run`)."""
        try:
            proc = subprocess.Popen(
                ["/bin/sh", "-c", cmd],
                cwd=self.root,
                env=self._environment(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        except OSError as exc:
            raise TransportError(f"{self.label}: cannot run {cmd!r}: {exc}") from exc
        with proc:
            try:
                assert proc.stdout is not None  # stdout=PIPE
                for line in proc.stdout:
                    write(_text(line))
                return proc.wait()
            finally:
                proc.kill()  # Ctrl-C, or the pipe closed early: the command does not outlive us

    def close(self) -> None:
        """Nothing to release."""

    def _size(self, remote_path: str) -> int | None:
        path = self.path(remote_path)
        return path.stat().st_size if path.is_file() else None

    def _remote_sha256(self, remote_path: str, length: int | None = None) -> str | None:
        path = self.path(remote_path)
        return sha256_file(path, length=length) if path.is_file() else None

    def _write(
        self, local_path: Path, remote_path: str, offset: int, on_bytes: Callable[[int], None]
    ) -> None:
        with self._io(remote_path), self.path(remote_path).open("r+b" if offset else "wb") as out:
            out.seek(offset)
            copy_range(local_path, self._paced(out.write), offset, on_bytes)
            out.truncate()

    def _read(self, remote_path: str, local_path: Path) -> None:
        with self._io(remote_path):
            shutil.copyfile(self.path(remote_path), local_path)

    def _rename(self, src: str, dst: str) -> None:
        with self._io(dst):
            self.path(src).replace(self.path(dst))

    def _remove(self, remote_path: str) -> None:
        self.path(remote_path).unlink(missing_ok=True)

    def _makedirs(self, remote_dir: str) -> None:
        with self._io(remote_dir):
            self.path(remote_dir).mkdir(parents=True, exist_ok=True)

    def _io(self, remote_path: str) -> AbstractContextManager[None]:
        return _device_io(self.label, remote_path)


@contextmanager
def _device_io(label: str, remote_path: str) -> Iterator[None]:
    """Turn an OSError of a file operation into a TransportError that names the device path."""
    try:
        yield
    except OSError as exc:
        raise TransportError(f"{label}: {remote_path}: {exc.strerror or exc}") from exc


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")
