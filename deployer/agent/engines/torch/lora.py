"""LoRA adapters on a loaded torch model: loaded and dropped at runtime, the base untouched, and
requests for different adapters decoded in one batch, in the same captured CUDA graph.

Each linear layer an adapter targets is wrapped once (`LoraLinear`); the base layer (float, int8
or int4) runs as before and the low-rank path runs beside it in the model's activation dtype (an
fp32 model matches its merged twin's greedy tokens exactly). The adapters are stacked per layer
in buffers of a fixed layout (`_Layout`): A_all [in, S*R] and B_all [S*R, out] (the factor
scale*alpha/rank folded into B), adapter slot s owning columns s*R..(s+1)*R (S: the slots,
R: that layer's widest adapter, narrower ones and empty slots zero-padded, which leaves every
product exact). A row's adapter is an index (0: the base, s+1: slot s), read from a tensor, so a
CUDA graph captured once replays any mix of rows: the mask of each row's own columns is made
from the indices inside the graph (`LoraBank.select`). A decode step of mixed rows then costs two
small matmuls per layer whatever the mix: h = x @ A_all, masked to the row's columns, then
h @ B_all -- the padded-stack form of punica's gathered products, without a gather (the stack is
a few adapters wide; the mask costs less than gathering A and B per row). A base row gets an
exact zero added, so its output is the base's to the bit; a step with no adapter row skips the
path entirely (the base's own graphs).

Loading an adapter that fits the layout writes its slot in place, as unloading zeroes it: the
graphs read the new factors on their next replay. One that does not fit (more adapters than
slots, a wider rank, a layer not wrapped yet) grows the layout: new buffers, and `version`
changes, which tells the engine to capture its adapter graphs again.

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
# The fewest adapter slots a layout has, and the multiple a layer's width is rounded up to: a
# few adapters more, or a slightly wider rank, fit without capturing the graphs again.
MIN_SLOTS = 4
WIDTH_STEP = 8


@dataclass(frozen=True)
class _Target:
    """Where a module of the checkpoint's naming runs: the model's module and its output columns."""

    module: str
    start: int
    end: int
    in_features: int


@dataclass(frozen=True)
class _Layout:
    """The shape of the stacked buffers: adapter slots, and each wrapped layer's width R."""

    slots: int
    widths: tuple[tuple[str, int], ...]

    def fits(self, other: _Layout) -> bool:
        """Whether every adapter of `other` has room in this layout."""
        mine = dict(self.widths)
        return other.slots <= self.slots and all(w <= mine.get(m, -1) for m, w in other.widths)

    def union(self, other: _Layout) -> _Layout:
        """The smallest layout both fit."""
        widths = dict(self.widths)
        for module, width in other.widths:
            widths[module] = max(width, widths.get(module, 0))
        return _Layout(max(self.slots, other.slots), tuple(sorted(widths.items())))


class LoraLinear(nn.Module):
    """A base linear layer plus the low-rank products of the adapters loaded on it."""

    def __init__(self, base: nn.Module, bank: LoraBank) -> None:
        super().__init__()
        self.base = base
        self.bank = bank  # not a module: a plain attribute, shared by every wrapped layer
        self.a_t = torch.zeros(0)  # [in, S*R]
        self.b_t = torch.zeros(0)  # [S*R, out]
        self.width = 0  # R

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """base(x) plus, under `LoraBank.select`, each row's adapter's (x @ A^T) @ (factor * B)^T.

        Three kernels a layer (a matmul, the mask, a matmul adding into y), in the model's dtype:
        on a GPU a decode step is a chain of small kernels, and casts to fp32 and back took a
        kernel each more."""
        y = self.base(x)
        select = self.bank.mask
        if select is None or not self.width:
            return y
        dtype = self.a_t.dtype
        h = torch.matmul(x.to(dtype), self.a_t)
        h = (h.unflatten(-1, (-1, self.width)) * select).flatten(-2)
        out = torch.addmm(y.to(dtype).flatten(0, -2), h.flatten(0, -2), self.b_t)
        return out.view(y.shape).to(y.dtype)


