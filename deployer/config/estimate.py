"""How much memory the model needs on a device at its quantization (an estimate, for validation).

weights (parameters x bytes per parameter of each module's scheme, int4 with its per-group scale
and zero point) + KV cache (max_concurrent x max_tokens) + the engine's own overhead + the torch
engine's int4 draft where agent.draft asks for one + the LoRA adapters of `model.adapters`
(their factors as the engine holds them, at most the agent's adapter budget), with the weights (and
the draft) counted twice when new and old models are held side by side during a swap.
The shape comes from the source's config.json; the builtin demo model's shape is known
(SMOLLM2_SHAPE). The arithmetic the agent shares (KV cache, engine overhead, int8 head, draft) is
in deployer/core/memory.py.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from deployer.config.models import AgentSettings, ModelSpec, Quantization
from deployer.core.memory import (
    ADAPTER_BUDGET_MB,
    FLOAT_BYTES,
    SMOLLM2_SHAPE,
    ModelShape,
    draft_bytes,
    engine_bytes,
    int4_bytes,
    kv_bytes_per_position,
    linear_bytes,
    torch_cpu_tables_delta,
)

__all__ = [
    "SMOLLM2_SHAPE",
    "MemoryEstimate",
    "ModelShape",
    "auto_size_bounds",
    "draft_bytes",
    "estimate_memory",
    "resident_weight_bytes",
    "weight_bytes",
]

# Bytes a weight of llama.cpp's recipes (`gguf_type`), embeddings included: the main type's
# blocks, rounded up for the tensors each recipe keeps wider (Q6_K output head, some ffn_down)
# and for rows that are not whole K-quant blocks of 256 (SmolLM2's 576: Q4_K_M measured 5.5 bits).
_GGUF_TYPE_BYTES = {"Q4_K_M": 0.70, "Q5_K_M": 0.78, "Q6_K": 0.85, "Q8_0": 1.07}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device needs to serve the model, by component."""

    params: int
    weights: int
    kv_cache: int
    engine: int
    weight_copies: int
    draft: int = 0  # the torch engine's int4 draft model (agent.draft), with its one-sequence cache
    adapters: int = 0  # the loaded LoRA adapters, at most the agent's adapter budget

    @property
    def total(self) -> int:
        """Everything, with the weights and the draft counted once per copy held during a swap."""
        weights = (self.weights + self.draft) * self.weight_copies
        return weights + self.kv_cache + self.engine + self.adapters


def auto_size_bounds(shape: ModelShape, quantization: Quantization) -> tuple[int, int]:
    """The stored tensors' bytes of ``scheme: auto`` with every decoder linear it chooses for at
    int4-g128 (its smallest choice) and at int8 (its largest): the build's exact sizes for a model
    without biases (a bias adds its bytes to both), linears that an override names at theirs,
    embeddings fp16 and norms fp32 as the build stores them."""
    low = high = 2 * shape.embedding_params + (2 * shape.layers + 1) * shape.hidden * 4
    for module, (out_features, in_features) in _linears(shape).items():
        scheme, group = quantization.scheme_for(module)
        matched = any(fnmatch.fnmatchcase(module, o.pattern) for o in quantization.overrides)
        if matched:
            fixed = linear_bytes(scheme, group, out_features, in_features)
            low, high = low + fixed, high + fixed
        else:
            low += linear_bytes("int4", 128, out_features, in_features)
            high += linear_bytes("int8", None, out_features, in_features)
    return low, high


def _linears(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(out, in) of every decoder linear, by module name."""
    attention, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = {
        "self_attn.q_proj": (attention, shape.hidden),
        "self_attn.k_proj": (kv, shape.hidden),
        "self_attn.v_proj": (kv, shape.hidden),
        "self_attn.o_proj": (shape.hidden, attention),
        "mlp.gate_proj": (shape.intermediate, shape.hidden),
        "mlp.up_proj": (shape.intermediate, shape.hidden),
        "mlp.down_proj": (shape.hidden, shape.intermediate),
    }
    return {f"model.layers.{i}.{name}": dims for i in range(shape.layers) for name, dims in per_layer.items()}


def weight_bytes(shape: ModelShape, quantization: Quantization) -> int:
    """Bytes of the stored weights at ``quantization`` (see docs/artifact-format.md); for
    ``scheme: auto``, its bound: ``max_size``, or all it may choose at int8 when that is less."""
    if quantization.scheme == "auto" and quantization.max_size is not None:
        return min(quantization.max_size, auto_size_bounds(shape, quantization)[1])
    attention = _bytes_per_param(quantization, "model.layers.0.self_attn.q_proj")
    mlp = _bytes_per_param(quantization, "model.layers.0.mlp.up_proj")
    embedding = FLOAT_BYTES.get(quantization.scheme, 2.0)
    if quantization.gguf_type is not None:
        attention = mlp = embedding = _GGUF_TYPE_BYTES[quantization.gguf_type]
    total = (
        shape.embedding_params * embedding
        + shape.layers * (shape.attention_params * attention + shape.mlp_params * mlp)
        + (2 * shape.layers + 1) * shape.hidden * 4  # norms stay fp32
    )
    return int(total)


def _bytes_per_param(quantization: Quantization, module: str) -> float:
    scheme, group = quantization.scheme_for(module)
    if scheme == "int4":
        return int4_bytes(group)
    if scheme == "int8":
        return 1.0
    return FLOAT_BYTES[scheme]


def resident_weight_bytes(shape: ModelShape, quantization: Quantization, agent: AgentSettings) -> int:
    """Bytes the engine holds for the weights: the stored ones, except that the torch engine on a
    CPU runs the output head of an integer-quantized model on int8 weights it quantizes at load
    (loader._int8_head) and looks its float embedding up in the mapped file (torch_cpu_tables_delta)."""
    stored = weight_bytes(shape, quantization)
    integer = quantization.scheme in ("int8", "int4", "layered", "auto") or any(
        o.scheme in ("int8", "int4") for o in quantization.overrides
    )
    if agent.engine != "torch" or agent.device == "cuda" or not integer:
        return stored
    return stored + torch_cpu_tables_delta(shape, FLOAT_BYTES.get(quantization.scheme, 2.0))


def estimate_memory(
    shape: ModelShape, model: ModelSpec, agent: AgentSettings, *, adapter_bytes: int = 0
) -> MemoryEstimate:
    """The memory a device needs for ``model`` served with ``agent``'s settings, with LoRA adapters
    of `adapter_bytes` in all loaded (the agent unloads the least recently used past its budget, so
    they count at most ADAPTER_BUDGET_MB)."""
    kv_per_token = kv_bytes_per_position(shape, agent.engine, agent.kv_cache_type)
    kv_cache = kv_per_token * agent.max_tokens * agent.max_concurrent
    return MemoryEstimate(
        params=shape.params,
        weights=resident_weight_bytes(shape, model.quantization, agent),
        kv_cache=kv_cache,
        engine=engine_bytes(shape, agent.engine, kv_cache),
        weight_copies=2 if agent.swap_policy == "side-by-side" else 1,
        draft=draft_bytes(shape, kv_per_token * agent.max_tokens) if agent.draft != "off" else 0,
        adapters=min(adapter_bytes, int(ADAPTER_BUDGET_MB * 2**20)),
    )
