"""GPU rows of bench/engine.py: our torch engine against the gpt-fast-style reference loop
(bench/gptfast_ref.py) on random weights in two shapes, in one process per row.

Weights are seeded per tensor (normal, std 0.02; norms near 1), made on the GPU and moved to
host memory, which the engine loads them from as it loads an artifact's mapped files; int8 and
int4 (group 32) go through the builder's own quantizers, so the engine loads exactly what an
artifact would hold. Each row measures, best of `repeats`:

* first token: prefill of a 32-token prompt plus the first sampled token on the host;
* batch 1: decode tokens/s over `NEW_TOKENS` greedy tokens, step by step through `step([0])`;
* batch 16: aggregate tokens/s of 16 slots stepped together;
* peak GPU memory while serving (after the engine is ready), against the weights plus the KV
  cache; the peak while it loads (moves and repacks weights, probes kernels, compiles, tunes and
  captures), with how many kernel timings inductor's autotuner ran; and the peak of a second
  engine on the same model ("warm load"), whose kernels are compiled and tuned already, as a
  restart finds them in inductor's and Triton's on-disk caches;
* exactness: how many of the greedy tokens equal the eager engine's (no compile, no graphs), and
  whether slot 0 of the batch of 16 gave the same tokens as alone. Random weights make nearly
  flat logits, where a different summation order flips near-ties, so each row also reports the
  worst gap, teacher-forced on our tokens, between the eager engine's best logit and its logit
  for the token we chose (0 where they agree; a wrong cache or mask shows as gaps near 1).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from deployer.agent.engines.base import common_prefix
from deployer.agent.engines.torch.engine import TorchEngine

NEW_TOKENS = 128
PROMPT_TOKENS = 32
BATCH = 16
MAX_LEN = 256
COPY_BYTES = 1 << 30  # the bandwidth probe: a device-to-device copy of this many bytes

SHAPES = {
    "SmolLM2-135M": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
    },
    "Qwen2.5-1.5B": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "eos_token_id": 151645,
    },
    "Qwen2.5-3B": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "eos_token_id": 151645,
    },
    # Llama 3's rope scaling changes no cost: left out, as the speed rows need only the shape.
    "Llama-3-8B": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "eos_token_id": 128009,
    },
}
# A smoke test of this file on a CPU: --device cpu --shapes tiny.
SHAPES["tiny"] = SHAPES["SmolLM2-135M"] | {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
}
SHAPES["tiny"] |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
SCHEMES = ("bf16", "int4-g32", "int8", "fp32")
# fp32 is for exactness (no bf16 rounding to flip near-ties), not speed: run it by name.
DEFAULT_SCHEMES = SCHEMES[:3]


def random_checkpoint(config: dict, scheme: str, device: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Seeded random tensors under HF names, quantized as `scheme`; and the module layouts."""
    from deployer.core.quant_layout import ModuleQuant, quantize_int4, quantize_int8

    c = config
    dim, inter, hd = (
        c["hidden_size"],
        c["intermediate_size"],
        c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
    )
    q_out, kv_out = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    linears = {
        "self_attn.q_proj": (q_out, dim),
        "self_attn.k_proj": (kv_out, dim),
        "self_attn.v_proj": (kv_out, dim),
    }
    linears |= {"self_attn.o_proj": (dim, q_out), "mlp.gate_proj": (inter, dim), "mlp.up_proj": (inter, dim)}
    linears["mlp.down_proj"] = (dim, inter)
    tensors, modules, seed = {}, {}, 0

    def randn(*shape: int) -> torch.Tensor:
        nonlocal seed
        seed += 1
        gen = torch.Generator(device=device).manual_seed(seed)
        return torch.randn(shape, generator=gen, device=device) * 0.02

    dtype = torch.float32 if scheme == "fp32" else torch.bfloat16
    tensors["model.embed_tokens.weight"] = randn(c["vocab_size"], dim).to(dtype)
    if not c["tie_word_embeddings"]:
        tensors["lm_head.weight"] = randn(c["vocab_size"], dim).to(dtype)
    tensors["model.norm.weight"] = (1 + randn(dim)).to(dtype)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = (1 + randn(dim)).to(dtype)
        tensors[p + "post_attention_layernorm.weight"] = (1 + randn(dim)).to(dtype)
        for name, (n_out, n_in) in linears.items():
            w = randn(n_out, n_in)
            if c["model_type"] == "qwen2" and name in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
            ):
                tensors[p + name + ".bias"] = randn(n_out).to(dtype)
            if scheme in ("bf16", "fp32"):
                tensors[p + name + ".weight"] = w.to(dtype)
            elif scheme == "int8":
                q, scale = quantize_int8(w)
                tensors[p + name + ".weight"], tensors[p + name + ".weight_scale"] = q, scale
                modules[p + name] = ModuleQuant("int8", None, n_in, n_in, n_out)
            else:
                packed, scale, zero = quantize_int4(w, 32)
                tensors[p + name + ".weight"] = packed
                tensors[p + name + ".weight_scale"], tensors[p + name + ".weight_zero"] = scale, zero
                modules[p + name] = ModuleQuant("int4", 32, n_in, scale.shape[1] * 32, n_out)
    return tensors, modules


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_peak() -> int:
    """The peak GPU memory allocated since the last call (0 on a CPU), and start anew."""
    if not torch.cuda.is_available():
        return 0
    _sync()
    peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    return peak


