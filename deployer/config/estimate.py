"""How much memory the model needs on a device at its quantization (an estimate, for validation).

weights (parameters x bytes per parameter of each module's scheme, int4 with its per-group scale
and zero point) + KV cache (max_concurrent x max_tokens) + the engine's own overhead + the torch
engine's int4 draft where agent.draft asks for one, with the weights (and the draft) counted twice
when new and old models are held side by side during a swap.
The shape comes from the source's config.json; the builtin demo model's shape is known here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from deployer.config.models import AgentSettings, ModelSpec, Quantization

# Peak RSS beyond weights and KV cache, per engine: python and the libraries (llama.cpp: 168 MB
# in all, FACTS.md), and for torch the load's transients, which grow with the largest fused
# projection (its concatenated weights, the repacked copy and the fp32 probe of its kernel):
# 384 MiB + 8 bytes a parameter of it put bench/scale_load.py's measured peaks of Qwen2.5-1.5B and
# 3B shapes at int4 (2.27 and 3.71 GB) 9% and 1% under the estimate.
ENGINE_OVERHEAD = {"torch": 384 * 2**20, "llama.cpp": 128 * 2**20}
TORCH_LOAD_BYTES_PER_PARAM = 8
_FLOAT_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0}
# Bytes a weight of llama.cpp's recipes (`gguf_type`), embeddings included: the main type's
# blocks, rounded up for the tensors each recipe keeps wider (Q6_K output head, some ffn_down)
# and for rows that are not whole K-quant blocks of 256 (SmolLM2's 576: Q4_K_M measured 5.5 bits).
_GGUF_TYPE_BYTES = {"Q4_K_M": 0.70, "Q5_K_M": 0.78, "Q6_K": 0.85, "Q8_0": 1.07}


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-style decoder that decide its parameter count."""

    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool

    @classmethod
    def from_config_json(cls, path: Path) -> ModelShape:
        """Read the shape from an HF config.json; raises OSError, ValueError or KeyError."""
        raw = json.loads(path.read_text(encoding="utf-8"))
        heads = int(raw["num_attention_heads"])
        return cls(
            hidden=int(raw["hidden_size"]),
            intermediate=int(raw["intermediate_size"]),
            layers=int(raw["num_hidden_layers"]),
            vocab=int(raw["vocab_size"]),
            heads=heads,
            kv_heads=int(raw.get("num_key_value_heads", heads)),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            tied=bool(raw.get("tie_word_embeddings", False)),
        )

    @property
    def attention_params(self) -> int:
        """Parameters of one layer's q, k, v and o projections."""
        q_and_o = 2 * self.hidden * self.heads * self.head_dim
        return q_and_o + 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def mlp_params(self) -> int:
        """Parameters of one layer's gate, up and down projections."""
        return 3 * self.hidden * self.intermediate

    @property
    def embedding_params(self) -> int:
        """Token embeddings plus the output head unless it is tied to them."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def largest_projection(self) -> int:
        """Parameters of the largest matmul the torch engine runs: gate and up fused, or q, k and v."""
        return self.hidden * max(2 * self.intermediate, (self.heads + 2 * self.kv_heads) * self.head_dim)

    @property
    def params(self) -> int:
        """All parameters, norms included."""
        per_layer = self.attention_params + self.mlp_params + 2 * self.hidden
        return self.embedding_params + self.layers * per_layer + self.hidden


# SmolLM2-135M-Instruct's config.json, for `builtin:` sources that are not prepared yet.
SMOLLM2_SHAPE = ModelShape(
    hidden=576, intermediate=1536, layers=30, vocab=49152, heads=9, kv_heads=3, head_dim=64, tied=True
)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device needs to serve the model, by component."""

    params: int
    weights: int
    kv_cache: int
    engine: int
    weight_copies: int
    draft: int = 0  # the torch engine's int4 draft model (agent.draft), with its one-sequence cache

    @property
    def total(self) -> int:
        """Everything, with the weights and the draft counted once per copy held during a swap."""
        return (self.weights + self.draft) * self.weight_copies + self.kv_cache + self.engine


def weight_bytes(shape: ModelShape, quantization: Quantization) -> int:
    """Bytes of the stored weights at ``quantization`` (see docs/artifact-format.md)."""
    attention = _bytes_per_param(quantization, "model.layers.0.self_attn.q_proj")
    mlp = _bytes_per_param(quantization, "model.layers.0.mlp.up_proj")
    embedding = _FLOAT_BYTES.get(quantization.scheme, 2.0)
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
        return _int4_bytes(group)
    if scheme == "int8":
        return 1.0
    return _FLOAT_BYTES[scheme]


def _int4_bytes(group: int) -> float:
    return 0.5 + 3 / group  # two values a byte, plus an fp16 scale and a u8 zero per group


def resident_weight_bytes(shape: ModelShape, quantization: Quantization, agent: AgentSettings) -> int:
    """Bytes the engine holds for the weights: the stored ones, except that the torch engine on a
    CPU runs the output head of an integer-quantized model on int8 weights it quantizes at load
    (loader._int8_head), beside a tied embedding or instead of an untied float head."""
    stored = weight_bytes(shape, quantization)
    integer = quantization.scheme in ("int8", "int4", "layered") or any(
        o.scheme in ("int8", "int4") for o in quantization.overrides
    )
    if agent.engine != "torch" or agent.device == "cuda" or not integer:
        return stored
    head_float = shape.vocab * shape.hidden * _FLOAT_BYTES.get(quantization.scheme, 2.0)
    head_int8 = shape.vocab * (shape.hidden + 2)  # a byte a weight, an fp16 scale a row
    return int(stored + head_int8 - (0 if shape.tied else head_float))


def estimate_memory(shape: ModelShape, model: ModelSpec, agent: AgentSettings) -> MemoryEstimate:
    """The memory a device needs for ``model`` served with ``agent``'s settings."""
    # K and V per token: fp16 in llama.cpp; fp32 in the torch engine on a CPU, where its attention
    # is fastest in fp32 (half that on CUDA, so this errs on the safe side).
    kv_value_bytes = 4 if agent.engine == "torch" else 2
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * kv_value_bytes
    return MemoryEstimate(
        params=shape.params,
        weights=resident_weight_bytes(shape, model.quantization, agent),
        kv_cache=kv_per_token * agent.max_tokens * agent.max_concurrent,
        engine=ENGINE_OVERHEAD[agent.engine]
        + (TORCH_LOAD_BYTES_PER_PARAM * shape.largest_projection if agent.engine == "torch" else 0),
        weight_copies=2 if agent.swap_policy == "side-by-side" else 1,
        draft=draft_bytes(shape, kv_per_token * agent.max_tokens) if agent.draft != "off" else 0,
    )


def draft_bytes(shape: ModelShape, kv_cache: int) -> int:
    """The int4 draft the torch engine makes at load (loader.load_draft): its projections in
    int4-g32, an int8 head, the embedding in bf16 and `kv_cache` bytes for its one sequence."""
    projections = shape.layers * (shape.attention_params + shape.mlp_params) * _int4_bytes(32)
    embedding = shape.vocab * shape.hidden
    return int(projections + embedding * (2 + 1) + kv_cache)
