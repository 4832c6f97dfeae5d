"""A gpt-fast-style decoder for Llama, Qwen2 and Mistral checkpoints over a batch of cache slots.

RMSNorm, rotary embeddings, grouped-query attention over a static KV cache, SwiGLU MLP. Prefill
runs one slot's prompt from `start` (a prefix already in the slot is skipped); decode advances
several slots by one token with fixed shapes (what torch.compile and CUDA graphs take). The
linear layers are plugged in from outside (`qlinear`), so the same module tree runs fp32, bf16,
int8 or int4 weights. The tree is built on the meta device and filled in by the loader, so
building it allocates nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deployer.agent.engines.torch import exact_ops
from deployer.core.architectures import SUPPORTED_ARCHITECTURES, rope_parameters
from deployer.errors import AgentError, FormatError


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3's rope scaling (`rope_type: llama3`): long wavelengths stretched by `factor`, short
    ones kept, the band between interpolated (transformers' _compute_llama3_parameters)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelArgs:
    """The shape of the network, read from config.json."""

    architecture: str
    vocab_size: int
    dim: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    rope_scaling: Llama3Rope | None = None


def args_from_config(config: dict[str, Any], where: Path) -> ModelArgs:
    """Validate an HF config.json dict and turn it into ModelArgs.

    Raises AgentError for an architecture or rope scaling we do not run, FormatError for a
    config that lacks a required field.
    """
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise AgentError(
            f"{where}: architecture {archs or config.get('model_type')!r} is not supported by the "
            f"torch engine",
            hint=f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}",
        )
    if config.get("hidden_act", "silu") != "silu":
        raise AgentError(f"{where}: hidden_act {config['hidden_act']!r} is not supported (only silu)")
    rope_scaling = _rope_scaling(config, where)
    dim = _field(config, "hidden_size", int, where)
    n_heads = _field(config, "num_attention_heads", int, where)
    n_kv = config.get("num_key_value_heads") or n_heads
    head_dim = config.get("head_dim") or dim // n_heads
    if n_heads % n_kv:
        raise FormatError(f"{where}: {n_heads} attention heads are not a multiple of {n_kv} KV heads")
    window = config.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not config.get("use_sliding_window", False):
        window = None
    return ModelArgs(
        architecture=arch,
        vocab_size=_field(config, "vocab_size", int, where),
        dim=dim,
        intermediate_size=_field(config, "intermediate_size", int, where),
        n_layers=_field(config, "num_hidden_layers", int, where),
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        head_dim=int(head_dim),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_parameters(config).get("rope_theta", 10000.0)),
        max_position_embeddings=_field(config, "max_position_embeddings", int, where),
        sliding_window=int(window) if window else None,
        eos_token_ids=as_token_ids(config.get("eos_token_id")),
        rope_scaling=rope_scaling,
    )


def _field(config: dict[str, Any], key: str, kind: type, where: Path) -> Any:
    value = config.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise FormatError(f"{where}: config.json needs {key} as {kind.__name__}, found {value!r}")
    return value


def _rope_scaling(config: dict[str, Any], where: Path) -> Llama3Rope | None:
    """Llama 3's rope scaling, None for plain rope; AgentError for any other kind."""
    params = rope_parameters(config)
    kind = params.get("rope_type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise AgentError(
            f"{where}: rope scaling [{kind!r}] is not supported by the torch engine (it runs "
            f"default and llama3 rope)",
            hint="use a checkpoint without rope_scaling, or the llama.cpp engine",
        )
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if not isinstance(params.get(k), int | float)]
    if missing:
        raise FormatError(f"{where}: llama3 rope scaling needs {', '.join(missing)}")
    scaling = Llama3Rope(
        float(params["factor"]),
        float(params["low_freq_factor"]),
        float(params["high_freq_factor"]),
        int(params["original_max_position_embeddings"]),
    )
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise FormatError(f"{where}: llama3 rope scaling needs high_freq_factor > low_freq_factor")
    return scaling


def as_token_ids(value: object) -> tuple[int, ...]:
    """An eos_token_id field (an int, a list of ints, or absent) as a tuple."""
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int))
    return ()


class RMSNorm(nn.Module):
    """Root-mean-square norm of a residual sum (torch's fused kernel: one op instead of six).

    `exact`: through exact_ops, which torch.compile calls as it is (see Transformer.use_exact_ops).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.exact = False

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, this norm of h) with h = x + delta, normalized over the last dimension and scaled:
        a residual add and the norm after it, one kernel on CUDA (exact_ops)."""
        if self.exact:
            return exact_ops.add_rms_norm(x, delta, self.weight, self.eps)
        return exact_ops.torch_add_rms_norm(x, delta, self.weight, self.eps)


