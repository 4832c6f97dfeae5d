"""Read an HF-layout source model: config, tokenizer files and (possibly sharded) safetensors.

Every safetensors header is validated by `deployer.core.safetensors_io.read_header` before a byte
of tensor data is read, so truncated files and lying headers fail here, naming the file.
Tensors are then read one at a time (memory-mapped), never the whole model.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deployer.core.architectures import SUPPORTED_ARCHITECTURES
from deployer.core.fsutil import read_json_object
from deployer.core.hashing import sha256_file, sha256_pairs
from deployer.core.safetensors_io import SafetensorsHeader, TensorEntry, read_header
from deployer.errors import FormatError, SourceModelError

BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = ("smollm2-135m-instruct",)
SOURCE_DTYPES = ("F32", "F16", "BF16")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
OPTIONAL_FILES = ("generation_config.json", "special_tokens_map.json")
# Buffers some older checkpoints store; they are recomputed from the config at load time.
DROPPED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class SourceTensor:
    """Where one source tensor lives."""

    name: str
    entry: TensorEntry
    path: Path


@dataclass(frozen=True)
class SourceModel:
    """A validated source directory: its config, tensors (sorted by name) and the files to copy."""

    path: Path
    config: dict[str, Any]
    architecture: str
    tensors: tuple[SourceTensor, ...]
    copy_files: tuple[str, ...]
    weight_files: tuple[str, ...]

    @property
    def tied_embeddings(self) -> bool:
        """True when the output head shares the embedding matrix."""
        return bool(self.config.get("tie_word_embeddings", False))

    def input_files(self) -> tuple[str, ...]:
        """Every file the build reads, relative to `path`, sorted."""
        index = (INDEX_FILE,) if (self.path / INDEX_FILE).is_file() else ()
        return tuple(sorted(self.copy_files + self.weight_files + index))


def resolve_source(ref: str, base_dir: Path) -> Path:
    """Turn deploy.yaml's `model.source` into a directory: a path (relative to `base_dir`) or
    "builtin:smollm2-135m-instruct", which is prepared once and cached."""
    if ref.startswith(BUILTIN_PREFIX):
        name = ref[len(BUILTIN_PREFIX) :]
        if name not in BUILTIN_MODELS:
            raise SourceModelError(
                f"model.source: unknown builtin model {name!r}",
                hint=f"builtin models: {', '.join(BUILTIN_MODELS)}",
            )
        from deployer.build.demo_model import prepare_smollm2

        return prepare_smollm2()
    path = Path(ref).expanduser()
    return path if path.is_absolute() else (base_dir / path)


def open_source(path: Path, *, shapes: bool = True) -> SourceModel:
    """Validate `path` as an HF-layout model and index its tensors. Raises SourceModelError.

    `shapes=False` leaves out `check_shapes`, which imports torch and transformers (seconds on a
    small device or a loaded machine): for a build-cache lookup, since a hit was built from
    byte-identical files that passed it; a miss checks before it builds."""
    if not path.is_dir():
        raise SourceModelError(
            f"{path}: source model directory not found",
            hint="set model.source to an HF-layout directory or builtin:smollm2-135m-instruct",
        )
    for name in REQUIRED_FILES:
        if not (path / name).is_file():
            raise SourceModelError(f"{path}: missing {name}", hint="export the model with its tokenizer")
    config = _read_json(path / "config.json")
    architecture = _architecture(path, config)
    weight_map = _weight_map(path)
    weight_files = tuple(sorted(set(weight_map.values()))) if weight_map else (SINGLE_FILE,)
    _check_files(path, weight_files)
    tensors = _index_tensors(path, weight_files, weight_map)
    optional = tuple(n for n in OPTIONAL_FILES if (path / n).is_file())
    source = SourceModel(
        path=path,
        config=config,
        architecture=architecture,
        tensors=tensors,
        copy_files=REQUIRED_FILES + optional,
        weight_files=weight_files,
    )
    if shapes:
        check_shapes(source)
    return source


def source_sha256(source: SourceModel) -> str:
    """sha256 over the sorted (path, file sha256) pairs of every file the build reads."""
    return sha256_pairs((name, sha256_file(source.path / name)) for name in source.input_files())


def iter_tensors(source: SourceModel) -> Iterator[tuple[SourceTensor, Any]]:
    """Yield (tensor, torch.Tensor) one at a time in name order (see `read_rows`)."""
    for tensor in source.tensors:
        yield tensor, read_rows(tensor.path, tensor.entry)


def read_rows(path: Path, entry: TensorEntry, start: int = 0, stop: int | None = None) -> Any:
    """Rows `start`..`stop` (along the first dimension; all of them by default) of the tensor
    `entry` of the safetensors file `path`, as a torch tensor of the stored dtype.

    Read with plain reads at the validated offset, not memory-mapped: a mapping would leave the
    pages of the whole file resident, and peak memory should be what is asked for. Raises
    SourceModelError naming the file and the tensor when the file ends early.
    """
    import torch

    from deployer.core.quant_layout import TORCH_DTYPES

    rows = entry.shape[0] if entry.shape else 1
    stop = rows if stop is None else min(stop, rows)
    row_bytes = entry.length // rows if rows else 0
    buffer = bytearray(row_bytes * (stop - start))
    try:
        with path.open("rb") as f:
            f.seek(entry.offset + start * row_bytes)
            if f.readinto(buffer) != len(buffer):
                raise SourceModelError(
                    f"{path}: truncated inside tensor {entry.name!r}",
                    hint="the file is shorter than its header says: copy or download it again",
                )
    except OSError as exc:
        raise SourceModelError(f"{path}: cannot read tensor {entry.name!r} ({exc.strerror or exc})") from exc
    dtype = TORCH_DTYPES[entry.dtype]
    flat = torch.frombuffer(buffer, dtype=dtype) if buffer else torch.empty(0, dtype=dtype)
    return flat.reshape((stop - start, *entry.shape[1:]) if entry.shape else ())


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, SourceModelError)


def _architecture(path: Path, config: dict[str, Any]) -> str:
    names = config.get("architectures") or []
    arch = names[0] if isinstance(names, list) and names else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise SourceModelError(
            f"{path / 'config.json'}: architecture {arch!r} is not supported",
            hint=f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} (Llama, Qwen2, Mistral, SmolLM)",
        )
    return arch


def _weight_map(path: Path) -> dict[str, str] | None:
    """The sharded checkpoint's index (tensor name -> shard file), or None for a single file."""
    index_path = path / INDEX_FILE
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise SourceModelError(f"{index_path}: has no weight_map")
        return {str(name): str(file) for name, file in weight_map.items()}
    if (path / SINGLE_FILE).is_file():
        return None
    raise SourceModelError(
        f"{path}: no {SINGLE_FILE} and no {INDEX_FILE}",
        hint="the source must hold its weights in safetensors",
    )


