"""Turn an artifact directory (or a plain HF-layout checkpoint) into a ready `Transformer`.

Tensors are memory-mapped straight out of the safetensors files after the shared, distrustful
header check (`deployer.core.safetensors_io`), so a float tensor already in the compute dtype is
used without a copy. The module tree is built on the meta device and every tensor assigned into
it, so peak memory stays about one model. Quantized layers come from `qlinear.build_linear`,
which records the kernel each layer runs.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deployer.agent.engines.torch.model import KV_CACHE_TYPES, ModelArgs, Transformer, args_from_config
from deployer.agent.engines.torch.qlinear import (
    KERNEL_DEQUANT,
    LinearWeights,
    OneDnnLinear,
    build_linear,
    check_shapes,
    choose_float_kernels,
)
from deployer.core.fsutil import read_json_object
from deployer.core.manifest import INTEGER_SCHEMES, MANIFEST_NAME, read_manifest
from deployer.core.memory import release_freed_heap
from deployer.core.quant_layout import TORCH_DTYPES, ModuleQuant, dequantize, quantize_int4, quantize_int8
from deployer.core.safetensors_io import TensorEntry, read_header
from deployer.errors import AgentError, FormatError

# torch's cuBLAS workspace before Hopper: 2 x 4 MiB + 8 x 16 KiB per stream.
CUBLAS_WORKSPACE = ":4096:2:16:8"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The draft model of speculative decoding (load_draft): int4 in groups of this many columns, the
# scheme that decodes fastest on a CPU (docs/torch-engine.md).
DRAFT_GROUP = 32
# Rows of the output head quantized to int8 at a time (loader._int8_head): 32 MB of an fp16
# head 4,096 wide.
HEAD_BLOCK = 4096
# Buffers some checkpoints carry that the model recomputes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class ArtifactFacts:
    """What the manifest (or, for a plain checkpoint, the directory) says about the model."""

    name: str
    version: str
    quantization: str
    modules: dict[str, ModuleQuant]


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run, and how it was put together."""

    model: Transformer
    args: ModelArgs
    facts: ArtifactFacts
    config: dict[str, Any]
    dtype: torch.dtype
    device: torch.device
    kernels: dict[str, str]  # linear module name -> kernel
    kernel_note: str = "-"  # how fp32 CPU layers chose their kernel (choose_float_kernels)