KV_CACHE_TYPES = ("fp32", "fp16", "bf16", "int8")
_FLOAT_STORAGE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

CacheIndex = tuple[int | slice | torch.Tensor, ...]


class KVCache(nn.Module):
    """Preallocated keys and values: `slots` sequences of `max_len` positions, plus one scratch
    position (index `max_len`) where rows that take no part in a decode step write harmlessly.

    Stored as `storage` ("fp32", "fp16", "bf16" or "int8": symmetric per position and head, with
    an fp32 absmax scale each, as llama.cpp's q8_0 roughly), read back in `compute` (the dtype
    attention runs in), only the positions a step attends. On a CPU `compute` is fp32 even for a
    bf16 model, because torch's CPU attention in bf16 was 5-10x slower than in fp32 (83 vs 16 us
    for one query over 101 keys, 1.6 vs 0.18 ms over 2,048; SmolLM2's heads); a 16-bit or int8
    cache then halves or quarters the cache's memory for a conversion of the keys read.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    def __init__(
        self,
        slots: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        storage: str,
        compute: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        if storage not in KV_CACHE_TYPES:
            raise AgentError(
                f"unknown KV cache type {storage!r}", hint=f"use one of {', '.join(KV_CACHE_TYPES)}"
            )
        self.storage, self.compute = storage, compute
        shape = (slots, n_kv_heads, max_len + 1, head_dim)
        dtype = torch.int8 if storage == "int8" else _FLOAT_STORAGE[storage]
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        scales = (slots, n_kv_heads, max_len + 1, 1)
        for name in ("k_scale", "v_scale"):
            scale = torch.zeros(scales, dtype=torch.float32, device=device) if storage == "int8" else None
            self.register_buffer(name, scale, persistent=False)

    def write(self, index: CacheIndex, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys `k` and values `v` at `index` (a subscript of the cache's [slot, head,
        position, dim] that leaves the last dimension whole)."""
        for stored, scale, value in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            if scale is None:
                stored[index] = value.to(stored.dtype)
            else:
                step = value.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-30) / 127
                stored[index] = torch.round(value / step).to(torch.int8)
                scale[index] = step

    def read(self, index: CacheIndex) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at `index`, in the compute dtype (a view where they are stored in it)."""
        if self.k_scale is None or self.v_scale is None:
            return self.k[index].to(self.compute), self.v[index].to(self.compute)
        # int8 times fp32: one kernel that converts and scales (type promotion), no int8 copy.
        return self.k[index] * self.k_scale[index], self.v[index] * self.v_scale[index]

    def copy_prefix(self, source: int, dest: int, length: int) -> None:
        """Copy positions 0..length-1 of slot `source` into slot `dest` (scales too)."""
        for tensor in (self.k, self.v, self.k_scale, self.v_scale):
            if tensor is not None:
                tensor[dest, :, :length] = tensor[source, :, :length]


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1) done as a roll of the
    halves against a sin table whose first half is negated (the same values, two ops fewer)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions and a static KV cache.

    q, k and v come from one fused projection (`qkv_proj`) where the loader could fuse them,
    else from three.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.qkv_proj: nn.Module | None = None
        self.kv_cache: KVCache | None = None
        self.exact = False  # the decode softmax through exact_ops (see Transformer.use_exact_ops)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """q, k and v heads side by side: [B, T, H + 2 KV, hd], not yet rotated."""
        b, t, _ = x.shape
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
        else:
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        return qkv.view(b, t, self.n_heads + 2 * self.n_kv, self.head_dim)

    def _rotated_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, H, T, hd] and k [B, KV, T, hd] rotated, and v [B, KV, T, hd], in `dtype` (the KV
        cache's, see KVCache). q and k turn in one rope; `cos` and `sin` broadcast over
        [B, T, heads, hd]."""
        heads = self._heads(x).to(dtype)
        rotated = self.n_heads + self.n_kv
        qk = _rope(heads[:, :, :rotated], cos, sin)
        q, k = qk[:, :, : self.n_heads], qk[:, :, self.n_heads :]
        return q.transpose(1, 2), k.transpose(1, 2), heads[:, :, rotated:].transpose(1, 2)

    def prefill(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        slot: int | torch.Tensor | None,
        at: int | torch.Tensor,
    ) -> torch.Tensor:
        """T new positions of one slot, attending its cached positions up to them.

        With ints (eager), positions at..at+T of `slot`, attending keys 0..at+T. With tensors
        (`slot` [1], `at` the positions [T]), every shape is fixed, for a CUDA graph: keys are
        written by position (padding at the scratch position) and the slot's whole cache is
        attended under `mask`. With no slot, positions 0..T attend each other and the cache is
        left alone (embeddings).
        """
        _, t, _ = x.shape
        cache = self.require_cache()
        q, k, v = self._rotated_qkv(x, cos, sin, cache.compute)
        if slot is None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            return self.o_proj(y.transpose(1, 2).reshape(1, t, self.n_heads * self.head_dim).to(x.dtype))
        if isinstance(slot, int) and isinstance(at, int):
            end = at + t
            cache.write((slice(slot, slot + 1), slice(None), slice(at, end)), k, v)
            keys, values = cache.read((slice(slot, slot + 1), slice(None), slice(None, end)))
        elif isinstance(slot, torch.Tensor) and isinstance(at, torch.Tensor):
            cache.write((slot, slice(None), at), k[0].transpose(0, 1), v[0].transpose(0, 1))
            keys, values = cache.read((slot,))
        else:
            raise TypeError("slot and at are both ints or both tensors")
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(1, t, self.n_heads * self.head_dim).to(x.dtype))

    def require_cache(self) -> KVCache:
        """This layer's KV cache; AgentError before setup_caches."""
        if self.kv_cache is None:
            raise AgentError("the KV cache is not set up", hint="call Transformer.setup_caches first")
        return self.kv_cache

    def decode(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        rows: torch.Tensor,
        pos: torch.Tensor,
        kv_len: int | None,
    ) -> torch.Tensor:
        """One new position per row: x [B, 1, dim] for cache rows 0..B-1 at positions `pos` [B].

        With `kv_len` None every shape is fixed (the whole cache is attended, `mask` True where a
        key is hidden), so the step can be compiled and captured. Eager callers pass the keys in
        use (`kv_len`) and `mask` True where a key is seen (None: all), for torch's fused attention.
        """
        b = x.shape[0]
        cache = self.require_cache()
        q, k, v = self._rotated_qkv(x, cos, sin, cache.compute)
        cache.write((rows, slice(None), pos), k[:, :, 0], v[:, :, 0])
        # Only the positions attended are read (converted, where the cache is stored narrower).
        keys, values = cache.read((slice(None, b), slice(None), slice(None, kv_len)))
        if kv_len is not None:
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        elif mask is None:
            raise TypeError("a step over the whole cache needs its mask (Transformer.decode makes it)")
        else:
            # Grouped heads as a batched matmul on the cache itself: no repeated keys.
            group = self.n_heads // self.n_kv
            qg = q.reshape(b, self.n_kv, group, self.head_dim)
            scores, scale = torch.matmul(qg, keys.transpose(-1, -2)), self.head_dim**-0.5
            softmax = exact_ops.masked_softmax if self.exact else exact_ops.torch_masked_softmax
            y = torch.matmul(softmax(scores, mask, scale), values)
        return self.o_proj(y.reshape(b, 1, self.n_heads * self.head_dim).to(x.dtype))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate and up fused into `gate_up_proj` where possible."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=False)
        self.gate_up_proj: nn.Module | None = None
        self.exact = False  # silu(gate) * up through exact_ops (see Transformer.use_exact_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gated MLP."""
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj((exact_ops.silu_mul if self.exact else exact_ops.torch_silu_mul)(gate, up))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residual connections.

    `forward` is the decode step (fixed shapes: what gets compiled); `prefill` runs a prompt.
    Both take the block's input as the residual x plus the previous block's MLP output `pending`
    (zeros and the embeddings in the first block: Transformer._embed), and return theirs: each
    residual add happens in the norm after it (RMSNorm.add_norm), so on CUDA the add and the norm
    are one kernel, and every block runs the same compiled code.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(
        self,
        x: torch.Tensor,
        pending: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        rows: torch.Tensor,
        pos: torch.Tensor,
        kv_len: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of this block for cache rows 0..B-1 (see Attention.decode)."""
        x, normed = self.input_layernorm.add_norm(x, pending)
        attended = self.self_attn.decode(normed, cos, sin, mask, rows, pos, kv_len)
        h, normed = self.post_attention_layernorm.add_norm(x, attended)
        return h, self.mlp(normed)

    def prefill(
        self,
        x: torch.Tensor,
        pending: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        slot: int | torch.Tensor | None,
        at: int | torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This block over a prompt chunk of one slot, or of none (see Attention.prefill)."""
        x, normed = self.input_layernorm.add_norm(x, pending)
        attended = self.self_attn.prefill(normed, cos, sin, mask, slot, at)
        h, normed = self.post_attention_layernorm.add_norm(x, attended)
        return h, self.mlp(normed)


class Embedding(nn.Embedding):
    """Token embeddings whose rows come out in `out_dtype` (None: the table's), whatever the
    table's dtype: on a CPU the loader leaves the table as the artifact stores it, memory-mapped,
    so that only the rows looked up are resident (Llama-3-8B's fp16 table is 1.05 GB)."""

    out_dtype: torch.dtype | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The rows of `tokens`, in `out_dtype`."""
        rows = super().forward(tokens)
        return rows if self.out_dtype is None else rows.to(self.out_dtype)


class DecoderStack(nn.Module):
    """Embedding, blocks and final norm: the `model.` prefix of HF checkpoints."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)


class Transformer(nn.Module):
    """The whole network. Module names equal the checkpoint's, so tensors map one to one.

    The KV cache holds `slots` sequences. `prefill` runs one slot's prompt; `decode` advances
    cache rows 0..B-1 by one position each, with every position, mask and rotary angle computed
    on the device from a positions tensor, so it has the same shapes at every step.
    """

    # Buffers made by setup_caches.
    rope_cos: torch.Tensor
    rope_signed_sin: torch.Tensor  # sin with its first half negated (see _rope)
    key_positions: torch.Tensor
    rows: torch.Tensor

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = DecoderStack(args)
        self.lm_head: nn.Module = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.max_len = 0
        self.slots = 0

    def setup_caches(
        self, slots: int, max_len: int, device: torch.device, storage: str, compute: torch.dtype
    ) -> None:
        """Allocate the KV caches (`slots` x `max_len` positions, stored as `storage`, attended in
        `compute`: see KVCache) and the rotary tables (in `compute`: q and k turn in it)."""
        self.max_len, self.slots = max_len, slots
        a = self.args
        for layer in self._layers():
            cache = KVCache(slots, a.n_kv_heads, max_len, a.head_dim, storage, compute, device)
            layer.self_attn.kv_cache = cache
        cos, sin = rope_tables(a.head_dim, a.rope_theta, max_len + 1, device, a.rope_scaling)
        half = a.head_dim // 2
        sin[:, :half] = -sin[:, :half]  # see _rope
        self.register_buffer("rope_cos", cos.to(compute), persistent=False)
        self.register_buffer("rope_signed_sin", sin.to(compute), persistent=False)
        self.register_buffer("key_positions", torch.arange(max_len + 1, device=device), persistent=False)
        self.register_buffer("rows", torch.arange(slots, device=device), persistent=False)

    def use_exact_ops(self, on: bool) -> None:
        """Run RMSNorm (with the residual add before it), SiLU and the decode step's softmax
        through exact_ops (on) or torch's functions (off). Compiled with exact_ops.EMULATE_CASTS,
        the decode step then computes bit for bit what the eager one does. Off CUDA, eager
        results are the same either way; on CUDA the ops run fused Triton kernels, which round
        differently from torch's functions."""
        for module in self.modules():
            if isinstance(module, RMSNorm | Attention | MLP):
                module.exact = on

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype attention runs in (see KVCache)."""
        return self.rope_cos.dtype

    @property
    def kv_storage(self) -> str:
        """How the KV cache is stored: fp32, fp16, bf16 or int8 (see KVCache)."""
        return self._layers()[0].self_attn.require_cache().storage

    @property
    def scratch_position(self) -> int:
        """The cache position a row writes to when it takes no part in a decode step."""
        return self.max_len

    def prefill(self, tokens: torch.Tensor, slot: int, start: int, all_logits: bool = False) -> torch.Tensor:
        """Run tokens [1, T] of `slot` at positions start..start+T; logits [1, T or 1, V].

        Only the last position's logits are computed unless `all_logits` (tests, perplexity).
        """
        x, pending = self._blocks(tokens, slot, start)
        if not all_logits:
            x, pending = x[:, -1:], pending[:, -1:]
        return self._logits(x, pending)

    def copy_prefix(self, source: int, dest: int, length: int) -> None:
        """Copy cache positions 0..length-1 of slot `source` into slot `dest`, in every layer: a
        prompt that starts with what another slot holds skips that part of its prefill."""
        for layer in self._layers():
            layer.self_attn.require_cache().copy_prefix(source, dest, length)

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """The last hidden states [1, T, D] (after the final norm) of tokens [1, T] run from position
        0 outside the KV cache (embeddings: every slot's sequence is left as it was)."""
        return self.model.norm.add_norm(*self._blocks(tokens, None, 0))[1]

    def _blocks(
        self, tokens: torch.Tensor, slot: int | None, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last block's residual and MLP output (see DecoderLayer) over tokens [1, T]."""
        t = tokens.shape[1]
        if slot is not None and not 0 <= slot < self.slots:
            raise AgentError(f"slot {slot} does not exist (the cache holds {self.slots})")
        if start + t > self.max_len:
            raise AgentError(f"positions {start}..{start + t} exceed the KV cache ({self.max_len})")
        cos = self.rope_cos[start : start + t, None]
        sin = self.rope_signed_sin[start : start + t, None]
        # One mask for every layer, built only when some key must be hidden.
        window = self.args.sliding_window
        mask = None
        if t > 1 or (window and start + t > window):
            q_pos = torch.arange(start, start + t, device=tokens.device)
            mask = self._visible(q_pos, self.key_positions[: start + t])
        x, pending = self._embed(tokens)
        for layer in self._layers():
            x, pending = layer.prefill(x, pending, cos, sin, mask, slot, start)
        return x, pending

    def prefill_fixed(
        self, tokens: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor, last: torch.Tensor
    ) -> torch.Tensor:
        """`prefill` with fixed shapes and no host values, for a CUDA graph: tokens [1, T] of
        slot [1] at positions pos [T] (padding at `scratch_position`), attending the slot's whole
        cache; logits [1, V] of the token at index last [1]."""
        mask = self._visible(pos, self.key_positions)
        cos, sin = self.rope_cos[pos, None], self.rope_signed_sin[pos, None]
        x, pending = self._embed(tokens)
        for layer in self._layers():
            x, pending = layer.prefill(x, pending, cos, sin, mask, slot, pos)
        return self._logits(x.index_select(1, last), pending.index_select(1, last))[:, 0]

    def _embed(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first block's residual and pending sum (see DecoderLayer): zeros and the
        embeddings of `tokens`. Adding zeros is exact, and a None would give the first block a
        compiled code of its own, for each batch bucket."""
        embedded = self.model.embed_tokens(tokens)
        return torch.zeros_like(embedded), embedded

    def _logits(self, x: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the last block's residual x plus its MLP output `pending`: the head may
        compute in bf16, but bf16 logits tie more often, and an argmax over them took 165 us on a
        CPU against 30 us in fp32 (49k tokens)."""
        return self.lm_head(self.model.norm.add_norm(x, pending)[1]).float()

    def _visible(self, q_pos: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """[Q, K]: True where the query at q_pos [Q] sees the key at keys [K] (not after it, and
        inside the sliding window)."""
        visible = keys[None, :] <= q_pos[:, None]
        window = self.args.sliding_window
        if window:
            visible &= q_pos[:, None] - keys[None, :] < window
        return visible

    def _layers(self) -> list[DecoderLayer]:
        return [layer for layer in self.model.layers if isinstance(layer, DecoderLayer)]

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
        """Advance cache rows 0..B-1: tokens [B] at positions pos [B]; logits [B, V].

        `kv_len` None attends over the whole cache (fixed shapes: compile, CUDA graphs); eager
        callers pass max(pos) + 1 to attend only the positions in use. A row at
        `scratch_position` computes garbage and touches no real position.
        """
        b = tokens.shape[0]
        rows = self.rows[:b]
        cos = self.rope_cos[pos][:, None, None, :]
        sin = self.rope_signed_sin[pos][:, None, None, :]
        window = self.args.sliding_window
        keys = self.key_positions if kv_len is None else self.key_positions[:kv_len]
        mask: torch.Tensor | None
        if kv_len is None:
            mask = ~self._visible(pos, keys)[:, None, None, :]  # masked_fill hides where True
        elif b == 1 and not (window and kv_len > window):
            mask = None  # one row sees every key up to its own position
        else:
            mask = self._visible(pos, keys)[:, None, None, :]
        x, pending = self._embed(tokens[:, None])
        for layer in self._layers():
            x, pending = layer(x, pending, cos, sin, mask, rows, pos, kv_len)
        return self._logits(x, pending)[:, 0]


def rope_tables(
    head_dim: int, theta: float, max_len: int, device: torch.device, scaling: Llama3Rope | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_len, head_dim] of the rotary embedding (scaled as `scaling` says), in fp32."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    )
    if scaling is not None:
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    pos = torch.arange(max_len, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _llama3_inv_freq(inv_freq: torch.Tensor, s: Llama3Rope) -> torch.Tensor:
    """Llama 3's scaled inverse frequencies, computed as transformers does (same float ops)."""
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)
