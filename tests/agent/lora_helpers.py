"""Real PEFT adapters for tests and benchmarks, made with the `peft` library on a checkpoint."""

from __future__ import annotations

from pathlib import Path


def make_peft_adapter(
    model_dir: Path,
    dest: Path,
    *,
    seed: int,
    rank: int = 4,
    alpha: int = 8,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    b_std: float = 0.05,
) -> Path:
    """Save a PEFT LoRA adapter of `model_dir` into `dest`. PEFT initialises B to zero (the adapter
    would change nothing), so B is drawn from N(0, b_std) with `seed`: the adapter changes outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    peft_model = get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0)
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * b_std)
    peft_model.save_pretrained(dest)
    return dest


def merged_checkpoint(model_dir: Path, adapter_dir: Path, dest: Path) -> Path:
    """A copy of `model_dir` with factor * B @ A of the adapter artifact `adapter_dir` added to each
    target module in fp32: the reference an adapter's outputs are compared with."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from deployer.core.lora import read_adapter

    shutil.copytree(model_dir, dest)
    adapter = read_adapter(adapter_dir)
    state = load_file(dest / "model.safetensors")
    for module, (a, b) in adapter.tensors.items():
        delta = torch.from_numpy(b).float() @ torch.from_numpy(a).float()
        state[f"{module}.weight"] = state[f"{module}.weight"] + adapter.factor * delta
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest
