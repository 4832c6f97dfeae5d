"""A gpt-fast-style reference decode loop: what a careful hand-written loop gets from the same kernels.

The yardstick for our torch engine in bench/engine.py (CUDA). It borrows the loaded model's
weights and linear layers (so both run the very same matmul kernels, and no memory is spent on a
second copy) and does everything else its own way, as pytorch-labs/gpt-fast does: one static KV
cache [B, KV, L, hd] written with index_copy_ at a shared position, attention over the whole
cache with a causal-mask row (SDPA, keys repeated for grouped heads), every block torch.compiled,
and one decode step captured in a CUDA graph that feeds its argmax back and advances the
position on the device, so the host never waits inside the timed loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deployer.agent.engines.torch.loader import LoadedModel
from deployer.agent.engines.torch.model import MLP, DecoderLayer, RMSNorm, rope_tables


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RefBlock(nn.Module):
    """One transformer block over a static cache of `batch` sequences."""

    def __init__(self, layer: DecoderLayer, batch: int, max_len: int) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.n_heads, self.n_kv, self.head_dim = attn.n_heads, attn.n_kv, attn.head_dim
        self.attn, self.mlp = attn, mlp  # their projections (fused where the loader fused them)
        self.ln1, self.ln2 = layer.input_layernorm, layer.post_attention_layernorm
        weight = layer.input_layernorm.weight
        shape = (batch, self.n_kv, max_len, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=weight.dtype, device=weight.device))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=weight.dtype, device=weight.device))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        input_pos: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, T, D] at positions input_pos [T] (the same for every sequence)."""
        b, t, _ = x.shape
        h = _norm(self.ln1, x)
        q, k, v = (
            part.transpose(1, 2)
            for part in self.attn._heads(h).split((self.n_heads, self.n_kv, self.n_kv), dim=2)
        )
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        group = self.n_heads // self.n_kv
        keys = self.k_cache.repeat_interleave(group, dim=1)
        values = self.v_cache.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        x = x + self.attn.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
        return x + _mlp(self.mlp, _norm(self.ln2, x))


def _norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    # torch's own op, which inductor fuses, whatever the engine set on the module (use_exact_ops)
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)


def _mlp(mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    # the module's projections, torch's silu (as _norm: not what the engine set on the module)
    if mlp.gate_up_proj is not None:
        gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
    else:
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    return mlp.down_proj(F.silu(gate) * up)


class Reference(nn.Module):
    """The whole model for one batch size, greedy."""

    def __init__(self, loaded: LoadedModel, batch: int, max_len: int) -> None:
        super().__init__()
        model = loaded.model
        self.embed, self.norm, self.lm_head = model.model.embed_tokens, model.model.norm, model.lm_head
        self.blocks = nn.ModuleList(RefBlock(layer, batch, max_len) for layer in model.model.layers)
        a, dev = loaded.args, loaded.device
        cos, sin = rope_tables(a.head_dim, a.rope_theta, max_len, dev)
        self.register_buffer("cos", cos.to(loaded.dtype))
        self.register_buffer("sin", sin.to(loaded.dtype))
        self.register_buffer("causal", torch.ones(max_len, max_len, dtype=torch.bool, device=dev).tril())

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the last of tokens [B, T] placed at input_pos [T]."""
        mask = self.causal[None, None, input_pos]
        cos, sin = self.cos[input_pos], self.sin[input_pos]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin, mask, input_pos)
        return self.lm_head(_norm(self.norm, x[:, -1]))


@dataclass(frozen=True)
class RefResult:
    """Greedy tokens of sequence 0, first-token time, decode tokens/s (all sequences together)."""

    tokens: list[int]
    first_token_ms: float
    decode_tps: float


@torch.inference_mode()
def run(
    loaded: LoadedModel, prompts: torch.Tensor, new_tokens: int, max_len: int, repeats: int = 3
) -> RefResult:
    """Prefill prompts [B, T] (eager), then decode `new_tokens` greedily in a CUDA graph."""
    batch, t = prompts.shape
    ref = Reference(loaded, batch, max_len)
    dev = loaded.device
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:  # on a CPU (a smoke run of the bench) the loop runs eager
        for block in ref.blocks:
            block.compile(fullgraph=True)
    cur = torch.zeros((batch, 1), dtype=torch.long, device=dev)
    pos = torch.zeros(1, dtype=torch.long, device=dev)

    def step() -> None:
        nxt = ref(cur, pos).argmax(dim=-1, keepdim=True)
        cur.copy_(nxt)
        pos.add_(1)

    def prefill() -> float:
        sync()
        start = time.perf_counter()
        first = ref(prompts, torch.arange(t, device=dev)).argmax(dim=-1, keepdim=True)
        cur.copy_(first)
        pos.fill_(t)
        first.tolist()  # the first token is on the host: that is "first token"
        return time.perf_counter() - start

    prefill()
    replay = step
    if cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # compiles, then settles; writes only positions decoding rewrites
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        replay = graph.replay
    best_first, best_tps, tokens = float("inf"), 0.0, []
    for _ in range(repeats):
        best_first = min(best_first, prefill())
        out = [cur.clone()]
        sync()
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            replay()
            out.append(cur.clone())
        sync()
        best_tps = max(best_tps, batch * (new_tokens - 1) / (time.perf_counter() - start))
        tokens = torch.cat(out, dim=1)[0].tolist()
    return RefResult(tokens, best_first * 1000, best_tps)
