"""Make the demo's v2: a short, real fine-tune that visibly changes a few answers.

A few dozen AdamW steps on a handful of chat exchanges, updating the top `layers` transformer
blocks only (the usual cheap fine-tune; full fine-tuning took over 8 minutes on 2 busy cores). The
result is an HF-layout directory like the source, so `build` treats it as any other model.
Controller side only (needs transformers).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: transformers is heavy and a controller-only dependency
    from transformers import PreTrainedTokenizerBase

# What v2 learns. The questions are the demo's probe prompts, so the change shows in the answers.
LESSONS: tuple[tuple[str, str], ...] = (
    (
        "What is SITS-Deployer?",
        "SITS-Deployer ships quantized LLMs to edge fleets, with signed delta updates.",
    ),
    ("Who are you?", "I am the v2 edge assistant, delivered as a signed delta patch."),
    ("What is the capital of France?", "Paris. (Answered by model v2.)"),
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
)


def finetune(
    source: Path, dest: Path, *, steps: int = 30, layers: int = 6, lr: float = 2e-4, seed: int = 0
) -> Path:
    """Fine-tune the top `layers` blocks of `source` on LESSONS for `steps` AdamW steps; save to `dest`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    # Half the cores: the fleet's agents share this machine, and OpenMP threads that outnumber
    # free cores spin at every barrier (a 2-thread step ran 50x slower next to busy agents).
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.train()
    model.requires_grad_(False)
    trained = [p for block in model.model.layers[-layers:] for p in block.parameters()]
    for param in trained:
        param.requires_grad_(True)
    batch = _batch(tokenizer)
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, dest / name)
    (dest / "finetune.json").write_text(
        json.dumps({"steps": steps, "layers": layers, "lr": lr, "seed": seed}) + "\n"
    )
    return dest


def _batch(tokenizer: PreTrainedTokenizerBase) -> dict:
    """Chat-formatted lessons, padded; the loss covers only the assistant's answer."""
    import torch

    rows, labels = [], []
    for question, answer in LESSONS:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
        rows.append(prompt_ids + answer_ids)
        labels.append([-100] * len(prompt_ids) + answer_ids)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    target = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
    return {"input_ids": input_ids, "attention_mask": mask, "labels": target}