class LoraBank:
    """The adapters loaded on one model, by key, in their stacked buffers, and which one each row of
    the computation in progress uses. Changed only on the engine thread, between steps."""

    def __init__(self, model: Transformer, device: torch.device, dtype: torch.dtype) -> None:
        self._model = model
        self._device = device
        self._dtype = dtype  # of the stacked factors: the model's activations
        self._adapters: dict[str, LoraAdapter] = {}
        self._slots: list[str | None] = []  # slot s holds the adapter under this key (None: empty)
        self._wrapped: dict[str, LoraLinear] = {}
        self._layout = _Layout(0, ())
        self._ids = torch.zeros(0, device=device)
        self.version = 0  # changes when the buffers are allocated anew (captured graphs are stale)
        self.mask: torch.Tensor | None = None  # [B, 1, S, 1]: row b uses slot s where 1

    @property
    def keys(self) -> tuple[str, ...]:
        """The loaded adapters' keys, in loading order."""
        return tuple(self._adapters)

    @property
    def nbytes(self) -> int:
        """Bytes the stacked factors take on the device."""
        return sum(t.numel() * t.element_size() for m in self._wrapped.values() for t in (m.a_t, m.b_t))

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
        if key not in self._slots:  # the first free slot, or one more
            if None in self._slots:
                self._slots[self._slots.index(None)] = key
            else:
                self._slots.append(key)
        need = self._needed(adapter)
        if self._layout.fits(need):
            self._write(self._slots.index(key), adapter)
        else:
            self._allocate(self._layout.union(need))

    def remove(self, key: str) -> None:
        """Drop the adapter loaded under `key` (nothing when none is): its slot is zeroed in place."""
        if self._adapters.pop(key, None) is not None:
            slot = self._slots.index(key)
            self._slots[slot] = None
            self._clear(slot)

    def index(self, key: str | None) -> int:
        """The row index of the adapter under `key` (0: None, the base); AgentError when none is
        loaded under it."""
        if key is None:
            return 0
        if key not in self._adapters:
            raise AgentError(f"no adapter is loaded under {key!r}", hint="reload the adapter")
        return self._slots.index(key) + 1

    @contextmanager
    def select(self, indices: torch.Tensor) -> Iterator[None]:
        """Within the block, row b of a computation uses the adapter of index indices[b] [B]
        (0: the base). Inside a captured graph the mask is made from the tensor at each replay."""
        mask = indices[:, None] == self._ids[None, :]
        self.mask = mask.to(self._dtype)[:, None, :, None]
        try:
            yield
        finally:
            self.mask = None

    @contextmanager
    def rows(self, keys: Sequence[str | None]) -> Iterator[None]:
        """Within the block, row b of a computation uses the adapter under keys[b] (None: none);
        the base alone, the path skipped, when no row has one."""
        if all(k is None for k in keys):
            yield
            return
        indices = torch.tensor([self.index(k) for k in keys], device=self._device)
        with self.select(indices):
            yield

    def _needed(self, adapter: LoraAdapter) -> _Layout:
        """The layout the loaded adapters need, `adapter` among them, with its columns per layer."""
        widths: dict[str, int] = {}
        for module in adapter.target_modules:
            target = self._target(module, adapter)
            widths[target.module] = widths.get(target.module, 0) + adapter.tensors[module][0].shape[0]
        rounded = {m: -(-w // WIDTH_STEP) * WIDTH_STEP for m, w in widths.items()}
        return _Layout(max(MIN_SLOTS, len(self._slots)), tuple(sorted(rounded.items())))

    def _allocate(self, layout: _Layout) -> None:
        """New zeroed buffers of `layout`, every loaded adapter written into its slot."""
        slots = 1 << (layout.slots - 1).bit_length()  # a power of two: room to grow
        self._layout = _Layout(slots, layout.widths)
        for name, width in layout.widths:
            wrapper = self._wrap(name)
            out = _out_features(self._model.args, name)
            device, dtype = self._device, self._dtype
            wrapper.a_t = torch.zeros(self._in_features(name), slots * width, device=device, dtype=dtype)
            wrapper.b_t = torch.zeros(slots * width, out, device=device, dtype=dtype)
            wrapper.width = width
        self._ids = torch.arange(1, slots + 1, device=self._device)
        for slot, key in enumerate(self._slots):
            if key is not None:
                self._write(slot, self._adapters[key])
        self.version += 1

    def _clear(self, slot: int) -> None:
        """Zero `slot`'s columns in every wrapped layer, in place."""
        for wrapper in self._wrapped.values():
            cols = slice(slot * wrapper.width, (slot + 1) * wrapper.width)
            wrapper.a_t[:, cols] = 0
            wrapper.b_t[cols] = 0

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter`'s factors in `slot`'s columns, in place (the layout has room for them)."""
        self._clear(slot)
        filled: dict[str, int] = {}
        for module in adapter.target_modules:
            target = self._target(module, adapter)
            wrapper = self._wrapped[target.module]
            # torch.tensor copies: the factors may be a read-only view of the file.
            a, b = (
                torch.tensor(t, dtype=torch.float32, device=self._device) for t in adapter.tensors[module]
            )
            col = slot * wrapper.width + filled.get(target.module, 0)
            wrapper.a_t[:, col : col + a.shape[0]] = a.T
            # Scaled in fp32, rounded once into the buffer's dtype.
            wrapper.b_t[col : col + a.shape[0], target.start : target.end] = (b * adapter.factor).T
            filled[target.module] = filled.get(target.module, 0) + a.shape[0]

    def _in_features(self, name: str) -> int:
        """The input width of one of the model's (possibly fused) decoder-layer linears."""
        args: ModelArgs = self._model.args
        q = args.n_heads * args.head_dim
        return {"o_proj": q, "down_proj": args.intermediate_size}.get(name.rsplit(".", 1)[1], args.dim)

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
