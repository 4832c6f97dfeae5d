"""Activation-aware weight quantization (AWQ, Lin et al. 2024), written here in torch.

Input channels that carry large activations matter most to a layer's output, so AWQ scales them
up before quantizing (their weights then get relatively finer levels) and scales the layer's input
down by the same factor. The input scaling is folded into what produces that input, so the device
runs the same kernels at the same speed on a model whose float function is unchanged:

* q/k/v_proj: columns x s, input_layernorm's weight / s;
* gate/up_proj: columns x s, post_attention_layernorm's weight / s;
* down_proj: columns x s, up_proj's rows / s (silu(gate) * up is linear in up's rows);
* o_proj: columns x s, v_proj's rows / s (attention mixes v's channels only within a head), only
  where every query head has its own kv head: under GQA one v channel feeds several heads'
  o_proj columns, which would need one shared scale; AutoAWQ skips that case too.

Per group, s = mean|x|^alpha over the calibration tokens (normalised so max*min = 1), with alpha
on a grid of 10 from 0 (no scaling) to 0.9, keeping the one whose quantized linears' outputs are
closest (squared error) to the float ones. We write our own rather than use AutoAWQ or
llm-compressor: both emit their own packed formats and kernels (GEMM/GEMV layouts, CUDA-only
paths), while this only has to hand scaled float weights to our quantizer and artifact format.
AWQ's weight-clipping search is not done (clipping lowered weight error but raised perplexity on
SmolLM2 in an earlier trial, see quant_layout.quantize_int4).

The calibration forward runs in float64 so the per-channel statistics, and with them the folded
weights, do not depend on thread scheduling; the alpha search itself runs in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from deployer.build import quality
from deployer.build.quantize import module_scheme
from deployer.build.source import SourceModel
from deployer.build.spec import AwqSpec, QuantSpec
from deployer.core.calibration import DEFAULT_CALIBRATION, MIN_WORDS, text_problem
from deployer.core.hashing import sha256_bytes
from deployer.core.quant_layout import dequantize_int8, fake_quantize_int4, quantize_int8
from deployer.errors import BuildError

FIELD = "model.quantization.calibration"
# Calibration tokens read (one sequence, capped by the model's context): enough for stable
# per-channel means on small models, and a forward pass of a few seconds on 2 cores.
CALIBRATION_TOKENS = 1024
# Rows of activations the alpha search scores each candidate on (every k-th token), and the
# candidates: each costs a quantization and a matmul per linear, and the search has to fit the
# build's time budget (SmolLM2 in under 2 minutes on 2 cores).
SEARCH_ROWS = 128
ALPHAS = tuple(i / 10 for i in range(10))
# Floor of a channel's scale before normalising: a channel that is never active gets a tiny
# weight scale-up, not an infinite one.
MIN_SCALE = 1e-4


@dataclass(frozen=True)
class Calibration:
    """The calibration text: where it came from, its sha256 and its contents."""

    path: Path
    sha256: str
    text: str


@dataclass(frozen=True)
class Folds:
    """Scales folded into source tensors: `columns[name]` multiplies a weight's columns,
    `rows[name]` divides its rows (a 1-D tensor's entries). `tokens`: calibration tokens used."""

    columns: dict[str, torch.Tensor]
    rows: dict[str, torch.Tensor]
    tokens: int

    def apply(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The source tensor `name` with its folds applied (fp32), or unchanged when it has none."""
        columns, rows = self.columns.get(name), self.rows.get(name)
        if columns is None and rows is None:
            return tensor
        out = tensor.float()
        if columns is not None:
            out = out * columns
        if rows is not None:
            out = out / (rows if out.dim() == 1 else rows[:, None])
        return out


@dataclass(frozen=True)
class Group:
    """Linears that read the same input (the first one's), and the tensors producing it."""

    linears: tuple[str, ...]
    producers: tuple[str, ...]


def read_calibration(spec: AwqSpec) -> Calibration:
    """The calibration text `spec` names (or the default), checked: not empty, UTF-8, long enough.

    Raises BuildError naming the field and, for a bad text, file:line:column inside it.
    """
    path = spec.calibration or DEFAULT_CALIBRATION
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BuildError(
            f"{path}: {FIELD} cannot be read ({exc.strerror or exc})",
            hint="point it at a UTF-8 text file (relative to deploy.yaml), or remove it for the default",
        ) from exc
    problem = text_problem(data)
    if problem is not None:
        raise BuildError(
            f"{path}:{problem.line}:{problem.column}: {FIELD}: the text {problem.message}",
            hint=f"use a UTF-8 text of at least {MIN_WORDS} words, like what the model will read",
        )
    return Calibration(path, sha256_bytes(data), data.decode("utf-8"))


def search_folds(
    source: SourceModel, spec: QuantSpec, calibration: Calibration, log: Callable[[str], None]
) -> Folds:
    """Search AWQ scales for `source` quantized per `spec`, on `calibration`'s text."""
    found = groups(source)
    limit = min(CALIBRATION_TOKENS, int(source.config.get("max_position_embeddings", CALIBRATION_TOKENS)))
    ids = quality.encode(source, calibration.text)[:limit]
    log(f"awq: searching scales for {len(found)} groups of linears on {len(ids)} calibration tokens")
    model = quality.load_model(source).to(torch.float64)
    decoder: torch.nn.Module = model.get_decoder()  # type: ignore[operator]  # the head is not needed
    modules = dict(model.named_modules())
    scales: dict[Group, torch.Tensor] = {}

    def searcher(group: Group) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].reshape(-1, args[0].shape[-1])
            weights = {name: modules[name].weight.float() for name in group.linears}
            scale = _search(x, weights, {name: module_scheme(spec, name) for name in group.linears})
            if scale is not None:
                scales[group] = scale

        return hook

    handles = [modules[g.linears[0]].register_forward_pre_hook(searcher(g)) for g in found]
    try:
        with torch.inference_mode():
            decoder(torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    return fold(scales, len(ids))


def fold(scales: dict[Group, torch.Tensor], tokens: int) -> Folds:
    """Where each group's scale goes: its linears' columns are multiplied, its producers' rows
    divided (exact before quantization: the model computes the same function)."""
    columns: dict[str, torch.Tensor] = {}
    rows: dict[str, torch.Tensor] = {}
    for group, scale in scales.items():
        columns.update({f"{name}.weight": scale for name in group.linears})
        rows.update({producer: scale for producer in group.producers})
    return Folds(columns, rows, tokens)


def _search(
    x: torch.Tensor, weights: dict[str, torch.Tensor], schemes: dict[str, tuple[str, int]]
) -> torch.Tensor | None:
    """The best per-channel scale for linears reading `x` (float64 [tokens, in]), or None when
    none of them is integer-quantized or no scaling beats plain rounding."""
    if all(scheme not in ("int4", "int8") for scheme, _ in schemes.values()):
        return None
    magnitude = x.abs().mean(dim=0).float()
    step = max(1, x.shape[0] // SEARCH_ROWS)
    sample = x[::step].float()
    reference = {name: sample @ w.t() for name, w in weights.items()}
    best: tuple[float, torch.Tensor | None] = (float("inf"), None)
    for alpha in ALPHAS:
        scale = magnitude.pow(alpha).clamp(min=MIN_SCALE)
        scale = scale / (scale.max() * scale.min()).sqrt()
        error = 0.0
        for name, w in weights.items():
            scheme, group = schemes[name]
            quantized = _fake_quantize(w * scale, scheme, group) / scale
            error += float((sample @ quantized.t() - reference[name]).double().pow(2).sum())
        if error < best[0]:
            best = (error, None if alpha == 0 else scale)
    return best[1]


def _fake_quantize(w: torch.Tensor, scheme: str, group: int) -> torch.Tensor:
    """What `w` becomes once stored under `scheme` and read back (float schemes: itself)."""
    if scheme == "int4":
        return fake_quantize_int4(w, group)
    if scheme == "int8":
        return dequantize_int8(*quantize_int8(w))
    return w


def groups(source: SourceModel) -> list[Group]:
    """The scalable groups of each decoder layer; BuildError naming a tensor the model lacks."""
    config = source.config
    layers = int(config.get("num_hidden_layers", 0))
    heads = config.get("num_attention_heads")
    per_head_kv = config.get("num_key_value_heads", heads) == heads
    names = {t.name: tuple(t.entry.shape) for t in source.tensors}
    found = []
    for i in range(layers):
        p = f"model.layers.{i}"
        attn, mlp = f"{p}.self_attn", f"{p}.mlp"
        layer = [
            Group((f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"), (f"{p}.input_layernorm.weight",)),
            Group((f"{mlp}.gate_proj", f"{mlp}.up_proj"), (f"{p}.post_attention_layernorm.weight",)),
            Group((f"{mlp}.down_proj",), _with_bias(f"{mlp}.up_proj", names)),
        ]
        if per_head_kv:
            layer.append(Group((f"{attn}.o_proj",), _with_bias(f"{attn}.v_proj", names)))
        for group in layer:
            _check_group(group, names)
        found += layer
    if not found:
        raise BuildError(f"{source.path / 'config.json'}: no decoder layers for activation-aware scaling")
    return found


def _with_bias(module: str, names: dict[str, tuple[int, ...]]) -> tuple[str, ...]:
    """A linear's weight, and its bias when it has one (both are divided row by row)."""
    return (f"{module}.weight", *((f"{module}.bias",) if f"{module}.bias" in names else ()))


def _check_group(group: Group, names: dict[str, tuple[int, ...]]) -> None:
    """Every tensor of `group` exists, the linears share an input width, and the producers' output
    width is that input width."""
    width = None
    for linear in group.linears:
        shape = names.get(f"{linear}.weight")
        if shape is None or len(shape) != 2 or width not in (None, shape[1]):
            raise BuildError(
                f"{linear}.weight: activation-aware scaling cannot handle this tensor ({shape})",
                hint="remove `awq: true` for this model (Llama, Qwen2 and Mistral layouts are handled)",
            )
        width = shape[1]
    for producer in group.producers:
        shape = names.get(producer)
        if shape is None or shape[0] != width:
            raise BuildError(
                f"{producer}: activation-aware scaling needs it with {width} output channels, found {shape}",
                hint="remove `awq: true` for this model (Llama, Qwen2 and Mistral layouts are handled)",
            )
