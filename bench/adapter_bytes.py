"""What an adapter update sends, against the base artifact and against today's way (issue #41).

SmolLM2-135M-Instruct, int8 artifact; two versions of a rank-8 LoRA on every q_proj and v_proj
(alpha 16, made with peft, B drawn at 2e-3 as bench/delta.py's merged LoRA), each built into an
adapter artifact for that base. Baseline, in the same run: the fine-tune shipped as a new model,
i.e. the base with version 2 merged in, built and sent as a delta patch of the base artifact.

    PYTHONPATH=. python bench/adapter_bytes.py

Measured (2 cores, first run 1 min 39 s, 0.9 GB RSS): base artifact 166,929,304 bytes; the merged
fine-tune as a model patch 617,691 (0.37 %, but a full reload of the base); the adapter's full
artifact 937,288 (0.56 %); the patch 1.0.0 -> 1.1.0 863,022 (0.52 %): under the 2 % target. Fresh
factors do not compress (fp16 noise), so a patch saves little over the full adapter; the int8 base
rounds most of a 2e-3 merged delta away, which is why the merged model patch is smaller still.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from deployer.build.adapter import AdapterBuild, AdapterBuildRequest, build_adapter
from deployer.build.demo_model import cache_root, prepare_smollm2
from deployer.build.pipeline import build_artifact
from deployer.build.spec import BuildRequest, QuantSpec
from deployer.core.hashing import sha256_file
from deployer.core.lora import read_adapter
from deployer.release.delta import create_patch

ROOT = cache_root() / "bench-adapters"
RANK, ALPHA = 8, 16


def _peft(base: Path, dest: Path, seed: int) -> Path:
    """A rank-8 q/v PEFT adapter of `base` with B drawn (PEFT starts B at zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if (dest / "adapter_model.safetensors").is_file():
        return dest
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 2e-3)
    peft_model.save_pretrained(dest)
    return dest


def _artifact(source: Path, version: str) -> Path:
    request = BuildRequest(
        source_dir=source,
        name="smollm2-135m-instruct",
        version=version,
        quant=QuantSpec("int8"),
        store_dir=ROOT / "store",
    )
    return build_artifact(request).artifact_dir


def _merged(base: Path, adapter: AdapterBuild, dest: Path) -> Path:
    """`base` with the adapter's factor * B @ A merged into its weights (fp32), in HF layout."""
    from safetensors.torch import load_file, save_file

    if (dest / ".complete").is_file():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.startswith("."):
            (dest / f.name).write_bytes(f.read_bytes())
    state = {k: v.float() for k, v in load_file(base / "model.safetensors").items()}
    lora = read_adapter(adapter.artifact_dir)
    for module, (a, b) in lora.tensors.items():
        state[f"{module}.weight"] += lora.factor * (torch.tensor(b).float() @ torch.tensor(a).float())
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / ".complete").write_text("ok\n")
    return dest


def _bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def main() -> None:
    """Build what is needed (cached under ~/.cache/sits-deployer/bench-adapters) and print the table."""
    argparse.ArgumentParser(description=__doc__).parse_args()
    torch.set_num_threads(2)
    source = prepare_smollm2()
    base = _artifact(source, "1.0.0")
    base_id = sha256_file(base / "sits-manifest.json")
    builds = []
    for seed, version in ((1, "1.0.0"), (2, "1.1.0")):
        peft = _peft(source, ROOT / f"peft-{seed}", seed)
        request = AdapterBuildRequest(
            name="summarise",
            version=version,
            peft_dir=peft,
            scale=1.0,
            base_artifact_dir=base,
            base_artifact_id=base_id,
            base_source_dir=source,
            store_dir=ROOT / "store",
        )
        builds.append(build_adapter(request))
    v1, v2 = builds
    merged = _artifact(_merged(source, v2, ROOT / "merged-source"), "1.1.0-merged")
    base_bytes = _bytes(base)
    with tempfile.TemporaryDirectory() as tmp:
        model_patch, adapter_patch = Path(tmp) / "model.patch", Path(tmp) / "adapter.patch"
        create_patch(base, merged, model_patch)
        create_patch(v1.artifact_dir, v2.artifact_dir, adapter_patch)
        rows = [
            ("base artifact, full (int8)", base_bytes),
            ("baseline: fine-tune merged, model patch", model_patch.stat().st_size),
            ("adapter 1.1.0, full artifact", v2.artifact_bytes),
            ("adapter 1.0.0 -> 1.1.0, patch", adapter_patch.stat().st_size),
        ]
    table = Table(title=f"SmolLM2-135M-Instruct, rank-{RANK} LoRA on q_proj+v_proj: bytes sent per update")
    for column in ("what is sent", "bytes", "% of base artifact"):
        table.add_column(column, justify="left" if column == "what is sent" else "right")
    for what, size in rows:
        table.add_row(what, f"{size:,}", f"{100 * size / base_bytes:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
