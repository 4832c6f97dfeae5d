"""LoRA adapters on a loaded torch model: loaded and dropped at runtime, the base untouched, and
requests for different adapters decoded in one batch.

Each linear layer an adapter targets is wrapped once (`LoraLinear`); the base layer (float, int8
or int4) runs as before and the low-rank path runs beside it in fp32. The loaded adapters are
stacked per layer: A_all [S*R, in] and B_all [out, S*R] (the factor scale*alpha/rank folded into
B), adapter i owning columns i*R..(i+1)*R (R: the widest adapter on that layer, narrower ones
padded with zeros). A decode step of mixed rows then costs two small matmuls per layer whatever
the mix: h = x @ A_all^T, masked to each row's own adapter's columns (`LoraBank.rows`), then
h @ B_all^T — the padded-stack form of punica's gathered products, without a gather (the stack is
a few adapters wide; the mask costs less than gathering A and B per row). A row with no adapter
gets an exact zero added, so its output is the base's to the bit; a step with no adapter row
skips the path entirely. A prefill runs one sequence, so one adapter: its own columns only.

A fused projection (q, k and v in one `qkv_proj`; gate and up in one `gate_up_proj`) takes the
adapters of its parts side by side: their A's stacked (they read the same input), their B's
placed at the parts' output columns.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from deployer.agent.engines.torch.model import DecoderLayer, ModelArgs, Transformer
from deployer.core.lora import LoraAdapter
from deployer.errors import AgentError

__all__ = ["LoraBank", "LoraLinear"]

_ATTENTION = ("q_proj", "k_proj", "v_proj")
_MLP = ("gate_proj", "up_proj")


@dataclass(frozen=True)
class _Target:
    """Where a module of the checkpoint's naming runs: the model's module and its output columns."""

    module: str
    start: int
    end: int
    in_features: int


class LoraLinear(nn.Module):
    """A base linear layer plus the low-rank products of the adapters loaded on it."""

    def __init__(self, base: nn.Module, bank: LoraBank) -> None:
        super().__init__()
        self.base = base
        # A plain attribute, not a submodule: the bank is shared by every wrapped layer.
        self.__dict__["bank"] = bank
        self.a_t: torch.Tensor | None = None  # [in, S*R]
        self.b_t: torch.Tensor | None = None  # [S*R, out]
        self.width = 0  # R

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """base(x) plus each row's adapter's factor * (x @ A^T) @ B^T."""
        y = self.base(x)
        a_t, b_t, bank = self.a_t, self.b_t, self.__dict__["bank"]
        if a_t is None or b_t is None:
            return y
        if bank.select is not None:
            h = torch.matmul(x.float(), a_t)
            h = (h.unflatten(-1, (-1, self.width)) * bank.select).flatten(-2)
            return y + torch.matmul(h, b_t).to(y.dtype)
        if bank.single is not None:
            cols = slice(bank.single * self.width, (bank.single + 1) * self.width)
            return y + torch.matmul(torch.matmul(x.float(), a_t[:, cols]), b_t[cols]).to(y.dtype)
        return y


class LoraBank:
    """The adapters loaded on one model, by key, and which one each row of the next computation
    uses. Changed only on the engine thread, between steps."""

    def __init__(self, model: Transformer, device: torch.device) -> None:
        self._model = model
        self._device = device
        self._adapters: dict[str, LoraAdapter] = {}
        self._wrapped: dict[str, LoraLinear] = {}
        self.select: torch.Tensor | None = None  # [B, 1, S, 1]: row b uses adapter s where 1
        self.single: int | None = None  # the one adapter of a prefill

    @property
    def keys(self) -> tuple[str, ...]:
        """The loaded adapters' keys, in stacking order."""
        return tuple(self._adapters)

    @property
    def nbytes(self) -> int:
        """Bytes the stacked factors take on the device."""
        return sum(
            t.numel() * t.element_size()
            for m in self._wrapped.values()
            for t in (m.a_t, m.b_t)
            if t is not None
        )

    def add(self, key: str, adapter: LoraAdapter) -> None:
        """Load `adapter` under `key` (a key already loaded is replaced). AgentError, nothing
        changed, for a module this model does not have or factors of the wrong shape."""
        targets = {m: self._target(m, adapter) for m in adapter.target_modules}
        for module, target in targets.items():
            a, b = adapter.tensors[module]
            if a.shape[1] != target.in_features or b.shape[0] != target.end - target.start:
                raise AgentError(
                    f"adapter {adapter.name!r}: {module} is [{b.shape[0]} x {a.shape[1]}] through its "
                    f"factors, but the model's layer is [{target.end - target.start} x {target.in_features}]",
                    hint="the adapter was made for another base model",
                )
        self._adapters[key] = adapter
        self._rebuild()

    def remove(self, key: str) -> None:
        """Drop the adapter loaded under `key` (nothing when none is)."""
        if self._adapters.pop(key, None) is not None:
            self._rebuild()

    def index(self, key: str) -> int:
        """The stacking index of the adapter under `key`; AgentError when none is loaded."""
        try:
            return list(self._adapters).index(key)
        except ValueError:
            raise AgentError(f"no adapter is loaded under {key!r}", hint="reload the adapter") from None

    @contextmanager
    def rows(self, keys: Sequence[str | None]) -> Iterator[None]:
        """Within the block, row b of a computation uses the adapter under keys[b] (None: none)."""
        if all(k is None for k in keys):
            yield
            return
        select = torch.zeros(len(keys), 1, len(self._adapters), 1, device=self._device)
        for row, key in enumerate(keys):
            if key is not None:
                select[row, 0, self.index(key), 0] = 1.0
        self.select = select
        try:
            yield
        finally:
            self.select = None

    @contextmanager
    def one(self, key: str | None) -> Iterator[None]:
        """Within the block, every row uses the adapter under `key` (None: none)."""
        self.single = None if key is None else self.index(key)
        try:
            yield
        finally:
            self.single = None

    def _target(self, module: str, adapter: LoraAdapter) -> _Target:
        """Where the checkpoint's `module` runs in this model (its fused projection, if fused)."""
        args: ModelArgs = self._model.args
        parts = module.split(".")
        if len(parts) == 5 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
            layer_index, block, name = int(parts[2]), parts[3], parts[4]
            if layer_index < args.n_layers:
                layer = self._model.model.layers[layer_index]
                assert isinstance(layer, DecoderLayer)
                prefix = f"model.layers.{layer_index}.{block}"
                q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
                if block == "self_attn" and name in _ATTENTION:
                    widths = dict(zip(_ATTENTION, (q, kv, kv), strict=True))
                    fused = layer.self_attn.qkv_proj is not None
                    return _part(prefix, "qkv_proj", _ATTENTION, widths, name, fused, args.dim)
                if block == "self_attn" and name == "o_proj":
                    return _Target(module, 0, args.dim, q)
                if block == "mlp" and name in _MLP:
                    widths = dict.fromkeys(_MLP, args.intermediate_size)
                    fused = layer.mlp.gate_up_proj is not None
                    return _part(prefix, "gate_up_proj", _MLP, widths, name, fused, args.dim)
                if block == "mlp" and name == "down_proj":
                    return _Target(module, 0, args.dim, args.intermediate_size)
        raise AgentError(
            f"adapter {adapter.name!r} targets {module}, which is not a linear layer of this model's "
            "decoder layers",
            hint="adapters may target q/k/v/o_proj and gate/up/down_proj of model.layers.N",
        )

    def _rebuild(self) -> None:
        """Stack every loaded adapter's factors per layer, wrapping layers met for the first time."""
        adapters = list(self._adapters.values())
        per_module: dict[str, list[list[tuple[_Target, torch.Tensor, torch.Tensor]]]] = {}
        for i, adapter in enumerate(adapters):
            for module in adapter.target_modules:
                target = self._target(module, adapter)
                # torch.tensor copies: the factors may be a read-only view of the file.
                a, b = (
                    torch.tensor(t, dtype=torch.float32, device=self._device) for t in adapter.tensors[module]
                )
                slots = per_module.setdefault(target.module, [[] for _ in adapters])
                slots[i].append((target, a, b * adapter.factor))
        for name in set(self._wrapped) - set(per_module):
            self._wrapped[name].a_t = self._wrapped[name].b_t = None
        for name, slots in per_module.items():
            wrapper = self._wrap(name)
            width = max(sum(a.shape[0] for _, a, _ in parts) for parts in slots)
            in_features = next(t.in_features for parts in slots for t, _, _ in parts)
            out = _out_features(self._model.args, name)
            a_t = torch.zeros(in_features, len(slots) * width, device=self._device)
            b_t = torch.zeros(len(slots) * width, out, device=self._device)
            for i, parts in enumerate(slots):
                col = i * width
                for target, a, b in parts:
                    a_t[:, col : col + a.shape[0]] = a.T
                    b_t[col : col + a.shape[0], target.start : target.end] = b.T
                    col += a.shape[0]
            wrapper.a_t, wrapper.b_t, wrapper.width = a_t, b_t, width

    def _wrap(self, name: str) -> LoraLinear:
        """The wrapper of the model's module `name`, put in its place the first time."""
        if name not in self._wrapped:
            parent_name, _, child = name.rpartition(".")
            parent = self._model.get_submodule(parent_name)
            wrapper = LoraLinear(getattr(parent, child), self)
            setattr(parent, child, wrapper)
            self._wrapped[name] = wrapper
        return self._wrapped[name]


def _part(
    prefix: str,
    fused_name: str,
    names: tuple[str, ...],
    widths: dict[str, int],
    name: str,
    fused: bool,
    in_features: int,
) -> _Target:
    """`name`'s place: its own module, or its columns of the fused projection."""
    if not fused:
        return _Target(f"{prefix}.{name}", 0, widths[name], in_features)
    start = sum(widths[n] for n in names[: names.index(name)])
    return _Target(f"{prefix}.{fused_name}", start, start + widths[name], in_features)


def _out_features(args: ModelArgs, module: str) -> int:
    """The output width of one of the model's (possibly fused) decoder-layer linears."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    widths = {
        "q_proj": q,
        "k_proj": kv,
        "v_proj": kv,
        "qkv_proj": q + 2 * kv,
        "o_proj": args.dim,
        "gate_proj": args.intermediate_size,
        "up_proj": args.intermediate_size,
        "gate_up_proj": 2 * args.intermediate_size,
        "down_proj": args.dim,
    }
    return widths[module.rsplit(".", 1)[1]]