def _worst_gap(eager: TorchEngine, prompt: list[int], tokens: list[int]) -> float:
    """Teacher-forced on `tokens`: the largest gap between the eager engine's best logit and its
    logit for the token in `tokens` (0 when every token is the eager argmax)."""
    logits = eager.logits(prompt + tokens)[len(prompt) - 1 : -1]
    chosen = logits[torch.arange(len(tokens)), torch.tensor(tokens)]
    return float((logits.max(dim=-1).values - chosen).max())


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy of COPY_BYTES (read and written), best of 5: the
    memory-bound limit's yardstick, measured on the card in use (4.28e12 on the H200)."""
    x = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    best = min(_timed(y.copy_, x) for _ in range(6))
    del x, y
    return 2 * COPY_BYTES / best


def _timed(fn: Callable[..., object], *args: object) -> float:
    _sync()
    start = time.perf_counter()
    fn(*args)
    _sync()
    return time.perf_counter() - start


def _steps(engine: TorchEngine, slots: list[int], n: int) -> None:
    for _ in range(n):
        engine.step(slots)


def _greedy_run(
    engine: object, slots: list[int], prompts: list[list[int]], params: object
) -> list[list[int]]:
    """Greedy tokens of each prompt, each prefilled whole. A slot that still held its prompt would
    reuse all but the last token and run that one through a decode step, whose bf16 sums differ
    from the prefill's: the first token could then differ from a fresh engine's."""
    for s in slots:
        engine.prefill(s, [1], params)  # shares no prefix with any prompt (their ids are >= 3)
    out = [[engine.prefill(s, p, params)] for s, p in zip(slots, prompts, strict=True)]
    for _ in range(NEW_TOKENS - 1):
        for seq, token in zip(out, engine.step(slots), strict=True):
            seq.append(token)
    return out


def _tuning_runs() -> int:
    """How many kernel timings inductor's autotuner has run in this process so far."""
    from torch._dynamo.utils import counters

    return sum(n for key, n in counters["inductor"].items() if key.endswith(".benchmark_gpu"))


