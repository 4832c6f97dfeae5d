"""Durable file operations: the one way this project writes a file that must survive a power cut.

`atomic_write` puts the new content in a temp file beside the target, fsyncs it, renames it over the
target and fsyncs the directory, so a reader sees the old file or the new one, never a torn one, and
the rename itself is on disk when the call returns. Temp names carry TEMP_MARK so a store can sweep
what a crash left behind.

`read_regular` is the careful read of a small file someone else may have replaced: a named pipe
would block the reader forever (holding whatever lock it holds), a device or a huge file would
fill its memory.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from deployer.errors import FormatError, SitsError

__all__ = [
    "TEMP_MARK",
    "atomic_open",
    "atomic_write",
    "fsync_dir",
    "fsync_file",
    "read_json_object",
    "read_regular",
]

TEMP_MARK = ".tmp-"


def fsync_dir(path: Path) -> None:
    """fsync a directory so that renames and new entries in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """fsync a file that was written through another handle (or by another process)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: Path, *, mode: int | None = None) -> Iterator[IO[bytes]]:
    """A binary file that replaces `path` durably when the block ends without an exception (and
    vanishes when it raises). `mode` sets the permission bits before the rename. Raises OSError."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}{TEMP_MARK}", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            tmp.chmod(mode)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write(
    path: Path,
    data: bytes | str,
    *,
    mode: int | None = None,
    error: type[SitsError] | None = None,
    hint: str | None = None,
) -> None:
    """Replace `path` with `data` (str is written as UTF-8) durably. Raises OSError, or `error`
    ("<path>: cannot write: <reason>", with `hint`) when the caller names one."""
    try:
        with atomic_open(path, mode=mode) as f:
            f.write(data.encode() if isinstance(data, str) else data)
    except OSError as exc:
        if error is None:
            raise
        raise error(f"{path}: cannot write: {exc.strerror or exc}", hint=hint) from exc


def read_json_object(path: Path, error: type[SitsError] = FormatError) -> dict[str, Any]:
    """The JSON object in `path`; `error` (a SitsError subclass) when it is missing or malformed."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror or exc})") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object")
    return data


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of `path` (a symlink to one counts), refusing anything that is not a regular file
    or holds more than `limit` bytes. Raises OSError, whose strerror says which.

    Opened non-blocking, so a named pipe without a writer fails here instead of hanging the open;
    fstat on the opened file, so what was checked is what is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a named pipe" if stat.S_ISFIFO(mode) else "a device, socket or directory"
            raise OSError(errno.EINVAL, f"not a regular file (it is {kind})", str(path))
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
    return data
