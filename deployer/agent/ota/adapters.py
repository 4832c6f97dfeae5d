"""The device's adapter store: installed LoRA adapter artifacts and which version of each is current.

Layout under the store's root (`DeviceStore.base`, i.e. ``<root>/var/lib/sits``)::

    adapters/<name>/<artifact_id>/   an adapter artifact (deployer/core/lora.py), moved in atomically
    adapters/<name>/state.json       {"current", "previous", "version", "counter"}
    adapters/<name>/loading-<artifact_id>.json
                                     {"attempts"}: loads of that artifact begun and not finished,
                                     left only by agents that died loading it (`begin_load`)

The caller verifies (signature, counter, expiry, the base it was made for) before `install`; this
module only keeps files and pointers, each change written beside the old and renamed over it, so a
crash leaves the old state or the new one. `counter` is the highest release counter installed
(anti-rollback): it never goes down, not even on `rollback` or `remove`.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployer.core.fsutil import atomic_write, fsync_dir, read_json_object
from deployer.errors import AgentError, FormatError, UnsafePathError

__all__ = ["AdapterRecord", "AdapterState", "AdapterStore", "LoadAttempts"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_ARTIFACT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


@dataclass(frozen=True)
class AdapterRecord:
    """One installed adapter version: where its artifact lies."""

    name: str
    artifact_id: str
    version: str
    path: Path


class AdapterState(BaseModel):
    """adapters/<name>/state.json."""

    model_config = ConfigDict(extra="forbid")

    current: str | None = None
    previous: str | None = None
    version: str | None = None
    previous_version: str | None = None
    counter: int = Field(default=0, ge=0)


class LoadAttempts(BaseModel):
    """adapters/<name>/loading-<artifact_id>.json: loads of that artifact begun, not finished."""

    model_config = ConfigDict(extra="forbid")

    attempts: int = Field(ge=1)


class AdapterStore:
    """The adapters under `root` (the device store's base directory). Cheap to construct."""

    def __init__(self, root: Path) -> None:
        self.dir = Path(root) / "adapters"

    def installed(self) -> dict[str, AdapterRecord]:
        """Every adapter with a current version, by name."""
        if not self.dir.is_dir():
            return {}
        records = (self.record(p.name) for p in sorted(self.dir.iterdir()) if _NAME.fullmatch(p.name))
        return {r.name: r for r in records if r is not None}

    def record(self, name: str) -> AdapterRecord | None:
        """The current version of adapter `name`, or None when it has none."""
        state = self.state(name)
        if state.current is None or state.version is None:
            return None
        return AdapterRecord(name, state.current, state.version, self._artifact_dir(name, state.current))

    def state(self, name: str) -> AdapterState:
        """adapters/<name>/state.json (empty when the adapter was never installed)."""
        path = self._name_dir(name) / "state.json"
        if not path.exists():
            return AdapterState()
        try:
            return AdapterState.model_validate(read_json_object(path))
        except ValidationError as exc:
            raise FormatError(f"{path}: not a valid adapter state: {exc.errors()[0]['msg']}") from exc

    def install(
        self, name: str, src_dir: Path, artifact_id: str, version: str, counter: int
    ) -> AdapterRecord:
        """Copy the verified artifact `src_dir` in as `name`'s current version (the current one
        becomes previous). AgentError (nothing changed) for a counter below the installed one."""
        state = self.state(name)
        if counter < state.counter:
            raise AgentError(
                f"adapter {name!r}: release counter {counter} is below the installed {state.counter}",
                hint="an adapter release is never downgraded; publish a new release",
            )
        target = self._artifact_dir(name, artifact_id)
        if not target.is_dir():
            target.parent.mkdir(parents=True, exist_ok=True)
            staged = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{artifact_id}.staging-"))
            try:
                shutil.copytree(src_dir, staged, dirs_exist_ok=True)
                fsync_dir(staged)
                staged.rename(target)
            except BaseException:
                shutil.rmtree(staged, ignore_errors=True)
                raise
            fsync_dir(target.parent)
        same = state.current == artifact_id
        self._write(
            name,
            AdapterState(
                current=artifact_id,
                previous=state.previous if same else state.current,
                version=version,
                previous_version=state.previous_version if same else state.version,
                counter=max(counter, state.counter),
            ),
        )
        return AdapterRecord(name, artifact_id, version, target)

    def rollback(self, name: str) -> AdapterRecord | None:
        """Make the previous version current again (current and previous swap); the record, or None
        when there is no previous version (nothing changed)."""
        state = self.state(name)
        if state.previous is None or state.previous_version is None:
            return None
        self._write(
            name,
            AdapterState(
                current=state.previous,
                previous=state.current,
                version=state.previous_version,
                previous_version=state.version,
                counter=state.counter,
            ),
        )
        return self.record(name)

    def remove(self, name: str) -> None:
        """Uninstall adapter `name`: no current version (its files go; its counter stays)."""
        state = self.state(name)
        self._write(name, AdapterState(counter=state.counter))
        for child in self._name_dir(name).iterdir() if self._name_dir(name).is_dir() else ():
            if child.is_dir():
                shutil.rmtree(child)

    def crashed_loads(self, name: str, artifact_id: str) -> int:
        """How many loads of `name`'s artifact `artifact_id` began and never finished: each one a
        process that died while loading it (a load that ends, loaded or refused, clears them)."""
        path = self._loading_path(name, artifact_id)
        if not path.exists():
            return 0
        try:
            return LoadAttempts.model_validate(read_json_object(path)).attempts
        except (ValidationError, FormatError):
            return 0  # not a marker we wrote (atomic_write): no crash on record, load it

    def begin_load(self, name: str, artifact_id: str) -> None:
        """Record a load of `artifact_id` as begun (durably, before the engine touches it)."""
        path = self._loading_path(name, artifact_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        marker = LoadAttempts(attempts=self.crashed_loads(name, artifact_id) + 1)
        atomic_write(path, json.dumps(marker.model_dump()) + "\n")

    def end_load(self, name: str, artifact_id: str) -> None:
        """The load of `artifact_id` ended, loaded or refused: no crash to count."""
        self._loading_path(name, artifact_id).unlink(missing_ok=True)

    def _loading_path(self, name: str, artifact_id: str) -> Path:
        # Beside the artifact, not in it: an artifact directory holds only its verified files.
        return self._artifact_dir(name, artifact_id).with_name(f"loading-{artifact_id}.json")

    def _write(self, name: str, state: AdapterState) -> None:
        directory = self._name_dir(name)
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write(directory / "state.json", json.dumps(state.model_dump(), indent=2) + "\n")

    def _name_dir(self, name: str) -> Path:
        if not _NAME.fullmatch(name):
            raise UnsafePathError(f"adapter name {name!r} is not a valid model id (it names a directory)")
        return self.dir / name

    def _artifact_dir(self, name: str, artifact_id: str) -> Path:
        if not _ARTIFACT_ID.fullmatch(artifact_id):
            raise UnsafePathError(f"adapter artifact id {artifact_id!r} cannot name a directory")
        return self._name_dir(name) / artifact_id