def gpu_worker(shape: str, scheme: str, repeats: int, device: str = "cuda") -> dict:
    """One row: build the random model, run our engine, the eager one, then the reference."""
    from bench import gptfast_ref
    from deployer.agent.engines.torch.loader import ArtifactFacts, MemoryWeights, build_model
    from deployer.agent.types import SamplingParams

    config = SHAPES[shape]
    tensors, modules = random_checkpoint(config, scheme, device)
    # Made on the device (fast), loaded from host memory as an artifact's mapped files are: the
    # load-time peak is then the engine's own (loader probes, repacking, compile, tuning, capture).
    tensors = {name: t.cpu() for name, t in tensors.items()}
    facts = ArtifactFacts(shape, "random", scheme, modules)
    compute = "fp32" if scheme == "fp32" else "bf16"
    _reset_peak()
    tuned = _tuning_runs()
    started = time.perf_counter()
    loaded = build_model(
        config,
        MemoryWeights(tensors),
        facts,
        Path(shape),
        device=device,
        dtype=compute,
        max_context=MAX_LEN,
        slots=BATCH,
    )
    del tensors
    engine = TorchEngine(device=device, slots=BATCH, max_context=MAX_LEN, graph_buckets=(1, BATCH))
    engine.attach(loaded)
    load_s = time.perf_counter() - started
    load_peak = _reset_peak()
    tuned = _tuning_runs() - tuned
    caches = [layer.self_attn.kv_cache for layer in loaded.model.model.layers]
    kv_bytes = sum(c.k.nbytes + c.v.nbytes for c in caches)
    state = {t.data_ptr(): t.nbytes for t in (*loaded.model.parameters(), *loaded.model.buffers())}
    weight_bytes = sum(state.values()) - kv_bytes
    # Bytes a decode step must read: every weight but the embedding (one row of it is read).
    embed = loaded.model.model.embed_tokens.weight
    tied = (
        loaded.model.lm_head.weight.data_ptr() == embed.data_ptr()
        if hasattr(loaded.model.lm_head, "weight")
        else False
    )
    step_bytes = weight_bytes - (0 if tied else embed.nbytes)

    gen = torch.Generator().manual_seed(1234)
    vocab = config["vocab_size"]
    prompts = [torch.randint(3, vocab, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(BATCH)]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)

    info = engine.describe()
    first_ms, tps1, tps16 = float("inf"), 0.0, 0.0
    everyone = list(range(BATCH))
    for r in range(repeats):
        # A new first token each time, so prefix reuse does not shorten the prefill.
        fresh = [r + 3, *prompts[0][1:]]
        first_ms = min(first_ms, 1000 * _timed(engine.prefill, 0, fresh, greedy))
        engine.prefill(0, prompts[0], greedy)
        tps1 = max(tps1, (NEW_TOKENS - 1) / _timed(_steps, engine, [0], NEW_TOKENS - 1))
    ours = _greedy_run(engine, [0], prompts[:1], greedy)[0]
    for _ in range(repeats):
        for s in everyone:
            engine.prefill(s, prompts[s], greedy)
        tps16 = max(tps16, BATCH * (NEW_TOKENS - 1) / _timed(_steps, engine, everyone, NEW_TOKENS - 1))
    batched = _greedy_run(engine, list(range(BATCH)), prompts, greedy)[0]
    peak = _reset_peak()
    del engine
    # A second engine on the same model finds the layers compiled and the kernels tuned, as a
    # restart finds them in inductor's and Triton's on-disk caches: its peak has no tuning in it.
    again = TorchEngine(device=device, slots=BATCH, max_context=MAX_LEN, graph_buckets=(1, BATCH))
    again.attach(loaded)
    warm_peak = _reset_peak()
    del again

    eager = TorchEngine(device=device, slots=BATCH, max_context=MAX_LEN, compile="off", cuda_graphs=False)
    eager.attach(loaded)
    eager_tokens = _greedy_run(eager, [0], prompts[:1], greedy)[0]

    started = time.perf_counter()
    ref1 = gptfast_ref.run(loaded, torch.tensor(prompts[:1], device=device), NEW_TOKENS, MAX_LEN, repeats)
    ref16 = gptfast_ref.run(loaded, torch.tensor(prompts, device=device), NEW_TOKENS, MAX_LEN, repeats)
    ref_s = time.perf_counter() - started
    # Last: the teacher-forced runs overwrite slot 0's cache.
    gap, batched_gap = _worst_gap(eager, prompts[0], ours), _worst_gap(eager, prompts[0], batched)
    return {
        "shape": shape,
        "scheme": scheme,
        "kernel": info.kernel,
        "decode": info.extra["decode"],
        "compile": info.extra["compile"],
        "fused_ops": info.extra["fused_ops"],
        "load_s": load_s,
        "ref_s": ref_s,
        "prefill": info.extra["prefill"],
        "first_ms": first_ms,
        "tps1": tps1,
        "tps16": tps16,
        "ref_first_ms": ref1.first_token_ms,
        "ref_tps1": ref1.decode_tps,
        "ref_tps16": ref16.decode_tps,
        "limit_tps": (copy_bandwidth() if device == "cuda" else float("nan")) / step_bytes,
        "peak_mb": peak / 2**20,
        "load_peak_mb": load_peak / 2**20,
        "warm_load_peak_mb": warm_peak / 2**20,
        "tuning_runs": tuned,
        "l2_mb": torch.cuda.get_device_properties().L2_cache_size / 2**20
        if torch.cuda.is_available()
        else 0.0,
        "budget_mb": (weight_bytes + kv_bytes) * 1.2 / 2**20,
        "weights_mb": weight_bytes / 2**20,
        "kv_mb": kv_bytes / 2**20,
        "same_as_eager": common_prefix(ours, eager_tokens),
        "gap": gap,
        "batched_gap": batched_gap,
        "same_as_ref": common_prefix(ours, ref1.tokens),
        "batched_same": common_prefix(batched, ours),
    }


