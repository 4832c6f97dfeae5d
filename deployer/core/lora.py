"""LoRA adapters: the artifact a build writes and the device agent loads (issue #41).

An adapter artifact is a directory holding

* ``adapter.json``: name, version, the base artifact it was made for, rank, alpha, the user's scale
  (the effective factor is ``scale * alpha / rank``), the target modules (full module names in the
  base's HF naming) and the factors' dtype;
* ``adapter.safetensors``: for each target module M, ``M.lora_A`` [rank, in_features] and
  ``M.lora_B`` [out_features, rank], fp16;
* ``adapter.gguf`` when the base is a GGUF artifact (llama.cpp's own LoRA format).

A module's output becomes ``base(x) + factor * (x @ A.T) @ B.T``. `from_peft` reads a PEFT adapter
directory (``adapter_config.json`` + ``adapter_model.safetensors``). Reading trusts nothing: every
tensor must be present, of the declared rank, two-dimensional and finite, and every error names
the file and the tensor. Only numpy and the standard library: the device agent reads adapters too.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployer.core.fsutil import atomic_open, atomic_write, read_json_object
from deployer.core.safetensors_io import TensorEntry, read_header
from deployer.errors import FormatError

__all__ = [
    "ADAPTER_GGUF",
    "ADAPTER_JSON",
    "ADAPTER_SAFETENSORS",
    "FORMAT",
    "FORMAT_VERSION",
    "LoraAdapter",
    "from_peft",
    "read_adapter",
    "write_adapter",
]

FORMAT = "sits-lora"
FORMAT_VERSION = 1
ADAPTER_JSON = "adapter.json"
ADAPTER_SAFETENSORS = "adapter.safetensors"
ADAPTER_GGUF = "adapter.gguf"
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
# An adapter's name is its model id on the device and a directory of its store.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# Stored dtypes: the artifact is fp16; PEFT saves whatever the model it trained was in.
_NUMPY_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64}


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter: its identity, its hyper-parameters and its factors (fp16 numpy arrays).

    ``tensors[module] = (A, B)`` with A [rank, in_features] and B [out_features, rank].
    """

    name: str
    version: str
    base_artifact_id: str
    rank: int
    alpha: float
    scale: float
    target_modules: tuple[str, ...]
    tensors: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def factor(self) -> float:
        """What the low-rank product is multiplied by: scale * alpha / rank."""
        return self.scale * self.alpha / self.rank

    @property
    def nbytes(self) -> int:
        """Bytes of all factors (what loading it costs in memory, before any conversion)."""
        return sum(a.nbytes + b.nbytes for a, b in self.tensors.values())


class _AdapterJson(BaseModel):
    """adapter.json as written: the boundary where an untrusted file becomes typed."""

    model_config = ConfigDict(extra="forbid", strict=True)

    format: str = Field(pattern=f"^{FORMAT}$")
    format_version: int = Field(ge=FORMAT_VERSION, le=FORMAT_VERSION)
    name: str = Field(pattern=_NAME.pattern)
    version: str = Field(min_length=1, max_length=128)
    base_artifact_id: str = Field(min_length=1, max_length=256)
    rank: int = Field(ge=1, le=4096)
    alpha: float = Field(gt=0, allow_inf_nan=False)
    scale: float = Field(allow_inf_nan=False)
    target_modules: list[str] = Field(min_length=1)
    dtype: str = Field(pattern="^float16$")


def read_adapter(directory: Path) -> LoraAdapter:
    """Read and check the adapter artifact in `directory`. Raises FormatError naming the file
    and the tensor for a malformed adapter.json, a missing or extra tensor, a rank or dtype that
    does not match, or factors that are not finite."""
    meta_path = directory / ADAPTER_JSON
    raw = read_json_object(meta_path)
    try:
        meta = _AdapterJson.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '-'}: {e['msg']}" for e in exc.errors())
        raise FormatError(
            f"{meta_path}: not a valid adapter description: {problems}",
            hint="rebuild the adapter with sits-deployer build",
        ) from exc
    if len(set(meta.target_modules)) != len(meta.target_modules):
        raise FormatError(f"{meta_path}: target_modules lists a module twice")
    weights = directory / ADAPTER_SAFETENSORS
    names = {m: (f"{m}.lora_A", f"{m}.lora_B") for m in meta.target_modules}
    arrays = _read_arrays(weights, [n for pair in names.values() for n in pair], allowed={"F16"})
    tensors = {m: (arrays[a], arrays[b]) for m, (a, b) in names.items()}
    _check_factors(weights, tensors, meta.rank, lambda m: names[m])
    return LoraAdapter(
        name=meta.name,
        version=meta.version,
        base_artifact_id=meta.base_artifact_id,
        rank=meta.rank,
        alpha=meta.alpha,
        scale=meta.scale,
        target_modules=tuple(meta.target_modules),
        tensors=tensors,
    )


