"""Write and read artifact directories (docs/artifact-format.md).

The weights file is written by `WeightsWriter`: the header is computed up front from the
tensor plans, so each tensor can be quantized, written at its offset and hashed, then dropped;
memory stays at one tensor. The layout is fixed (dtype size descending, then name) and the
header JSON is canonical, so the same tensors always give the same bytes.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deployer.build.quantize import StoredTensor
from deployer.build.source import read_rows
from deployer.core.canonical import canonical_json
from deployer.core.hashing import sha256_bytes, sha256_file
from deployer.core.manifest import MANIFEST_NAME, ArtifactManifest, parse_manifest, read_manifest
from deployer.core.quant_layout import ROW_CHUNK, TORCH_DTYPES, ModuleQuant, dequantize
from deployer.core.safetensors_io import DTYPE_SIZES, TensorEntry, read_header
from deployer.errors import BuildError, FormatError

__all__ = [
    "WEIGHTS_NAME",
    "ArtifactWeights",
    "TensorRecord",
    "WeightsWriter",
    "copy_files",
    "file_records",
    "load_state_dict",
    "module_quants",
    "read_manifest",
    "write_manifest",
]

WEIGHTS_NAME = "model.safetensors"
_HEADER_ALIGN = 8


@dataclass(frozen=True)
class TensorRecord:
    """A written tensor: the manifest's `tensors` entry."""

    dtype: str
    shape: tuple[int, ...]
    sha256: str

    def to_json(self) -> dict[str, Any]:
        """Manifest form."""
        return {"file": WEIGHTS_NAME, "dtype": self.dtype, "shape": list(self.shape), "sha256": self.sha256}


class WeightsWriter:
    """Writes one safetensors file whose tensors are known in advance and arrive in any order."""

    def __init__(self, path: Path, tensors: Iterable[StoredTensor]) -> None:
        layout = sorted(tensors, key=lambda t: (-DTYPE_SIZES[t.dtype], t.name))
        self._expected = {t.name: t for t in layout}
        if len(self._expected) != len(layout):
            raise BuildError(f"{path}: two stored tensors share a name")
        header, offsets, size = _header(layout)
        self._offsets = offsets
        self.records: dict[str, TensorRecord] = {}
        self.path = path
        self.size = len(header) + size
        self._file = path.open("wb")
        self._file.write(header)
        self._data_start = len(header)
        self._file.truncate(self.size)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one tensor at its place and record its sha256."""
        spec = self._expected.get(name)
        if spec is None or name in self.records:
            raise BuildError(f"internal: unexpected or repeated tensor {name!r} for {self.path}")
        if tensor.dtype != TORCH_DTYPES[spec.dtype] or tuple(tensor.shape) != spec.shape:
            raise BuildError(f"internal: {name} is {tensor.dtype}{list(tensor.shape)}, planned {spec}")
        data = tensor.contiguous().view(torch.uint8).numpy().data.cast("B")
        self._file.seek(self._data_start + self._offsets[name])
        self._file.write(data)
        self.records[name] = TensorRecord(spec.dtype, spec.shape, sha256_bytes(data))

    def close(self) -> None:
        """Flush to disk; every planned tensor must have been written."""
        missing = sorted(set(self._expected) - set(self.records))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if missing:
            raise BuildError(f"internal: {self.path} is missing tensors {missing[:5]}")

    def abort(self) -> None:
        """Close without checks (the caller removes the partial file)."""
        self._file.close()


def _header(layout: list[StoredTensor]) -> tuple[bytes, dict[str, int], int]:
    """Canonical header bytes (space-padded to 8), each tensor's data offset, and data size."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offsets: dict[str, int] = {}
    cursor = 0
    for t in layout:
        length = DTYPE_SIZES[t.dtype]
        for dim in t.shape:
            length *= dim
        offsets[t.name] = cursor
        entries[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [cursor, cursor + length],
        }
        cursor += length
    raw = json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _HEADER_ALIGN)
    return len(raw).to_bytes(8, "little") + raw, offsets, cursor


def copy_files(source_dir: Path, names: Iterable[str], dest_dir: Path) -> None:
    """Copy the config and tokenizer files byte for byte (no metadata, so no timestamps matter)."""
    for name in names:
        shutil.copyfile(source_dir / name, dest_dir / name)


