"""The local content-addressed store (`.sits/store/` next to deploy.yaml) and its build cache.

    .sits/store/
      artifacts/<artifact id>/      finished artifacts; the id is the sha256 of the manifest
      cache/<build key>.json        {"artifact_id": ...}: what these inputs built last time
      tmp/build-<pid>-<random>/     a build in progress; renamed into artifacts/ when complete

Nothing appears under artifacts/ until it is whole: a build writes into tmp/ and renames.
Leftovers of killed builds (their pid is gone) are removed when the next build starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from deployer.core.canonical import canonical_json
from deployer.core.fsutil import atomic_write, fsync_dir
from deployer.core.hashing import sha256_bytes, sha256_file
from deployer.core.manifest import MANIFEST_NAME, read_manifest
from deployer.errors import BuildError, FormatError

STORE_DIRNAME = Path(".sits") / "store"


def build_key(inputs: dict[str, Any]) -> str:
    """The cache key: sha256 of the canonical JSON of everything that shapes the artifact."""
    return sha256_bytes(canonical_json(inputs))


class Store:
    """A content-addressed artifact store rooted at `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.artifacts = root / "artifacts"
        self.cache = root / "cache"
        self.tmp = root / "tmp"

    def artifact_dir(self, artifact_id: str) -> Path:
        """Where the artifact with this id lives (whether or not it exists)."""
        return self.artifacts / artifact_id

    def lookup(self, key: str) -> str | None:
        """The artifact id cached for `key`, if that artifact is still present and intact."""
        entry = self.cache / f"{key}.json"
        try:
            artifact_id = json.loads(entry.read_text())["artifact_id"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return artifact_id if self._intact(artifact_id) else None

    def _intact(self, artifact_id: str) -> bool:
        """Cheap check: the manifest hashes to the id and every listed file has its size."""
        directory = self.artifact_dir(artifact_id)
        manifest_path = directory / MANIFEST_NAME
        if not manifest_path.is_file() or sha256_file(manifest_path) != artifact_id:
            return False
        try:
            manifest = read_manifest(directory)
        except FormatError:
            return False
        return all(
            (directory / name).is_file() and (directory / name).stat().st_size == info.size
            for name, info in manifest.files.items()
        )

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """A fresh build directory under tmp/, removed afterwards unless it was committed."""
        self._sweep()
        path = Path(tempfile.mkdtemp(prefix=f"build-{os.getpid()}-", dir=self._mkdir(self.tmp)))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def commit(self, staged: Path, artifact_id: str) -> Path:
        """Move a finished build into artifacts/<id> (an identical one may already be there)."""
        dest = self.artifact_dir(artifact_id)
        self._mkdir(self.artifacts)
        if self._intact(artifact_id):
            return dest
        if dest.exists():
            shutil.rmtree(dest)
        try:
            staged.rename(dest)
        except OSError as exc:
            raise BuildError(f"{dest}: cannot move the artifact into the store ({exc})") from exc
        fsync_dir(self.artifacts)
        return dest

    def remember(self, key: str, artifact_id: str) -> None:
        """Record that `key` built `artifact_id` (atomically: temp file, fsync, rename)."""
        self._mkdir(self.cache)
        atomic_write(self.cache / f"{key}.json", canonical_json({"artifact_id": artifact_id}))

    def _mkdir(self, path: Path) -> Path:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BuildError(f"{path}: cannot create the store directory ({exc.strerror or exc})") from exc
        return path

    def _sweep(self) -> None:
        """Remove build directories whose process is gone (a killed or crashed build)."""
        if not self.tmp.is_dir():
            return
        for path in self.tmp.iterdir():
            pid = _pid_of(path.name)
            if pid is not None and not _alive(pid):
                shutil.rmtree(path, ignore_errors=True)


def _pid_of(name: str) -> int | None:
    parts = name.split("-")
    if len(parts) >= 3 and parts[0] == "build" and parts[1].isdigit():
        return int(parts[1])
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