def write_adapter(adapter: LoraAdapter, directory: Path) -> None:
    """Write `adapter` as an artifact into `directory` (created if missing), fp16, byte-for-byte
    reproducible: the same adapter always gives the same files."""
    directory.mkdir(parents=True, exist_ok=True)
    meta = _AdapterJson(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        name=adapter.name,
        version=adapter.version,
        base_artifact_id=adapter.base_artifact_id,
        rank=adapter.rank,
        alpha=float(adapter.alpha),
        scale=float(adapter.scale),
        target_modules=list(adapter.target_modules),
        dtype="float16",
    )
    named: dict[str, np.ndarray] = {}
    for module in adapter.target_modules:
        a, b = adapter.tensors[module]
        named[f"{module}.lora_A"] = _to_fp16(a, directory / ADAPTER_SAFETENSORS, f"{module}.lora_A")
        named[f"{module}.lora_B"] = _to_fp16(b, directory / ADAPTER_SAFETENSORS, f"{module}.lora_B")
    with atomic_open(directory / ADAPTER_SAFETENSORS) as f:
        _write_safetensors(f, named)
    atomic_write(directory / ADAPTER_JSON, json.dumps(meta.model_dump(), indent=2, sort_keys=True) + "\n")


def from_peft(
    peft_dir: Path, name: str, version: str, base_artifact_id: str, scale: float = 1.0
) -> LoraAdapter:
    """The adapter a PEFT directory holds (``adapter_config.json`` + ``adapter_model.safetensors``),
    its factors converted to fp16. Raises FormatError naming the file (and tensor) for what this
    format cannot carry (DoRA, rsLoRA, per-module ranks, biases, extra saved modules), a rank that
    does not match, a missing tensor or factors that are not finite."""
    if not _NAME.match(name):
        raise FormatError(
            f"adapter name {name!r} is not a valid model id",
            hint="use letters, digits, '.', '_' and '-' (at most 64), starting with a letter or digit",
        )
    config_path = peft_dir / PEFT_CONFIG
    config = read_json_object(config_path)
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise FormatError(f"{config_path}: r must be a positive integer, not {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not alpha > 0:
        raise FormatError(f"{config_path}: lora_alpha must be a positive number, not {alpha!r}")
    _refuse_unsupported(config_path, config)
    weights = peft_dir / PEFT_WEIGHTS
    header = read_header(weights)
    modules: dict[str, tuple[str, str]] = {}
    for entry in header.tensors:
        match = re.fullmatch(rf"{re.escape(_PEFT_PREFIX)}(.+)\.lora_([AB])\.weight", entry.name)
        if match is None:
            raise FormatError(
                f"{weights}: tensor {entry.name!r} is not a LoRA factor",
                hint="only lora_A/lora_B weights can be carried (no biases, no modules_to_save)",
            )
        module = match.group(1)
        modules.setdefault(
            module, (f"{_PEFT_PREFIX}{module}.lora_A.weight", f"{_PEFT_PREFIX}{module}.lora_B.weight")
        )
    if not modules:
        raise FormatError(f"{weights}: holds no LoRA factors")
    wanted = [n for pair in modules.values() for n in pair]
    arrays = _read_arrays(weights, wanted, allowed=set(_NUMPY_DTYPES) | {"BF16"})
    order = sorted(modules)
    tensors = {m: (arrays[modules[m][0]], arrays[modules[m][1]]) for m in order}
    _check_factors(weights, tensors, rank, lambda m: modules[m])
    converted = {
        m: (_to_fp16(a, weights, modules[m][0]), _to_fp16(b, weights, modules[m][1]))
        for m, (a, b) in tensors.items()
    }
    return LoraAdapter(
        name=name,
        version=version,
        base_artifact_id=base_artifact_id,
        rank=rank,
        alpha=float(alpha),
        scale=float(scale),
        target_modules=tuple(order),
        tensors=converted,
    )


def _refuse_unsupported(config_path: Path, config: dict[str, Any]) -> None:
    """PEFT options that change the arithmetic beyond A, B and one factor."""
    refused = {
        "use_dora": "DoRA adapters",
        "use_rslora": "rsLoRA's alpha/sqrt(r) scaling",
        "fan_in_fan_out": "fan-in-fan-out (Conv1D) layers",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "modules_to_save": "fully trained extra modules (modules_to_save)",
    }
    for key, what in refused.items():
        if config.get(key):
            raise FormatError(
                f"{config_path}: {key} is set: {what} cannot be carried by a sits-lora adapter",
                hint=f"train the adapter without {key}, or merge it into a new base model",
            )
    if config.get("bias", "none") != "none":
        raise FormatError(
            f"{config_path}: bias is {config.get('bias')!r}: trained biases cannot be carried",
            hint="train the adapter with bias='none'",
        )


def _read_arrays(path: Path, names: list[str], *, allowed: set[str]) -> dict[str, np.ndarray]:
    """The named tensors of a safetensors file as numpy arrays; every other tensor is refused."""
    header = read_header(path)
    entries = header.by_name()
    for name in names:
        if name not in entries:
            raise FormatError(
                f"{path}: tensor {name!r} is missing", hint="the adapter is incomplete; rebuild it"
            )
    extra = sorted(set(entries) - set(names))
    if extra:
        raise FormatError(f"{path}: tensor {extra[0]!r} belongs to no target module")
    out: dict[str, np.ndarray] = {}
    with path.open("rb") as f:
        for name in names:
            entry = entries[name]
            if entry.dtype not in allowed:
                raise FormatError(
                    f"{path}: tensor {name!r} is {entry.dtype}, expected one of {', '.join(sorted(allowed))}"
                )
            f.seek(entry.offset)
            out[name] = _decode(entry, f.read(entry.length))
    return out


def _decode(entry: TensorEntry, data: bytes) -> np.ndarray:
    if entry.dtype == "BF16":
        # numpy has no bfloat16: its bits are the top half of a float32's.
        bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(entry.shape)
    return np.frombuffer(data, dtype=np.dtype(_NUMPY_DTYPES[entry.dtype]).newbyteorder("<")).reshape(
        entry.shape
    )


def _check_factors(
    path: Path,
    tensors: dict[str, tuple[np.ndarray, np.ndarray]],
    rank: int,
    names_of: Any,
) -> None:
    """Shapes agree with `rank` and each other; values are finite."""
    for module, (a, b) in tensors.items():
        name_a, name_b = names_of(module)
        if a.ndim != 2 or b.ndim != 2:
            bad = name_a if a.ndim != 2 else name_b
            raise FormatError(f"{path}: tensor {bad!r} must be two-dimensional")
        if a.shape[0] != rank:
            raise FormatError(
                f"{path}: tensor {name_a!r} has rank {a.shape[0]} (shape {list(a.shape)}), but the adapter "
                f"declares rank {rank}",
                hint="the adapter's config and its weights come from different trainings",
            )
        if b.shape[1] != rank:
            raise FormatError(
                f"{path}: tensor {name_b!r} has rank {b.shape[1]} (shape {list(b.shape)}), but the adapter "
                f"declares rank {rank}",
                hint="the adapter's config and its weights come from different trainings",
            )
        for name, array in ((name_a, a), (name_b, b)):
            if not np.isfinite(array).all():
                raise FormatError(
                    f"{path}: tensor {name!r} holds NaN or infinite values",
                    hint="the training diverged; retrain or take an earlier checkpoint",
                )


def _to_fp16(array: np.ndarray, path: Path, name: str) -> np.ndarray:
    converted = np.ascontiguousarray(array, dtype=np.float16)
    if not np.isfinite(converted).all():
        raise FormatError(
            f"{path}: tensor {name!r} does not fit in float16 (a value beyond ±65504)",
            hint="fold part of the factor into alpha or scale",
        )
    return converted


def _write_safetensors(f: Any, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors format (header length, JSON header, data), tensors in name order."""
    header: dict[str, Any] = {}
    offset = 0
    for name in sorted(tensors):
        array = tensors[name]
        header[name] = {
            "dtype": "F16",
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-aligned, as the format advises
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for name in sorted(tensors):
        f.write(tensors[name].astype("<f2", copy=False).tobytes())