class WeightFiles:
    """Every tensor of a directory's *.safetensors files, memory-mapped (copy-on-write)."""

    def __init__(self, directory: Path) -> None:
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FormatError(f"{directory}: no *.safetensors weights found")
        self._entries: dict[str, tuple[mmap.mmap, TensorEntry]] = {}
        for path in files:
            header = read_header(path)
            with path.open("rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            for entry in header.tensors:
                if entry.name in self._entries:
                    raise FormatError(f"{path}: tensor {entry.name!r} is also in another file")
                self._entries[entry.name] = (mapped, entry)

    def names(self) -> set[str]:
        """Names of all tensors."""
        return set(self._entries)

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of `name`, from the header alone."""
        e = self._entries[name][1]
        dtype = TORCH_DTYPES.get(e.dtype)
        if dtype is None:
            raise FormatError(f"tensor {name!r}: dtype {e.dtype} is not one the engine reads")
        return dtype

    def get(self, name: str) -> torch.Tensor | None:
        """The tensor `name` as a view of the mapped file (no copy), or None when absent.

        The view may be only 8-byte aligned: kernels that need more copy it (see qlinear).
        """
        if name not in self._entries:
            return None
        mapped, e = self._entries[name]
        dtype = self.dtype(name)
        count = e.length // e.itemsize
        if count == 0:
            return torch.empty(e.shape, dtype=dtype)
        return torch.frombuffer(mapped, dtype=dtype, count=count, offset=e.offset).view(e.shape)

    def release(self, names: Iterable[str]) -> None:
        """Drop the mapped pages of `names` from this process's memory once their data is copied.

        A page of the map read at load stays resident (counted in RSS as file memory) until the
        map closes, so a 3B int4 model peaked at 5.5 GB for 3.5 GB held. Never written, its pages
        read back from the file if a tensor still viewing them is used again: dropping is safe.
        """
        for name in names:
            if name in self._entries:
                self.release_rows(name, 0, None)

    def release_rows(self, name: str, start: int, stop: int | None) -> None:
        """Like release, for rows start..stop-1 (None: to the end) of `name` only, so that a
        tensor read a block of rows at a time (the int8 head quantized from Llama-3-8B's 1 GB fp16
        one) never has all its pages resident."""
        mapped, e = self._entries[name]
        rows = e.shape[0] if e.shape else 1
        row_bytes = e.length // rows if rows else 0
        first = e.offset + start * row_bytes
        begin = first - first % mmap.PAGESIZE
        end = e.offset + (rows if stop is None else min(stop, rows)) * row_bytes
        if end > begin:
            mapped.madvise(mmap.MADV_DONTNEED, begin, end - begin)

    def require(self, name: str) -> torch.Tensor:
        """Like get, but a missing tensor is a FormatError."""
        t = self.get(name)
        if t is None:
            raise FormatError(
                f"tensor {name!r} is missing from the weights",
                hint="the artifact does not match its config.json; rebuild it",
            )
        return t


def read_facts(directory: Path, weights: WeightFiles) -> ArtifactFacts:
    """Name, version and per-module quantization from sits-manifest.json, else from the files."""
    if not (directory / MANIFEST_NAME).is_file():
        dtypes = {str(weights.dtype(n)).removeprefix("torch.") for n in weights.names()}
        label = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
        float_labels = sorted(label[d] for d in dtypes if d in label)
        return ArtifactFacts(directory.name, "unversioned", "+".join(float_labels) or "fp32", {})
    manifest = read_manifest(directory)
    spec = manifest.quantization.spec
    quant = f"int4-g{spec.group_size}" if spec.scheme == "int4" else spec.scheme
    if spec.overrides and spec.scheme != "layered":
        quant += "+overrides"
    modules = {
        name: ModuleQuant(m.scheme, m.group_size, m.in_features, m.in_padded, m.out)
        for name, m in manifest.quantization.modules.items()
    }
    return ArtifactFacts(manifest.model.name, manifest.model.version, quant, modules)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; FormatError if missing or malformed."""
    return read_json_object(path)


def choose_dtype(
    requested: str, facts: ArtifactFacts, weights: WeightFiles | MemoryWeights, device: torch.device
) -> torch.dtype:
    """The compute dtype: as requested, or for "auto" fp32 for all-fp32 weights, else the
    dtype the device's kernels like (bf16; fp16 on CUDA for fp16 weights)."""
    if requested != "auto":
        if requested not in DTYPES:
            raise AgentError(f"unknown dtype {requested!r}", hint=f"use auto or {', '.join(DTYPES)}")
        return DTYPES[requested]
    stored = {weights.dtype(n) for n in weights.names() if n.endswith(".weight")}
    if stored == {torch.float32}:
        return torch.float32
    if device.type == "cuda" and facts.quantization == "fp16":
        return torch.float16
    return torch.bfloat16


def load_model(
    directory: Path,
    *,
    device: str,
    dtype: str,
    max_context: int,
    slots: int = 1,
    quantize_head: bool | None = None,
    kv_cache_type: str = "auto",
) -> LoadedModel:
    """Load `directory` onto `device`, with a KV cache of `slots` sequences of
    min(max_context, model context) positions; `quantize_head` and `kv_cache_type` as in
    build_model."""
    config = read_json(directory / "config.json")
    weights = WeightFiles(directory)
    facts = read_facts(directory, weights)
    return build_model(
        config,
        weights,
        facts,
        directory,
        device=device,
        dtype=dtype,
        max_context=max_context,
        slots=slots,
        quantize_head=quantize_head,
        kv_cache_type=kv_cache_type,
    )


def load_draft(directory: Path, *, device: str, max_context: int, kv_cache_type: str = "auto") -> LoadedModel:
    """An int4 (group DRAFT_GROUP) copy of the model in `directory`, quantized here from its
    stored weights, with a KV cache of one sequence of `max_context` positions: the draft model that
    proposes tokens for the engine's speculative decoding. Its quality changes only how many of
    them are accepted, never the text, so a plain min..max quantization serves.

    Raises AgentError for a model stored in int4 already (its draft would be itself).
    """
    config = read_json(directory / "config.json")
    weights = WeightFiles(directory)
    facts = read_facts(directory, weights)
    if facts.quantization.startswith("int4"):
        raise AgentError(
            f"{facts.name} is stored in {facts.quantization}: an int4 draft of it would be the model itself",
            hint="use a draft for fp32, bf16, fp16 or int8 models, or set draft: off",
        )
    tensors: dict[str, torch.Tensor] = {}
    modules: dict[str, ModuleQuant] = {}
    for name in sorted(weights.names()):
        if name.endswith(("_scale", "_zero")):
            continue  # read with their weight
        module = name.removesuffix(".weight")
        stored = weights.require(name)
        if not (name.endswith("proj.weight") and stored.dim() == 2):
            tensors[name] = stored  # norms, biases, the embedding (and a head: an int8 one below)
            continue
        parts = {n: t for n in (name, f"{name}_scale", f"{name}_zero") if (t := weights.get(n)) is not None}
        weight = dequantize(name, facts.modules.get(module), parts)
        packed, scale, zero = quantize_int4(weight, DRAFT_GROUP)
        tensors.update({name: packed, f"{name}_scale": scale, f"{name}_zero": zero})
        out_features, in_features = weight.shape
        modules[module] = ModuleQuant("int4", DRAFT_GROUP, in_features, packed.shape[1] * 2, out_features)
    draft_facts = ArtifactFacts(facts.name, facts.version, f"int4-g{DRAFT_GROUP} (draft)", modules)
    return build_model(
        config,
        MemoryWeights(tensors),
        draft_facts,
        directory,
        device=device,
        dtype="auto",
        max_context=max_context,
        slots=1,
        quantize_head=True,
        kv_cache_type=kv_cache_type,
    )


class MemoryWeights:
    """Tensors already in memory, under checkpoint names (benchmarks on random weights)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def names(self) -> set[str]:
        """Names of all tensors."""
        return set(self._tensors)

    def dtype(self, name: str) -> torch.dtype:
        """The dtype of `name`."""
        return self._tensors[name].dtype

    def get(self, name: str) -> torch.Tensor | None:
        """The tensor `name`, or None when absent."""
        return self._tensors.get(name)

    def release(self, names: Iterable[str]) -> None:
        """Nothing to drop: these tensors are the caller's."""

    def release_rows(self, name: str, start: int, stop: int | None) -> None:
        """Nothing to drop: these tensors are the caller's."""

    def require(self, name: str) -> torch.Tensor:
        """Like get, but a missing tensor is a FormatError."""
        if name not in self._tensors:
            raise FormatError(f"tensor {name!r} is missing from the weights")
        return self._tensors[name]


def build_model(
    config: dict[str, Any],
    weights: WeightFiles | MemoryWeights,
    facts: ArtifactFacts,
    where: Path,
    *,
    device: str,
    dtype: str,
    max_context: int,
    slots: int = 1,
    quantize_head: bool | None = None,
    kv_cache_type: str = "auto",
) -> LoadedModel:
    """The model of `config` on `device` from `weights`, quantized as `facts` say; `where` names
    the source in errors.

    `quantize_head` runs the output head on int8 weights quantized here from its float ones
    (the tied embedding's, usually); None (auto) does so on a CPU for integer-quantized models.
    `kv_cache_type` stores the KV cache as fp32, fp16, bf16 or int8 (see kv_cache_layout)."""
    args = args_from_config(config, where / "config.json")
    dev = torch.device(device)
    if dev.type == "cuda":
        # On Hopper torch gives cuBLAS 32 MiB of workspace per stream, 15% of SmolLM2 int4's
        # weights and KV cache; decode matmuls are skinny, so the pre-Hopper default serves. Read
        # at cuBLAS's first use in the process, and an operator's own setting wins.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    compute = choose_dtype(dtype, facts, weights, dev)
    with torch.device("meta"):
        model = Transformer(args)
    if quantize_head is None:
        quantize_head = dev.type == "cpu" and _integer_quantized(facts)
    if "lm_head.weight" not in weights.names() and config.get("tie_word_embeddings") is False:
        raise FormatError(f"{where}: lm_head.weight is missing and the head is not tied")
    # First, while little else is resident: its transients (the int8 copy, its kernel's repack)
    # then never add to the largest projections'.
    head_shape = (args.vocab_size, args.dim)
    head = _int8_head(weights, facts, head_shape, dev, compute) if quantize_head else None
    used: set[str] = set()
    kernels = _fill_linears(model, weights, facts, dev, compute, used, with_head=head is None)
    if head is not None:
        model.lm_head, kernels["lm_head"] = head
        used.update(n for n in _parts("lm_head") if n in weights.names())
    tied_float = "lm_head" not in kernels
    # On a CPU the embedding is looked up where the artifact stores it (mapped: only the rows
    # looked up are resident), unless a float head shares it, in the compute dtype.
    _fill_plain(model, weights, dev, compute, used, keep_embedding=dev.type == "cpu" and not tied_float)
    if tied_float:
        # Tied output head: the embedding matrix serves as the head, not stored twice.
        model.lm_head, kernels["lm_head"] = build_linear(
            "lm_head", LinearWeights(model.model.embed_tokens.weight), None, dev, compute
        )
    kernel_note = _time_float_kernels(model, kernels)
    _check_all_used(where, weights, used)
    storage, attention = kv_cache_layout(kv_cache_type, dev, compute)
    model.setup_caches(slots, min(max_context, args.max_position_embeddings), dev, storage, attention)
    model.eval()
    release_freed_heap()
    return LoadedModel(model, args, facts, config, compute, dev, kernels, kernel_note)


def kv_cache_layout(kv_cache_type: str, dev: torch.device, compute: torch.dtype) -> tuple[str, torch.dtype]:
    """(how the KV cache is stored, the dtype attention runs in) for agent.yaml's `kv_cache_type`.

    On a CPU attention runs in fp32 whatever the model's dtype or the cache's storage (see
    model.KVCache); auto stores fp32 there. On CUDA attention runs in the storage's dtype, auto
    being the model's; int8 is CPU-only (its reads would cost CUDA graphs a dequantization)."""
    if kv_cache_type not in ("auto", *KV_CACHE_TYPES):
        raise AgentError(
            f"unknown kv_cache_type {kv_cache_type!r}",
            hint=f"use auto or one of {', '.join(KV_CACHE_TYPES)}",
        )
    if dev.type == "cpu":
        return ("fp32" if kv_cache_type == "auto" else kv_cache_type), torch.float32
    if kv_cache_type == "int8":
        raise AgentError(
            f"kv_cache_type int8 is for CPU devices: this model runs on {dev.type}",
            hint="use auto, fp16 or bf16 on CUDA",
        )
    if kv_cache_type == "auto":
        return next(name for name, dtype in DTYPES.items() if dtype == compute), compute
    return kv_cache_type, DTYPES[kv_cache_type]


def _time_float_kernels(model: Transformer, kernels: dict[str, str]) -> str:
    """Give every oneDNN layer of `model` the fp32 kernel timed faster here; update `kernels`
    (a fused layer's under its members' names) and return the timings' note."""
    onednn = {n: m for n, m in model.named_modules() if isinstance(m, OneDnnLinear)}
    if not onednn:
        return "-"
    choice = choose_float_kernels(onednn)
    for name, layer in choice.layers.items():
        _set(model, name, layer)
        for reported in _reported_names(name):
            kernels[reported] = choice.kernels[name]
    return choice.note


def _reported_names(module: str) -> list[str]:
    """The names `kernels` reports module `module` under: a fused one's are its members'."""
    for fused, members in FUSED_PROJECTIONS.items():
        if module.endswith("." + fused):
            prefix = module.removesuffix(fused)
            return [prefix + m for m in members]
    return [module]


def _integer_quantized(facts: ArtifactFacts) -> bool:
    return any(m.scheme in INTEGER_SCHEMES for m in facts.modules.values())


def _int8_head(
    weights: WeightFiles | MemoryWeights,
    facts: ArtifactFacts,
    shape: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[nn.Module, str] | None:
    """An output head on int8 weights quantized from the stored float head (or the tied
    embedding; `shape` is what config.json implies), per output row as the builder's int8, and its
    kernel; None where the stored head is quantized already (served as stored) or no int8 kernel
    takes it (dequantized it would only be slower than the float head).

    Quantized a block of rows at a time straight from the mapped file, each block's pages dropped
    once read: no float copy of the head is made (at Llama-3-8B, 1.05 GB in bf16).

    Decode reads the whole head every token: SmolLM2's tied 49152x576 matrix is 46% of an int4
    g32 model's bytes in bf16; alone it took 2.1 ms in bf16 and 0.75 ms in int8 (2 threads).
    llama.cpp does the same: the Q4_1 GGUF's output head is Q8_0.
    """
    names = weights.names()
    name = "lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight"
    layout = facts.modules.get(name.removesuffix(".weight"))
    weight = weights.require(name)
    if (layout is not None and layout.scheme in INTEGER_SCHEMES) or not weight.is_floating_point():
        return None
    if tuple(weight.shape) != shape:
        raise FormatError(
            f"{name}: weights are {list(weight.shape)} but config.json implies {list(shape)}",
            hint="the weights do not match config.json; rebuild the artifact",
        )
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=torch.float16)
    for start in range(0, weight.shape[0], HEAD_BLOCK):
        block = slice(start, start + HEAD_BLOCK)
        q[block], scale[block] = quantize_int8(weight[block])
        weights.release_rows(name, start, start + HEAD_BLOCK)
    bias = weights.get("lm_head.bias")
    out_features, in_features = q.shape
    layout = ModuleQuant("int8", None, in_features, in_features, out_features)
    stored_bias = None if bias is None else bias.float()
    layer, kernel = build_linear("lm_head", LinearWeights(q, stored_bias, scale), layout, device, dtype)
    return None if kernel == KERNEL_DEQUANT else (layer, kernel)


# Projections that read the same input and run as one matmul when their layouts agree.
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def _fill_linears(
    model: Transformer,
    weights: WeightFiles | MemoryWeights,
    facts: ArtifactFacts,
    device: torch.device,
    dtype: torch.dtype,
    used: set[str],
    *,
    with_head: bool,
) -> dict[str, str]:
    stored: dict[str, tuple[LinearWeights, ModuleQuant | None]] = {}
    names = weights.names()
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, module in linears:
        if name == "lm_head" and (not with_head or f"{name}.weight" not in names):
            continue
        parts = dict(zip(("weight", "bias", "weight_scale", "weight_zero"), _parts(name), strict=True))
        w = LinearWeights(
            weight=weights.require(parts["weight"]),
            bias=weights.get(parts["bias"]),
            scale=weights.get(parts["weight_scale"]),
            zero=weights.get(parts["weight_zero"]),
        )
        layout = facts.modules.get(name)
        shape = (layout.out_features, layout.in_features) if layout else tuple(w.weight.shape)
        if shape != tuple(module.weight.shape):
            raise FormatError(
                f"{name}: weights are {list(shape)} but config.json implies {list(module.weight.shape)}",
                hint="the weights do not match config.json; rebuild the artifact",
            )
        if layout is not None:
            check_shapes(name, w, layout)  # before any concatenation, so errors name the module
        used.update(p for p in parts.values() if p in names)
        stored[name] = (w, layout)
    kernels: dict[str, str] = {}
    for i in range(len(model.model.layers)):
        prefix = f"model.layers.{i}."
        for fused, members in FUSED_PROJECTIONS.items():
            group = [prefix + m for m in members]
            joined = _concat([stored[n] for n in group])
            if joined is None:
                continue
            layer, kernel = build_linear(prefix + fused, *joined, device, dtype)
            _set(model, prefix + fused, layer)
            del joined
            for n in group:
                # The separate projections leave the tree; kernels are still reported by their names.
                _set(model, n, nn.Identity())
                kernels[n] = kernel
                del stored[n]
                weights.release(_parts(n))
    for name, (w, layout) in stored.items():
        layer, kernels[name] = build_linear(name, w, layout, device, dtype)
        _set(model, name, layer)
        weights.release(_parts(name))
    return kernels


def _parts(module: str) -> list[str]:
    """The tensor names a linear module's weights may be stored under."""
    return [f"{module}.{k}" for k in ("weight", "bias", "weight_scale", "weight_zero")]


def _set(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, layer)


def _concat(
    parts: list[tuple[LinearWeights, ModuleQuant | None]],
) -> tuple[LinearWeights, ModuleQuant | None] | None:
    """The projections stacked along their outputs, or None when their layouts differ.

    Every stored layout is per output row (int8 scales, int4 groups along the input), so
    stacking rows is exact.
    """
    layouts = [layout for _, layout in parts]
    first = layouts[0]
    if first is None:
        if any(layout is not None for layout in layouts):
            return None
    else:
        same = [(x.scheme, x.group_size, x.in_features, x.in_padded) for x in layouts if x is not None]
        if len(same) != len(layouts) or len(set(same)) != 1:
            return None
    ws = [w for w, _ in parts]
    if len({w.weight.dtype for w in ws}) != 1:
        return None
    biases = [w.bias for w in ws]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat(
            [b if b is not None else torch.zeros(w.weight.shape[0]) for b, w in zip(biases, ws, strict=True)]
        )
    scales = [w.scale for w in ws if w.scale is not None]
    zeros = [w.zero for w in ws if w.zero is not None]
    scale = torch.cat(scales) if scales else None
    zero = torch.cat(zeros) if zeros else None
    joined = LinearWeights(torch.cat([w.weight for w in ws]), bias, scale, zero)
    if first is None:
        return joined, None
    out = sum(x.out_features for x in layouts if x is not None)
    return joined, ModuleQuant(first.scheme, first.group_size, first.in_features, first.in_padded, out)


def _fill_plain(
    model: Transformer,
    weights: WeightFiles | MemoryWeights,
    device: torch.device,
    dtype: torch.dtype,
    used: set[str],
    *,
    keep_embedding: bool,
) -> None:
    """Embedding and norms: what is left on the meta device after the linears (but a tied head),
    in `dtype` on `device`; `keep_embedding` leaves a float embedding as stored (no copy)."""
    model.model.embed_tokens.out_dtype = dtype
    for name, param in list(model.named_parameters()):
        if not param.is_meta or name.startswith("lm_head."):
            continue
        tensor = weights.require(name)
        if tuple(tensor.shape) != tuple(param.shape):
            raise FormatError(f"tensor {name!r} has shape {list(tensor.shape)}, expected {list(param.shape)}")
        module_name, _, attr = name.rpartition(".")
        keep = keep_embedding and name == "model.embed_tokens.weight" and tensor.is_floating_point()
        value = nn.Parameter(tensor if keep else tensor.to(device, dtype), requires_grad=False)
        setattr(model.get_submodule(module_name), attr, value)
        used.add(name)
        weights.release([name])


def _check_all_used(directory: Path, weights: WeightFiles | MemoryWeights, used: set[str]) -> None:
    unused = sorted(n for n in weights.names() - used if not n.endswith(_IGNORED_SUFFIXES))
    if unused:
        raise FormatError(
            f"{directory}: tensors not used by the model: {', '.join(unused[:5])}"
            + (f" and {len(unused) - 5} more" if len(unused) > 5 else ""),
            hint="the weights do not match config.json's architecture",
        )