def _check_files(path: Path, weight_files: tuple[str, ...]) -> None:
    for name in weight_files:
        if "/" in name or name.startswith(".") or not (path / name).is_file():
            raise SourceModelError(
                f"{path}: weight file {name!r} is missing or outside the model",
                hint=f"{INDEX_FILE} names it: copy or download every shard",
            )


def _index_tensors(
    path: Path, weight_files: tuple[str, ...], weight_map: dict[str, str] | None
) -> tuple[SourceTensor, ...]:
    found: dict[str, SourceTensor] = {}
    for name in weight_files:
        header = _header(path / name)
        for entry in header.tensors:
            if entry.name.endswith(DROPPED_SUFFIXES):
                continue
            if entry.dtype not in SOURCE_DTYPES:
                raise SourceModelError(
                    f"{header.path}: tensor {entry.name!r} has dtype {entry.dtype}, which cannot "
                    "be quantized",
                    hint=f"source weights must be one of {', '.join(SOURCE_DTYPES)}",
                )
            if entry.name in found:
                raise SourceModelError(f"{path}: tensor {entry.name!r} appears in two shards")
            found[entry.name] = SourceTensor(entry.name, entry, header.path)
    if not found:
        raise SourceModelError(f"{path}: the safetensors files hold no tensors")
    for name, file in (weight_map or {}).items():
        if not name.endswith(DROPPED_SUFFIXES) and (name not in found or found[name].path.name != file):
            raise SourceModelError(
                f"{path / INDEX_FILE}: names tensor {name!r} in {file}, which does not hold it",
                hint="the index and the shards must come from the same export: download them again",
            )
    return tuple(found[n] for n in sorted(found))


def check_shapes(source: SourceModel) -> None:
    """Every tensor the config's architecture needs is there, in the shape it needs: the
    architecture's `transformers` modules, built on the meta device (no memory), say which.
    Raises SourceModelError."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path, config, tensors = source.path, source.config, source.tensors

    try:
        hf_config = AutoConfig.from_pretrained(path)
    except (ValueError, OSError, KeyError) as exc:
        raise SourceModelError(f"{path / 'config.json'}: not a usable transformers config ({exc})") from exc
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    by_name = {t.name: t for t in tensors}
    tied = bool(config.get("tie_word_embeddings", False))
    for name, param in skeleton.state_dict().items():
        tensor = by_name.get(name)
        if tensor is None:
            if tied and name == "lm_head.weight":
                continue  # the head is the embedding
            raise SourceModelError(
                f"{path}: the checkpoint has no tensor {name!r}, which its config.json "
                f"({config.get('model_type')}, {config.get('num_hidden_layers')} layers) needs",
                hint="the weights and config.json must come from the same model",
            )
        if tuple(tensor.entry.shape) != tuple(param.shape):
            raise SourceModelError(
                f"{tensor.path}: tensor {name!r} has shape {list(tensor.entry.shape)}, but "
                f"config.json says {list(param.shape)}",
                hint="the weights and config.json must come from the same model",
            )


def _header(path: Path) -> SafetensorsHeader:
    try:
        return read_header(path)
    except FormatError as exc:
        raise SourceModelError(exc.message, hint=exc.hint or "re-export the source model") from exc
