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
closest (squared error) to the float ones (see `_search` for AutoAWQ's variant, measured worse).
AWQ's weight clipping (AutoAWQ's auto_clip) was tried too and dropped: it lowered each group's
output error but raised SmolLM2's int4-g128 perplexity from +11.6 % to +13.6 %.

With `gptq`, the same pass then rounds every int4 linear by GPTQ (build/gptq.py) on its scaled
weights, compensating errors through its scaled calibration inputs; the levels it chose replace
plain rounding when the weights are written (`Folds.rounded`).
We write our own rather than use AutoAWQ or llm-compressor: both emit their own packed formats
and kernels (GEMM/GEMV layouts, CUDA-only paths), while this only has to hand scaled float
weights to our quantizer and artifact format.

The calibration pass streams: one decoder layer's weights (fp32) at a time, the activations
between layers kept, so peak memory is bounded by the largest layer, not the model. Per-channel
statistics are summed in float64; the forward and the searches run in float32, deterministic
for a given thread count (the build test builds twice and compares the artifact ids).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deployer.build import gptq, quality
from deployer.build.quantize import module_scheme
from deployer.build.source import SourceModel, read_rows
from deployer.build.spec import AwqSpec, QuantSpec
from deployer.core.calibration import DEFAULT_CALIBRATION, MIN_WORDS, text_problem
from deployer.core.hashing import sha256_bytes
from deployer.core.quant_layout import dequantize_int8, fake_quantize_int4, quantize_int8
from deployer.errors import BuildError

FIELD = "model.quantization.calibration"
# Calibration tokens read (capped by the model's context), as sequences of SEQUENCE_TOKENS:
# enough for stable per-channel means on small models, and a forward pass of a few seconds on
# 2 cores.
CALIBRATION_TOKENS = 1024
SEQUENCE_TOKENS = 1024
# Rows of activations the alpha search scores each candidate on (every k-th token), and the
# candidates of the scale exponent alpha (0: no scaling).
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
    """What the calibration pass decided before quantization: `columns[name]` multiplies a
    weight's columns, `rows[name]` divides its rows (a 1-D tensor's entries); `rounded[name]`:
    the int4 tensors GPTQ stored for a weight (quantize_int4's layout), used instead of rounding
    it to nearest. `tokens`: calibration tokens."""

    columns: dict[str, torch.Tensor]
    rows: dict[str, torch.Tensor]
    tokens: int
    rounded: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)

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
    source: SourceModel,
    spec: QuantSpec,
    calibrated: AwqSpec,
    calibration: Calibration,
    log: Callable[[str], None],
) -> Folds:
    """Search AWQ scales (`calibrated.scales`), then round int4 linears by GPTQ
    (`calibrated.gptq`), for `source` quantized per `spec`, on `calibration`'s text, one decoder
    layer at a time."""
    layers = layer_groups(source)
    limit = min(CALIBRATION_TOKENS, int(source.config.get("max_position_embeddings", CALIBRATION_TOKENS)))
    ids = quality.encode(source, calibration.text)[:limit]
    sequence = min(SEQUENCE_TOKENS, len(ids))
    ids = ids[: len(ids) // sequence * sequence]
    count = sum(len(layer) for layer in layers)
    steps = [*(["scales"] if calibrated.scales else []), *(["GPTQ rounding"] if calibrated.gptq else [])]
    log(f"calibration: {' and '.join(steps)} for {count} groups of linears on {len(ids)} tokens")
    stream = LayerStream(source, torch.tensor(ids).reshape(-1, sequence))
    scales: dict[Group, torch.Tensor] = {}
    rounded: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for index, found in enumerate(layers):
        int4 = [n for n in _linears(index) if module_scheme(spec, n)[0] == "int4"] if calibrated.gptq else []
        layer = stream.advance(index, sorted({g.linears[0] for g in found} | set(int4)))
        if calibrated.scales:
            for group in found:
                scale = _search(layer, group, {name: module_scheme(spec, name) for name in group.linears})
                if scale is not None:
                    scales[group] = scale
        folds = fold({g: s for g, s in scales.items() if g in found}, 0)
        factors: dict[int, torch.Tensor] = {}  # per input (linears sharing one share H)
        for name in int4:
            x = layer.inputs[name]
            key = f"{name}.weight"
            if x.data_ptr() not in factors:
                factors[x.data_ptr()] = gptq.inverse_factor(gptq.hessian(x / folds.columns.get(key, 1.0)))
            weight = folds.apply(key, layer.weight(name))
            rounded[key] = gptq.quantize(weight, factors[x.data_ptr()], module_scheme(spec, name)[1])
    return Folds(*_placed(scales), len(ids), rounded)


def _linears(index: int) -> list[str]:
    """The decoder linears of layer `index` (the layout `layer_groups` checked)."""
    p = f"model.layers.{index}"
    return [f"{p}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + [
        f"{p}.mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")
    ]


