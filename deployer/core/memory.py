"""The arithmetic of a served model's memory, shared by validate's estimate (deployer/config/
estimate.py, from deploy.yaml's quantization) and the agent's hot-swap policy (from the artifact
it is about to load): the shape's parameters, the KV cache, the engine's overhead and load
transients, the torch engine's int8 head, mapped embedding and int4 draft, and loaded LoRA
adapters (their budget, and their factors as the engine holds them). Imports nothing outside
deployer/core, so the agent can import it.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass
from pathlib import Path

from deployer.core.gguf_io import GGUFHeader

__all__ = [
    "ADAPTER_BUDGET_MB",
    "ENGINE_OVERHEAD",
    "FLOAT_BYTES",
    "SMOLLM2_SHAPE",
    "TORCH_BYTES_PER_PROJECTION_PARAM",
    "TORCH_LOAD_BYTES_PER_PARAM",
    "ModelShape",
    "draft_bytes",
    "engine_bytes",
    "int4_bytes",
    "kv_bytes_per_position",
    "linear_bytes",
    "lora_bytes",
    "release_freed_heap",
    "torch_cpu_tables_delta",
]

# RSS beyond weights and KV cache, per engine, at the load's peak: python and the libraries
# (llama.cpp: 168 MB in all, FACTS.md; it reads the weights into its own buffers, see
# engines/llamacpp/engine.py). The torch engine's load ends by allocating the KV cache, so its
# peak is its steady state unless the transients of its largest fused projection (concatenated
# weights, the kernel's repacked copy, the fp32 probe: 8 bytes a parameter of it) outgrow the KV
# cache; beyond python, torch and the agent's server (384 MiB; the bench's bare loads held 224 MiB
# after importing torch) its CPU kernels' layouts and the allocator keep what bench/scale_load.py
# measured as 0.38-0.48, 0.70 and 0.76 GB beside the int4-g128 Qwen2.5-1.5B, 3B and Llama-3-8B
# shapes (4 slots of 2,048 positions): 1/16 of a byte a projection parameter puts the estimate
# within 6 % of their peaks (1.77-1.87, 3.07 and 7.08 GB).
ENGINE_OVERHEAD = {"torch": 384 * 2**20, "llama.cpp": 128 * 2**20}
TORCH_BYTES_PER_PROJECTION_PARAM = 1 / 16
TORCH_LOAD_BYTES_PER_PARAM = 8
FLOAT_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0}  # a parameter of each float scheme
# The agent's default budget for loaded LoRA adapters (agent.yaml's adapter_memory_mb): past it the
# least recently used one unloads, so the adapters never hold more.
ADAPTER_BUDGET_MB = 256.0
# A loaded adapter's factors are fp32 on the engine (the torch engine's low-rank path runs in fp32
# beside the base's layers), whatever the artifact's fp16.
_LORA_FACTOR_BYTES = 4


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

    @classmethod
    def from_gguf(cls, header: GGUFHeader) -> ModelShape:
        """Read the shape from a GGUF's metadata (llama.cpp's `<architecture>.` keys, as the GGUF
        export writes them); raises KeyError naming a key that is missing."""
        arch = header.string("general.architecture") or "llama"

        def value(key: str) -> int:
            found = header.integer(f"{arch}.{key}")
            if found is None:
                raise KeyError(f"{header.path}: no {arch}.{key} in its metadata")
            return found

        hidden, heads = value("embedding_length"), value("attention.head_count")
        tokens = header.metadata.get("tokenizer.ggml.tokens")
        vocab = header.integer(f"{arch}.vocab_size") or (len(tokens) if isinstance(tokens, list) else None)
        if vocab is None:
            raise KeyError(f"{header.path}: no {arch}.vocab_size nor tokenizer.ggml.tokens in its metadata")
        return cls(
            hidden=hidden,
            intermediate=value("feed_forward_length"),
            layers=value("block_count"),
            vocab=vocab,
            heads=heads,
            kv_heads=header.integer(f"{arch}.attention.head_count_kv") or heads,
            head_dim=header.integer(f"{arch}.attention.key_length") or hidden // heads,
            tied="output.weight" not in header.by_name(),  # llama.cpp reuses token_embd then
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


def int4_bytes(group: int) -> float:
    """Bytes a parameter of int4 with groups of `group`: two values a byte, plus an fp16 scale
    and a u8 zero point per group."""
    return 0.5 + 3 / group


def linear_bytes(scheme: str, group: int | None, out_features: int, in_features: int) -> int:
    """Exact stored bytes of one linear's weight under `scheme` (docs/artifact-format.md): int4
    packs two values a byte over columns padded to whole groups, with an fp16 scale and an fp16
    zero point per group; int8 a byte a weight and an fp16 scale a row; float schemes their width.
    The build's plans store exactly this (`quantize.plan_tensor`), and validate's bounds of
    `scheme: auto` count it."""
    if scheme == "int4":
        if group is None:
            raise ValueError("int4 needs a group size")
        groups = -(-in_features // group)
        return out_features * (groups * group // 2 + 4 * groups)
    if scheme == "int8":
        return out_features * (in_features + 2)
    return int(out_features * in_features * FLOAT_BYTES[scheme])


def kv_bytes_per_position(shape: ModelShape, engine: str, kv_cache_type: str = "auto") -> int:
    """K and V of one position of one sequence: fp16 in llama.cpp; in the torch engine as
    agent.kv_cache_type stores them, auto being fp32 (on a CPU, where its attention is fastest in
    fp32; half that on CUDA, so this errs on the safe side) and int8 a byte a value plus an fp32
    scale per head."""
    values = 2 * shape.layers * shape.kv_heads * shape.head_dim
    if engine != "torch":
        return values * 2
    if kv_cache_type == "int8":
        return values + 2 * shape.layers * shape.kv_heads * 4
    return values * (2 if kv_cache_type in ("fp16", "bf16") else 4)


def engine_bytes(shape: ModelShape, engine: str, kv_cache: int) -> int:
    """The engine's overhead beyond weights and a KV cache of `kv_cache` bytes at its load's peak
    (ENGINE_OVERHEAD; for torch, a share per projection parameter and the part of its largest
    fused projection's load transients that the KV cache, allocated after them, does not cover)."""
    if engine != "torch":
        return ENGINE_OVERHEAD[engine]
    projections = shape.layers * (shape.attention_params + shape.mlp_params)
    transients = TORCH_LOAD_BYTES_PER_PARAM * shape.largest_projection
    kept = int(TORCH_BYTES_PER_PROJECTION_PARAM * projections)
    return ENGINE_OVERHEAD[engine] + kept + max(0, transients - kv_cache)


def torch_cpu_tables_delta(shape: ModelShape, stored_float_bytes_per_param: float) -> int:
    """What the torch engine on a CPU holds of an integer-quantized model's embedding and output
    head, beyond their stored bytes (`stored_float_bytes_per_param` a parameter: negative). It
    runs the head on int8 weights it quantizes at load (loader._int8_head), in place of an untied
    float head or beside a tied embedding, and looks the embedding's rows up in the mapped
    artifact: only the rows of the tokens it reads are resident, clean file pages the kernel
    reclaims before it kills anything, so none are counted."""
    head_int8 = shape.vocab * (shape.hidden + 2)  # a byte a weight, an fp16 scale a row
    return int(head_int8 - shape.embedding_params * stored_float_bytes_per_param)


def lora_bytes(factor_elements: int) -> int:
    """What a loaded adapter of `factor_elements` values (all its A and B factors) holds."""
    return factor_elements * _LORA_FACTOR_BYTES


def draft_bytes(shape: ModelShape, kv_cache: int) -> int:
    """The int4 draft the torch engine makes at load (loader.load_draft): its projections in
    int4-g32, an int8 head, the embedding in bf16 and `kv_cache` bytes for its one sequence."""
    projections = shape.layers * (shape.attention_params + shape.mlp_params) * int4_bytes(32)
    embedding = shape.vocab * shape.hidden
    return int(projections + embedding * (2 + 1) + kv_cache)


def release_freed_heap() -> None:
    """Hand the memory of freed transients (a model load's, a build's) back to the system: glibc
    keeps freed blocks below its mmap threshold (which grows to 32 MiB as large blocks come and go)
    in its heap, where they count in the RSS: 0.20 GB of Llama-3-8B int4's 5.33 GB on the agent
    (bench/scale_load.py). Nothing where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
