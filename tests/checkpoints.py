"""Random checkpoints for tests, saved in HF layout with the tiny checkpoint's tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def hf_random_checkpoint(dest: Path, config: object, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random transformers model of `config` (seeded) saved at `dest`, with the tokenizer of
    `tokenizer_dir`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(dest, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, dest / name)
    return dest