def gpu_table(rows: list[dict], errors: list[tuple[str, str]], device: str) -> object:
    """The rich table of the GPU rows, measured on `device` (its name)."""
    from rich.table import Table

    table = Table(
        title=f"{device}, random weights, greedy, {PROMPT_TOKENS}-token prompt, {NEW_TOKENS} new tokens, "
        f"cache {MAX_LEN}; ref = gpt-fast-style loop (bench/gptfast_ref.py), same kernels, same run"
    )
    columns = (
        "shape",
        "weights",
        "kernel",
        "b1 tok/s",
        "ref b1",
        "x ref",
        "b16 tok/s",
        "ref b16",
        "b16/b1",
        "1st tok ms",
        "ref 1st",
        "limit tok/s",
        "peak MB",
        "W+KV+20%",
        "load peak",
        "warm load",
        "tunings",
        "=eager",
        "gap",
        "=ref",
        "batch=alone",
        "gap b16",
        "load s",
    )
    for c in columns:
        table.add_column(c, justify="left" if c in ("shape", "weights", "kernel") else "right")
    for r in rows:
        table.add_row(
            r["shape"],
            r["scheme"],
            r["kernel"].removeprefix("aten."),
            f"{r['tps1']:.0f}",
            f"{r['ref_tps1']:.0f}",
            f"{r['tps1'] / r['ref_tps1']:.2f}",
            f"{r['tps16']:.0f}",
            f"{r['ref_tps16']:.0f}",
            f"{r['tps16'] / r['tps1']:.1f}",
            f"{r['first_ms']:.1f}",
            f"{r['ref_first_ms']:.1f}",
            f"{r['limit_tps']:.0f}",
            f"{r['peak_mb']:.0f}",
            f"{r['budget_mb']:.0f}",
            f"{r['load_peak_mb']:.0f}",
            f"{r['warm_load_peak_mb']:.0f}",
            str(r["tuning_runs"]),
            f"{r['same_as_eager']}/{NEW_TOKENS}",
            f"{r['gap']:.3f}",
            f"{r['same_as_ref']}/{NEW_TOKENS}",
            f"{r['batched_same']}/{NEW_TOKENS}",
            f"{r['batched_gap']:.3f}",
            f"{r['load_s']:.0f}",
        )
    for label, error in errors:
        table.add_row(*label.split(" ", 1), f"[red]{error[:120]}[/red]")
    return table


def gpu_verdict(rows: list[dict]) -> list[str]:
    """Each target of the GPU rows, with the figures it rests on."""
    if not rows:
        return []
    lines = []
    worst = min(rows, key=lambda r: r["tps1"] / r["ref_tps1"])
    lines.append(f"batch 1 / reference: worst {worst['tps1'] / worst['ref_tps1']:.2f}x (target >= 0.8x)")
    by = {(r["shape"], r["scheme"]): r for r in rows}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        int4, bf16 = by.get((shape, "int4-g32")), by.get((shape, "bf16"))
        if int4 and bf16:
            lines.append(f"{shape} int4 / bf16: {int4['tps1'] / bf16['tps1']:.2f}x (target >= 1x)")
    scale = min(r["tps16"] / r["tps1"] for r in rows)
    lines.append(f"batch 16 / batch 1: worst {scale:.1f}x (target >= 8x)")
    lines.append(f"first token: worst {max(r['first_ms'] for r in rows):.1f} ms (target <= 20 ms)")
    for key, what in (("peak_mb", "serving"), ("load_peak_mb", "load"), ("warm_load_peak_mb", "warm load")):
        over = [
            f"{r['shape']} {r['scheme']} +{r[key] - r['budget_mb']:.0f} MB"
            for r in rows
            if r[key] > r["budget_mb"]
        ]
        lines.append(
            f"{what} peak <= weights + KV + 20%: "
            + ("every row" if not over else "over in " + ", ".join(over))
        )
    lines.append(
        f"(the L2 cache is {rows[0]['l2_mb']:.0f} MB: on a cold load the int8 kernel's tuning flushes it "
        "with twice that while the loader probes it, before the KV cache exists; inductor's with 1 MB)"
    )
    return lines
