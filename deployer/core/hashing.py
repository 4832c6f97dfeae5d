"""SHA-256 helpers that stream, so hashing a file never holds it in memory."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

CHUNK = 1 << 20


def sha256_bytes(data: bytes | memoryview) -> str:
    """Hex sha256 of a buffer."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, *, offset: int = 0, length: int | None = None) -> str:
    """Hex sha256 of a file, or of `length` bytes starting at `offset`, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        f.seek(offset)
        remaining = length
        while remaining is None or remaining > 0:
            chunk = f.read(CHUNK if remaining is None else min(CHUNK, remaining))
            if not chunk:
                break
            digest.update(chunk)
            if remaining is not None:
                remaining -= len(chunk)
    return digest.hexdigest()


def sha256_pairs(pairs: Iterable[tuple[str, str]]) -> str:
    """A stable digest over (name, sha256) pairs, sorted by name: hashes a directory's contents."""
    digest = hashlib.sha256()
    for name, value in sorted(pairs):
        digest.update(f"{name}\0{value}\n".encode())
    return digest.hexdigest()
