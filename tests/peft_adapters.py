"""Real LoRA adapters made with the `peft` library, for tests of the adapter path (issue #41)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def make_peft_adapter(
    base_dir: Path,
    dest: Path,
    *,
    rank: int = 4,
    alpha: int = 8,
    targets: Sequence[str] = ("q_proj", "v_proj"),
    seed: int = 0,
) -> Path:
    """Save a PEFT LoRA adapter of the HF model at `base_dir` into `dest`, with random (seeded,
    non-zero) factors so that it changes the model's output. Same seed, same bytes."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # init_lora_weights=False draws B too; scale it so outputs move visibly
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.5)
    peft_model.save_pretrained(dest, safe_serialization=True)
    return dest
