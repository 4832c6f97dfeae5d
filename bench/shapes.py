"""Random checkpoints in the shapes edge devices really run, written once and cached.

    SHAPES      Hugging Face configs of Qwen2.5-1.5B, Qwen2.5-3B and Llama-3-8B (the real
                vocabularies, GQA, Qwen2's q/k/v biases, Llama 3's rope scaling, untied heads where
                the model has them); `tiny` is a 2-layer smoke shape
    checkpoint  the sharded safetensors checkpoint of one shape (seeded random bf16 weights, an
                HF index, SmolLM2's tokenizer), cached under <cache>/scale/<shape>-v<N>

Weights are random: these checkpoints measure time and memory, never quality. They are written a
tensor at a time and a shard (at most 2 GB) at a time, so writing the 8B shape holds about one
shard in memory; several processes asking for the same shape at once wait for one writer (a file
lock), and a half-written cache is never used (written beside, renamed when complete).

    python -m bench.shapes qwen2.5-1.5b   # writes it (if missing) and prints its path
"""

from __future__ import annotations

import argparse
import fcntl
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from deployer.build.demo_model import cache_root, prepare_smollm2

__all__ = ["SHAPES", "checkpoint", "tensor_shapes"]

_VERSION = 1  # bump when the recipe changes: old caches are then ignored
_SHARD_BYTES = 2 * 1024**3
_STD = 0.02

_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "vocab_size": 151936,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "attention_dropout": 0.0,
}
SHAPES: dict[str, dict] = {
    "qwen2.5-1.5b": _QWEN2
    | {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "qwen2.5-3b": _QWEN2
    | {
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    },
}
SHAPES["tiny"] = SHAPES["qwen2.5-1.5b"] | {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 49152,
}


def tensor_shapes(config: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor of the HF checkpoint of `config`, by name, in file order."""
    dim, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or dim // heads
    q_out, kv_out = heads * head_dim, config["num_key_value_heads"] * head_dim
    biased = config["model_type"] == "qwen2"
    yield "model.embed_tokens.weight", (config["vocab_size"], dim)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (dim,)
        for name, rows in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            yield f"{p}self_attn.{name}.weight", (rows, dim)
            if biased:
                yield f"{p}self_attn.{name}.bias", (rows,)
        yield p + "self_attn.o_proj.weight", (dim, q_out)
        yield p + "post_attention_layernorm.weight", (dim,)
        yield p + "mlp.gate_proj.weight", (inter, dim)
        yield p + "mlp.up_proj.weight", (inter, dim)
        yield p + "mlp.down_proj.weight", (dim, inter)
    yield "model.norm.weight", (dim,)
    if not config.get("tie_word_embeddings", False):
        yield "lm_head.weight", (config["vocab_size"], dim)


def checkpoint(shape: str, root: Path | None = None) -> Path:
    """The cached checkpoint of `shape` (see the module docstring), written first if missing."""
    if shape not in SHAPES:
        raise KeyError(f"unknown shape {shape!r}: one of {', '.join(SHAPES)}")
    root = root or cache_root() / "scale"
    dest = root / f"{shape}-v{_VERSION}"
    if (dest / ".complete").is_file():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with (root / f".{shape}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be writing it: wait for it
        if (dest / ".complete").is_file():
            return dest
        tmp = Path(tempfile.mkdtemp(prefix=f".{shape}-", dir=root))
        try:
            _write(SHAPES[shape], tmp)
            (tmp / ".complete").touch()
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return dest


def _write(config: dict, dest: Path) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    written: list[list[str]] = []
    size, total = 0, 0
    gen = torch.Generator().manual_seed(0)
    names = list(tensor_shapes(config))

    def flush() -> None:
        nonlocal size
        index = len(written) + 1
        save_file(shards[-1], dest / f"part-{index}.safetensors", metadata={"format": "pt"})
        written.append(list(shards[-1]))
        shards[-1] = {}
        size = 0

    for name, shape in names:
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(shape, generator=gen) * _STD).to(torch.bfloat16)
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > _SHARD_BYTES:
            flush()
        shards[-1][name] = tensor
        size += nbytes
        total += nbytes
    flush()
    count, weight_map = len(written), {}
    for i, tensor_names in enumerate(written, start=1):
        final = f"model-{i:05d}-of-{count:05d}.safetensors"
        (dest / f"part-{i}.safetensors").rename(dest / final)
        weight_map.update(dict.fromkeys(tensor_names, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    # SmolLM2's tokenizer, so its special tokens: <|im_start|> 1, <|im_end|> 2.
    config = config | {"torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = prepare_smollm2()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, dest / name)


def main() -> None:
    """Write (if missing) and print the checkpoint of each shape named."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("shapes", nargs="+", choices=sorted(SHAPES))
    for shape in parser.parse_args().shapes:
        print(checkpoint(shape))


if __name__ == "__main__":
    main()
