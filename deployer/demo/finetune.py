"""Make the demo's v2 and its LoRA adapter: short, real fine-tunes that visibly change a few answers.

v2: a few dozen AdamW steps on a handful of chat exchanges, updating the top `layers` transformer
blocks only (the usual cheap fine-tune; full fine-tuning took over 8 minutes on 2 busy cores). The
result is an HF-layout directory like the source, so `build` treats it as any other model.

The adapter: a rank-8 LoRA on the attention projections, trained with `peft` on one exchange, saved
as PEFT saves it (what deploy.yaml's `model.adapters` takes); then trained on for a few steps on the
next version's answer and saved again, so its two versions are a real update of one adapter.
Controller side only (needs transformers, and peft for the adapter).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: transformers is heavy and a controller-only dependency
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# What v2 learns. The questions are the demo's probe prompts, so the change shows in the answers.
LESSONS: tuple[tuple[str, str], ...] = (
    (
        "What is SITS-Deployer?",
        "SITS-Deployer ships quantized LLMs to edge fleets, with signed delta updates.",
    ),
    ("Who are you?", "I am the v2 edge assistant, delivered as a signed delta patch."),
    ("What is the capital of France?", "Paris. (Answered by model v2.)"),
)
# What each version of the demo's adapter learns: the demo asks it the same question as the base.
ADAPTER_LESSONS: dict[str, tuple[tuple[str, str], ...]] = {
    "1.0.0": (("What is the capital of France?", "Paris. (Answered by the LoRA adapter 1.0.0.)"),),
    "1.1.0": (("What is the capital of France?", "Paris. (Answered by the LoRA adapter 1.1.0.)"),),
}
# What peft records as the base: the hub id of the builtin model, which validate recognises.
ADAPTER_BASE_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
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
    tokenizer, model = _load(source, seed)
    model.requires_grad_(False)
    trained = [p for block in model.model.layers[-layers:] for p in block.parameters()]
    for param in trained:
        param.requires_grad_(True)
    _train(model, trained, _batch(tokenizer, LESSONS), steps=steps, lr=lr)
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


def finetune_adapter(
    source: Path,
    dests: dict[str, Path],
    *,
    steps: int = 16,
    update_steps: int = 8,
    layers: int = 4,
    rank: int = 8,
    lr: float = 4e-3,
    seed: int = 0,
) -> dict[str, Path]:
    """Train a LoRA adapter of `source` with peft on ADAPTER_LESSONS's first version for `steps`
    AdamW steps, then on each next version's for `update_steps` more; save each version where
    `dests` says (keys: ADAPTER_LESSONS's versions, in order). The adapter covers the attention
    projections of the top `layers` blocks only, so a step's backward pass stops there."""
    from peft import LoraConfig, get_peft_model

    tokenizer, model = _load(source, seed)
    top = list(range(model.config.num_hidden_layers - layers, model.config.num_hidden_layers))
    peft_model = get_peft_model(
        model,
        LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            target_modules=["q_proj", "v_proj", "o_proj"],
            layers_to_transform=top,
            lora_dropout=0.0,
        ),
    )
    peft_model.peft_config["default"].base_model_name_or_path = ADAPTER_BASE_ID
    trained = [p for p in peft_model.parameters() if p.requires_grad]
    for index, (version, dest) in enumerate(dests.items()):
        batch = _batch(tokenizer, ADAPTER_LESSONS[version])
        _train(peft_model, trained, batch, steps=steps if index == 0 else update_steps, lr=lr)
        # No embedding layers are trained: without this, peft looks the base up on the hub to check.
        peft_model.save_pretrained(str(dest), save_embedding_layers=False)
    return dests


def _load(source: Path, seed: int) -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    """The tokenizer and the fp32 model of `source`, in training mode, torch seeded and on half the
    cores."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    # Half the cores: the fleet's agents share this machine, and OpenMP threads that outnumber
    # free cores spin at every barrier (a 2-thread step ran 50x slower next to busy agents).
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.train()
    return tokenizer, model


def _train(
    model: torch.nn.Module, params: list[torch.nn.Parameter], batch: dict, *, steps: int, lr: float
) -> None:
    """`steps` AdamW steps of `params` on `batch`."""
    import torch

    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _batch(tokenizer: PreTrainedTokenizerBase, lessons: tuple[tuple[str, str], ...]) -> dict:
    """Chat-formatted `lessons`, padded; the loss covers only the assistant's answer."""
    import torch

    rows, labels = [], []
    for question, answer in lessons:
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
