"""A gpt-fast-style decoder for Llama, Qwen2 and Mistral checkpoints, batch size 1.

RMSNorm, rotary embeddings, grouped-query attention over a static KV cache, SwiGLU MLP. Prefill
(many tokens) and decode (one token) share one forward pass; `start` says where the tokens go in
the cache. The linear layers are plugged in from outside (`qlinear`), so the same module tree
runs fp32, bf16, int8 or int4 weights. The tree is built on the meta device and filled in by
the loader, so building it allocates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deployer.errors import AgentError, FormatError

# architecture name in config.json -> model_type it must carry
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}


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
    _refuse_rope_scaling(config, where)
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
        rope_theta=float(_rope_params(config).get("rope_theta", 10000.0)),
        max_position_embeddings=_field(config, "max_position_embeddings", int, where),
        sliding_window=int(window) if window else None,
        eos_token_ids=as_token_ids(config.get("eos_token_id")),
    )


def _field(config: dict[str, Any], key: str, kind: type, where: Path) -> Any:
    value = config.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise FormatError(f"{where}: config.json needs {key} as {kind.__name__}, found {value!r}")
    return value


def _rope_params(config: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes `rope_parameters`; older configs have top-level rope_theta/rope_scaling.
    params = dict(config.get("rope_parameters") or {})
    if "rope_theta" in config:
        params.setdefault("rope_theta", config["rope_theta"])
    return params


def _refuse_rope_scaling(config: dict[str, Any], where: Path) -> None:
    scaling = config.get("rope_scaling") or {}
    kinds = {scaling.get("rope_type") or scaling.get("type"), _rope_params(config).get("rope_type")}
    unknown = kinds - {None, "default"}
    if unknown:
        raise AgentError(
            f"{where}: rope scaling {sorted(unknown)} is not supported by the torch engine",
            hint="use a checkpoint without rope_scaling, or the llama.cpp engine",
        )


def as_token_ids(value: object) -> tuple[int, ...]:
    """An eos_token_id field (an int, a list of ints, or absent) as a tuple."""
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int))
    return ()


class RMSNorm(nn.Module):
    """Root-mean-square norm (torch's fused kernel: one op instead of six per call)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last dimension and scale."""
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class KVCache(nn.Module):
    """Preallocated keys and values for `max_len` positions of one sequence."""

    def __init__(self, n_kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        shape = (1, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v at positions start.. and return the cache up to the last written position."""
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions and a static KV cache."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.window = args.sliding_window
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int) -> torch.Tensor:
        """Attend the T new positions (start..start+T) to every cached position up to them."""
        _, t, _ = x.shape
        q = self.q_proj(x).view(1, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(1, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(1, t, self.n_kv, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values = self.kv_cache.update(start, k, v)
        mask = None
        if t > 1 or (self.window and keys.shape[2] > self.window):
            mask = _attention_mask(start, t, keys.shape[2], self.window, x.device)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(1, t, self.n_heads * self.head_dim))


def _attention_mask(
    start: int, t: int, n_keys: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """Boolean [t, n_keys]: query i (at start+i) sees key j when j <= start+i (and within window)."""
    q_pos = torch.arange(start, start + t, device=device)[:, None]
    k_pos = torch.arange(n_keys, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window:
        allowed &= q_pos - k_pos < window
    return allowed


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the gated MLP."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residual connections."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int) -> torch.Tensor:
        """One transformer block."""
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, start)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderStack(nn.Module):
    """Embedding, blocks and final norm: the `model.` prefix of HF checkpoints."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)


class Transformer(nn.Module):
    """The whole network. Module names equal the checkpoint's, so tensors map one to one."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = DecoderStack(args)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.max_len = 0

    def setup_caches(self, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the KV caches and the rotary tables for `max_len` positions."""
        self.max_len = max_len
        a = self.args
        for layer in self.model.layers:
            layer.self_attn.kv_cache = KVCache(a.n_kv_heads, max_len, a.head_dim, dtype).to(device)
        cos, sin = rope_tables(a.head_dim, a.rope_theta, max_len, device)
        self.register_buffer("rope_cos", cos.to(dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(dtype), persistent=False)

    def forward(self, tokens: torch.Tensor, start: int, all_logits: bool = False) -> torch.Tensor:
        """Run tokens [1, T] placed at positions start..start+T; return logits [1, T or 1, V].

        Only the last position's logits are computed unless `all_logits` (tests, perplexity).
        """
        t = tokens.shape[1]
        if start + t > self.max_len:
            raise AgentError(f"positions {start}..{start + t} exceed the KV cache ({self.max_len})")
        cos = self.rope_cos[start : start + t]
        sin = self.rope_sin[start : start + t]
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x, cos, sin, start)
        if not all_logits:
            x = x[:, -1:]
        return self.lm_head(self.model.norm(x))


def rope_tables(
    head_dim: int, theta: float, max_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_len, head_dim] of the default (unscaled) rotary embedding, in fp32."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    )
    pos = torch.arange(max_len, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()