class LayerStream:
    """The calibration forward pass one decoder layer at a time: one layer's weights (fp32) are
    in memory at once, with the hidden states between layers, so the peak is bounded by the
    largest layer, not the model. Each layer runs in a one-layer model of the source's own
    architecture (transformers builds the rotary embedding and the causal mask)."""

    def __init__(self, source: SourceModel, ids: torch.Tensor) -> None:
        from transformers import AutoConfig

        self.source = source
        self.tensors = {t.name: t for t in source.tensors}
        self.config = AutoConfig.from_pretrained(source.path)
        self.skeletons: dict[str, torch.nn.Module] = {}
        embed = self.tensors["model.embed_tokens.weight"]
        rows = {
            i: read_rows(embed.path, embed.entry, i, i + 1)[0].float()
            for i in sorted(set(ids.flatten().tolist()))
        }
        self.hidden = torch.stack([torch.stack([rows[i] for i in row]) for row in ids.tolist()])

    def advance(self, index: int, watched: list[str]) -> Layer:
        """Run decoder layer `index` on the hidden states, recording the inputs of the `watched`
        linears; the layer's output becomes the next hidden states."""
        types = getattr(self.config, "layer_types", None)
        kind = types[index] if types else "decoder"
        model = self.skeletons.get(kind) or self._skeleton(kind)
        layer = model.get_submodule("layers.0")
        prefix = f"model.layers.{index}."
        state = {
            name.removeprefix(prefix): read_rows(t.path, t.entry).float()
            for name, t in self.tensors.items()
            if name.startswith(prefix)
        }
        layer.load_state_dict(state, strict=True, assign=True)
        seen = Layer(prefix.removesuffix("."), layer, {})
        modules = dict(layer.named_modules())
        handles = []
        for name in watched:
            local = name.removeprefix(prefix)
            handles.append(modules[local].register_forward_pre_hook(seen.record_input(name)))
        output: list[torch.Tensor] = []
        handles.append(
            layer.register_forward_hook(
                lambda _m, _a, out: output.append(out[0] if isinstance(out, tuple) else out)
            )
        )
        try:
            with torch.inference_mode():
                model(inputs_embeds=self.hidden, use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        self.hidden = output[0]
        return seen

    def _skeleton(self, kind: str) -> torch.nn.Module:
        """A one-layer base model of the source's architecture (random weights, replaced per layer)."""
        from transformers import AutoModel

        config = copy.deepcopy(self.config)
        config.num_hidden_layers = 1
        config.vocab_size, config.pad_token_id = 1, None  # the embedding is read row by row instead
        if getattr(config, "layer_types", None):
            config.layer_types = [kind]
        torch.manual_seed(0)
        model = AutoModel.from_config(config, dtype=torch.float32).eval()
        self.skeletons[kind] = model
        return model


@dataclass
class Layer:
    """One decoder layer as the calibration pass saw it: its module, the inputs of the watched
    linears (full names, [tokens, in])."""

    prefix: str
    module: torch.nn.Module
    inputs: dict[str, torch.Tensor]

    def weight(self, name: str) -> torch.Tensor:
        """The fp32 weight of linear `name` (full name)."""
        linear = self.module.get_submodule(name.removeprefix(f"{self.prefix}."))
        return linear.get_parameter("weight").detach()

    def record_input(self, name: str) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            self.inputs[name] = args[0].reshape(-1, args[0].shape[-1])

        return hook


def fold(scales: dict[Group, torch.Tensor], tokens: int) -> Folds:
    """Where each group's scale goes: its linears' columns are multiplied, its producers' rows
    divided (exact before quantization: the model computes the same function)."""
    return Folds(*_placed(scales), tokens)


def _placed(scales: dict[Group, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(columns, rows) of `Folds` for the groups' scales."""
    columns: dict[str, torch.Tensor] = {}
    rows: dict[str, torch.Tensor] = {}
    for group, scale in scales.items():
        columns.update({f"{name}.weight": scale for name in group.linears})
        rows.update({producer: scale for producer in group.producers})
    return columns, rows


def _search(layer: Layer, group: Group, schemes: dict[str, tuple[str, int]]) -> torch.Tensor | None:
    """The best per-channel scale for `group`'s linears, or None when none of them is
    integer-quantized or no scaling beats plain rounding: s = mean|x|^alpha, alpha on ALPHAS,
    scored by the squared error of the quantized linears' outputs on SEARCH_ROWS calibration rows.

    (AutoAWQ's variant was measured worse on SmolLM2 int4-g128: dividing by mean|w~|^(1-alpha),
    w~ = |w| over its group's max, and scoring the attention/MLP output on one 256-token sequence
    gave +25.5 % perplexity where this gives +11.6 %.)
    """
    if all(scheme not in ("int4", "int8") for scheme, _ in schemes.values()):
        return None
    x = layer.inputs[group.linears[0]]
    magnitude = x.double().abs().mean(dim=0).float()
    sample = x[:: max(1, x.shape[0] // SEARCH_ROWS)]
    weights = {name: layer.weight(name) for name in group.linears}
    reference = {name: sample @ w.t() for name, w in weights.items()}
    best: tuple[float, torch.Tensor | None] = (float("inf"), None)
    for alpha in ALPHAS:
        scale = magnitude.pow(alpha).clamp(min=MIN_SCALE)
        scale = scale / (scale.max() * scale.min()).sqrt()
        error = 0.0
        for name, w in weights.items():
            scheme, size = schemes[name]
            quantized = _fake_quantize(w * scale, scheme, size) / scale
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
    """The scalable groups of all decoder layers, in order."""
    return [group for layer in layer_groups(source) for group in layer]


def layer_groups(source: SourceModel) -> list[list[Group]]:
    """The scalable groups of each decoder layer; BuildError naming a tensor the model lacks."""
    config = source.config
    layers = int(config.get("num_hidden_layers", 0))
    heads = config.get("num_attention_heads")
    per_head_kv = config.get("num_key_value_heads", heads) == heads
    names = {t.name: tuple(t.entry.shape) for t in source.tensors}
    found: list[list[Group]] = []
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
        found.append(layer)
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
