"""Checks of `model.adapters`: each PEFT adapter fits the base model it is declared under.

Read without loading a tensor: `adapter_config.json` and the header of `adapter_model.safetensors`
(bounded, distrustful: `deployer.core.safetensors_io`). A module an adapter targets must be one of
the base's decoder linears (attention q/k/v/o, MLP gate/up/down of an existing layer), each factor
pair must have the rank the config says and the base module's in/out features, and the base the
adapter was trained on (`base_model_name_or_path`) must name this base. Names are model ids on the
device, so two adapters, or an adapter and the base, cannot share one.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from deployer.config.estimate import ModelShape
from deployer.config.findings import FieldPath, Finding
from deployer.config.models import AdapterSpec, ModelSpec
from deployer.config.sourcemap import SourceMap
from deployer.core.memory import lora_bytes
from deployer.core.safetensors_io import TensorEntry, read_header
from deployer.errors import FormatError

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
BUILTIN_BASE_IDS = ("HuggingFaceTB/SmolLM2-135M-Instruct",)  # what `builtin:smollm2-...` is
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<half>[AB])\.weight$")
_MAX_CONFIG_BYTES = 1024 * 1024
# A config path resolved against deploy.yaml's directory (CheckInput.resolve).
Resolver = Callable[[str], Path]


@dataclass(frozen=True)
class _Where:
    positions: SourceMap
    at: FieldPath

    def finding(self, message: str, hint: str) -> Finding:
        return self.positions.finding(self.at, message, hint)


def base_modules(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every decoder linear a LoRA adapter may target, by its full
    module name in the base's HF naming (``model.layers.0.self_attn.q_proj``)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = {
        "self_attn.q_proj": (shape.hidden, q),
        "self_attn.k_proj": (shape.hidden, kv),
        "self_attn.v_proj": (shape.hidden, kv),
        "self_attn.o_proj": (q, shape.hidden),
        "mlp.gate_proj": (shape.hidden, shape.intermediate),
        "mlp.up_proj": (shape.hidden, shape.intermediate),
        "mlp.down_proj": (shape.intermediate, shape.hidden),
    }
    return {f"model.layers.{i}.{name}": dims for i in range(shape.layers) for name, dims in per_layer.items()}


def adapter_findings(
    model: ModelSpec,
    shape: ModelShape | None,
    positions: SourceMap,
    resolve: Resolver,
) -> list[Finding]:
    """Every problem of `model.adapters`: names, files, and the fit of each adapter to the base
    (the fit only when the base's `shape` could be read)."""
    findings: list[Finding] = []
    seen: dict[str, int] = {}
    for index, spec in enumerate(model.adapters):
        at: FieldPath = ("model", "adapters", index)
        if spec.name == model.name:
            findings.append(
                positions.finding(
                    (*at, "name"),
                    f"adapter name '{spec.name}' is the base model's name",
                    "clients select an adapter by its name as the request's model: give it its own",
                )
            )
        if spec.name in seen:
            findings.append(
                positions.finding(
                    (*at, "name"),
                    f"duplicate adapter name '{spec.name}' (also model.adapters[{seen[spec.name]}])",
                    "each adapter is a model id on the device: make the names unique",
                )
            )
        seen.setdefault(spec.name, index)
        findings += _source_findings(model, spec, shape, _Where(positions, (*at, "source")), resolve)
    return findings


def adapter_memory(model: ModelSpec, resolve: Resolver) -> int:
    """Bytes `model.adapters` hold when all are loaded: the factors their safetensors headers
    declare, as the engine holds them (an unreadable adapter counts nothing: its finding says why)."""
    total = 0
    for spec in model.adapters:
        try:
            header = read_header(resolve(spec.source) / PEFT_WEIGHTS)
        except FormatError:
            continue
        elements = sum(math.prod(e.shape) for name, e in header.by_name().items() if _KEY.match(name))
        total += lora_bytes(elements)
    return total


def _source_findings(
    model: ModelSpec,
    spec: AdapterSpec,
    shape: ModelShape | None,
    where: _Where,
    resolve: Resolver,
) -> list[Finding]:
    source = resolve(spec.source)
    config_path, weights_path = source / PEFT_CONFIG, source / PEFT_WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        return [
            where.finding(
                f"adapter directory {spec.source} has no {PEFT_CONFIG} and {PEFT_WEIGHTS}",
                f"looked in {source}; point source at what peft's save_pretrained wrote "
                "(safe_serialization=True)",
            )
        ]
    try:
        config = read_peft_config(config_path)
        header = read_header(weights_path)
    except FormatError as exc:
        return [where.finding(exc.message, exc.hint or "re-save the adapter with peft")]
    findings = _config_findings(config, config_path, where)
    findings += _base_findings(model, spec, config, source, where, resolve)
    if shape is not None and not findings:
        findings += _tensor_findings(config, header.by_name(), base_modules(shape), weights_path, where)
    return findings


def read_peft_config(path: Path) -> dict[str, object]:
    """A PEFT `adapter_config.json` as a JSON object. Raises FormatError naming the file."""
    try:
        data = path.read_bytes()[: _MAX_CONFIG_BYTES + 1]
        if len(data) > _MAX_CONFIG_BYTES:
            raise FormatError(f"{path}: larger than {_MAX_CONFIG_BYTES} bytes")
        config = json.loads(data)
    except (OSError, ValueError) as exc:
        raise FormatError(f"{path}: not a readable JSON adapter config ({exc})") from exc
    if not isinstance(config, dict):
        raise FormatError(f"{path}: not a JSON object")
    return config


def _config_findings(config: Mapping[str, object], path: Path, where: _Where) -> list[Finding]:
    """A LoRA adapter of a plain kind (no DoRA, no per-module rank, no whole modules to save)."""
    problems = []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {config.get('peft_type')!r} is not LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        problems.append(f"r is {rank!r}, not a positive integer")
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
        problems.append(f"lora_alpha is {alpha!r}, not a positive number")
    for flag in ("use_dora", "use_rslora"):
        if config.get(flag):
            problems.append(f"{flag} is not supported")
    for field in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(field):
            problems.append(f"{field} is not supported")
    return [
        where.finding(f"{path}: {problem}", "train a plain LoRA adapter (LoraConfig with r, lora_alpha)")
        for problem in problems
    ]


def _base_findings(
    model: ModelSpec,
    spec: AdapterSpec,
    config: Mapping[str, object],
    source: Path,
    where: _Where,
    resolve: Resolver,
) -> list[Finding]:
    """The adapter's `base_model_name_or_path` names this base: the same directory, or the same
    model id (the builtin's hub id, or the last part of a hub id or path)."""
    trained_on = config.get("base_model_name_or_path")
    if not isinstance(trained_on, str) or not trained_on:
        return []  # nothing recorded: the shapes are the check
    ours = set(BUILTIN_BASE_IDS) if model.is_builtin else {resolve(model.source).name}
    ours |= {model.source, model.name}
    if not model.is_builtin:
        base_dir = resolve(model.source)
        for candidate in (Path(trained_on), source / trained_on):
            if candidate.is_dir() and candidate.resolve() == base_dir.resolve():
                return []
    last = {PurePosixPath(name).name.lower() for name in ours}
    if trained_on in ours or PurePosixPath(trained_on).name.lower() in last:
        return []
    return [
        where.finding(
            f"adapter {spec.name} was trained on {trained_on!r}, not on this base ({model.source})",
            "an adapter works only with the base it was trained on: train it on this model, "
            "or move it under the model it belongs to",
        )
    ]


def _tensor_findings(
    config: Mapping[str, object],
    tensors: Mapping[str, TensorEntry],
    modules: Mapping[str, tuple[int, int]],
    path: Path,
    where: _Where,
) -> list[Finding]:
    """Each targeted module exists in the base, with both factors of rank `r` and its features."""
    rank = config["r"]
    halves: dict[str, dict[str, TensorEntry]] = {}
    findings = []
    for name, entry in tensors.items():
        match = _KEY.match(name)
        if match is None:
            findings.append(
                where.finding(
                    f"{path}: tensor {name!r} is not a LoRA factor",
                    "only base_model.model.<module>.lora_A/lora_B.weight tensors are shipped",
                )
            )
            continue
        halves.setdefault(match["module"], {})[match["half"]] = entry
    if not halves and not findings:
        findings.append(where.finding(f"{path}: no LoRA factors", "re-save the adapter with peft"))
    unknown = sorted(m for m in halves if m not in modules)
    if unknown:
        short = sorted({m.rsplit(".", 1)[-1] for m in modules})
        findings.append(
            where.finding(
                f"{path}: targets module(s) the base does not have: {', '.join(unknown[:4])}"
                + (f" and {len(unknown) - 4} more" if len(unknown) > 4 else ""),
                f"LoRA targets of this base: {', '.join(short)} in layers 0-"
                f"{max(int(m.split('.')[2]) for m in modules)}",
            )
        )
    for module in sorted(set(halves) - set(unknown)):
        findings += _pair_findings(module, halves[module], rank, modules[module], path, where)
    return findings


def _pair_findings(
    module: str,
    pair: Mapping[str, TensorEntry],
    rank: object,
    dims: tuple[int, int],
    path: Path,
    where: _Where,
) -> list[Finding]:
    in_features, out_features = dims
    expected = {"A": (rank, in_features), "B": (out_features, rank)}
    findings = []
    for half in ("A", "B"):
        entry = pair.get(half)
        key = f"{PEFT_PREFIX}{module}.lora_{half}.weight"
        if entry is None:
            findings.append(where.finding(f"{path}: missing tensor {key}", "re-save the adapter with peft"))
        elif tuple(entry.shape) != expected[half]:
            findings.append(
                where.finding(
                    f"{path}: {key} has shape {list(entry.shape)}, expected {list(expected[half])} "
                    f"(rank r={rank}; the base's {module} is {in_features} -> {out_features})",
                    "the adapter was trained on a base of another shape, or r in adapter_config.json "
                    "does not match its tensors",
                )
            )
    return findings
