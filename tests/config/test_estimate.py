"""validate's memory estimate on real shapes, and the swap policy it foresees."""

from __future__ import annotations

import dataclasses

from deployer.agent.settings import AgentSettings as AgentSettingsOnDevice
from deployer.config import load_config, validate_file
from deployer.config.estimate import (
    SMOLLM2_SHAPE,
    ModelShape,
    estimate_memory,
    resident_weight_bytes,
    weight_bytes,
)
from deployer.config.models import AgentSettings, ModelSpec, Quantization
from deployer.core.memory import engine_bytes

# Qwen2.5-3B's and Llama-3-8B's config.json, as far as the estimate reads them.
QWEN25_3B = ModelShape(
    hidden=2048, intermediate=11008, layers=36, vocab=151936, heads=16, kv_heads=2, head_dim=128, tied=True
)
LLAMA3_8B = dataclasses.replace(
    QWEN25_3B, hidden=4096, intermediate=14336, layers=32, vocab=128256, heads=32, kv_heads=8, tied=False
)


def _resident(shape: ModelShape, scheme: str, **agent: str) -> int:
    return resident_weight_bytes(shape, Quantization(scheme=scheme), AgentSettings(**agent))


def test_the_torch_engine_on_a_cpu_holds_an_int8_head_and_maps_the_embedding() -> None:
    stored = weight_bytes(QWEN25_3B, Quantization(scheme="int4"))
    fp16_table = QWEN25_3B.vocab * QWEN25_3B.hidden * 2
    # Tied: the fp16 embedding is looked up in the mapped file (not counted), and the head is an
    # int8 copy of it (a byte a weight, an fp16 scale a row).
    assert _resident(QWEN25_3B, "int4") == stored - fp16_table + QWEN25_3B.vocab * (QWEN25_3B.hidden + 2)
    # Untied: the stored fp16 head is replaced by its int8 copy; the embedding is mapped too.
    both_fp16_tables = 2 * LLAMA3_8B.vocab * LLAMA3_8B.hidden * 2
    assert _resident(LLAMA3_8B, "int4") == (
        weight_bytes(LLAMA3_8B, Quantization(scheme="int4")) - both_fp16_tables + LLAMA3_8B.vocab * 4098
    )
    # Float models, llama.cpp and CUDA keep the stored head.
    assert _resident(QWEN25_3B, "bf16") == weight_bytes(QWEN25_3B, Quantization(scheme="bf16"))
    assert _resident(QWEN25_3B, "int4", engine="llama.cpp") == stored
    assert _resident(QWEN25_3B, "int4", device="cuda") == stored


def test_an_8b_int4_model_with_4_slots_of_2048_is_about_its_measured_size() -> None:
    model = ModelSpec(name="m", version="1.0.0", source=".", quantization=Quantization(scheme="int4"))
    agent = AgentSettings(max_concurrent=4, max_tokens=2048)
    estimate = estimate_memory(LLAMA3_8B, model, agent)
    # int4-g128 projections 3.66 GB, int8 head 0.53 GB (the fp16 embedding stays in the file);
    # fp32 KV 2.15 GB.
    assert 4.1e9 < estimate.weights < 4.3e9
    assert estimate.kv_cache == 2 * 32 * 8 * 128 * 4 * 2048 * 4
    # Python, torch and the server, and 1/16 byte a projection parameter; the load's transients (8 bytes a
    # parameter of the fused gate and up projection, 4096 x 28672 = 0.94 GB) come before the KV
    # cache is allocated, which outgrows them.
    projections = 32 * (LLAMA3_8B.attention_params + LLAMA3_8B.mlp_params)
    assert estimate.engine == 384 * 2**20 + projections // 16
    # bench/scale_load.py measured 7.08 GB, steady and peak: within 10 %.
    assert 7.08e9 < estimate.total < 7.08e9 * 1.1
    llama_cpp = estimate_memory(LLAMA3_8B, model, agent.model_copy(update={"engine": "llama.cpp"}))
    assert llama_cpp.engine == 128 * 2**20


def test_an_8b_int4_model_with_an_int8_kv_cache_fits_its_measured_peak() -> None:
    model = ModelSpec(name="m", version="1.0.0", source=".", quantization=Quantization(scheme="int4"))
    agent = AgentSettings(max_concurrent=4, max_tokens=2048, kv_cache_type="int8")
    estimate = estimate_memory(LLAMA3_8B, model, agent)
    # A byte a value and an fp32 scale per position and head: 0.55 GB for 4 x 2,048 positions.
    assert estimate.kv_cache == 2 * 32 * 8 * (128 + 4) * 2048 * 4
    # bench/scale_load.py measured a 5.35 GB peak (5.13 GB steady): the estimate stays above it,
    # by the load transients of the fused gate and up projection it counts beyond so small a cache.
    assert 5.35e9 < estimate.total < 5.35e9 * 1.15


def test_the_torch_loads_transients_count_where_the_kv_cache_does_not_cover_them() -> None:
    transients = 8 * 4096 * 28672
    kv_per_position = 2 * 32 * 8 * 128 * 4
    short = 2048  # one slot: 0.54 GB of KV cache, under the transients
    base = engine_bytes(LLAMA3_8B, "torch", 10 * transients)
    assert (
        engine_bytes(LLAMA3_8B, "torch", short * kv_per_position)
        == base + transients - short * kv_per_position
    )
    assert engine_bytes(LLAMA3_8B, "torch", transients) == base
    # llama.cpp reads its weights once (repacked, not beside a mapped copy): a fixed overhead.
    assert (
        engine_bytes(LLAMA3_8B, "llama.cpp", 0) == engine_bytes(LLAMA3_8B, "llama.cpp", 10**9) == 128 * 2**20
    )


def test_validate_warns_where_only_an_unload_first_swap_fits(write_config) -> None:
    config = load_config(write_config(), environ={})
    estimate = estimate_memory(SMOLLM2_SHAPE, config.model, config.agent)
    two = dataclasses.replace(estimate, weight_copies=2).total
    between = f"memory: {(estimate.total + two) // 2 // 2**20}Mi"
    tight = write_config(replace=(("memory: 4Gi", between),))
    [warning] = [f for f in validate_file(tight, {}) if f.path == "agent.swap_policy" or "swap" in f.message]
    assert (
        warning.severity == "warning" and "unload-first" in warning.message and "'small'" in warning.message
    )
    # Said explicitly, or with room for two copies, nothing to warn about.
    chosen = write_config(replace=(("memory: 4Gi", between),), append="agent:\n  swap_policy: unload-first\n")
    roomy = write_config(replace=(("memory: 4Gi", f"memory: {two // 2**20 + 1}Mi"),))
    for path in (chosen, roomy):
        assert not [f for f in validate_file(path, {}) if "swap" in f.message]


def test_loaded_adapters_count_at_most_the_agents_adapter_budget() -> None:
    model = ModelSpec(name="m", version="1.0.0", source=".", quantization=Quantization(scheme="int8"))
    bare = estimate_memory(SMOLLM2_SHAPE, model, AgentSettings())
    small = estimate_memory(SMOLLM2_SHAPE, model, AgentSettings(), adapter_bytes=3 * 2**20)
    assert (small.adapters, small.total - bare.total) == (3 * 2**20, 3 * 2**20)
    # Past the budget the agent unloads the least recently used: never more than 256 MiB loaded.
    many = estimate_memory(SMOLLM2_SHAPE, model, AgentSettings(), adapter_bytes=5 * 2**30)
    assert many.adapters == 256 * 2**20 == AgentSettingsOnDevice().adapter_memory_mb * 2**20