def file_records(artifact_dir: Path) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file in the artifact except the manifest."""
    records = {}
    for path in sorted(artifact_dir.iterdir()):
        if path.name == MANIFEST_NAME:
            continue
        if not path.is_file() or path.is_symlink():
            raise BuildError(f"{path}: artifacts hold plain files only")
        records[path.name] = {"sha256": sha256_file(path), "size": path.stat().st_size}
    return records


def write_manifest(artifact_dir: Path, manifest: dict[str, Any]) -> str:
    """Validate and write the canonical manifest; returns the artifact id (its sha256)."""
    data = canonical_json(manifest)
    parsed = parse_manifest(data, f"{artifact_dir / MANIFEST_NAME} (being written)")
    if canonical_json(parsed.to_json()) != data:
        raise BuildError("internal: the manifest does not round-trip through its schema")
    path = artifact_dir / MANIFEST_NAME
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return sha256_bytes(data)


def module_quants(manifest: ArtifactManifest) -> dict[str, ModuleQuant]:
    """The manifest's per-module records as the quantizer's dataclasses."""
    return {
        module: ModuleQuant(info.scheme, info.group_size, info.in_features, info.in_padded, info.out)
        for module, info in manifest.quantization.modules.items()
    }


def load_state_dict(
    artifact_dir: Path, modules: Mapping[str, ModuleQuant] | None = None
) -> dict[str, torch.Tensor]:
    """The artifact's weights dequantized to fp32, keyed by the source checkpoint's names.

    `modules` defaults to the artifact's manifest. For the quality gate and tests: it
    materializes the whole model in fp32.
    """
    from safetensors.torch import load_file

    if modules is None:
        modules = module_quants(read_manifest(artifact_dir))
    stored = load_file(str(artifact_dir / WEIGHTS_NAME))
    state: dict[str, torch.Tensor] = {}
    companions: set[str] = set()
    for module, quant in modules.items():
        name = f"{module}.weight"
        state[name] = dequantize(name, quant, stored)
        companions.update((f"{name}_scale", f"{name}_zero"))
    for name, tensor in stored.items():
        if name not in state and name not in companions:
            state[name] = tensor.float()
    return state


class ArtifactWeights:
    """A safetensors artifact's weights dequantized to fp32 under the source checkpoint's names,
    a tensor or a block of rows at a time (the quality gate's `Weights`): the peak is one fp32
    tensor, and a dequantization's temporaries are bounded to ROW_CHUNK rows."""

    def __init__(self, artifact_dir: Path, modules: Mapping[str, ModuleQuant]) -> None:
        self._path = artifact_dir / WEIGHTS_NAME
        try:
            self._stored = read_header(self._path).by_name()
        except FormatError as exc:
            raise BuildError(exc.message, hint=exc.hint) from exc
        self._modules = modules

    def tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors in fp32."""
        return {name: self._whole(name) for name in names}

    def row_blocks(self, name: str, rows: int) -> Iterator[torch.Tensor]:
        """The tensor `name`, `rows` rows at a time, in fp32."""
        entry = self._entry(name)
        module = name.removesuffix(".weight")
        quant = self._modules.get(module) if name.endswith(".weight") else None
        parts = [n for n in (name, f"{name}_scale", f"{name}_zero") if n in self._stored]
        for start in range(0, entry.shape[0], rows):
            stored = {n: read_rows(self._path, self._stored[n], start, start + rows) for n in parts}
            yield dequantize(name, quant, stored)

    def _whole(self, name: str) -> torch.Tensor:
        rows = self._entry(name).shape[0]
        out: torch.Tensor | None = None
        blocks = self.row_blocks(name, ROW_CHUNK)
        for start, block in zip(range(0, rows, ROW_CHUNK), blocks, strict=True):
            if out is None:  # dequantized rows are wider than packed int4 ones: sized by the first block
                out = torch.empty((rows, *block.shape[1:]))
            out[start : start + len(block)] = block
        if out is None:
            raise BuildError(f"internal: {self._path}: tensor {name!r} is empty")
        return out

    def _entry(self, name: str) -> TensorEntry:
        entry = self._stored.get(name)
        if entry is None:
            raise BuildError(f"internal: {self._path} has no tensor {name!r}")
        return entry
