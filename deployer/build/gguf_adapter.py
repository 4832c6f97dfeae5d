"""A LoRA adapter as llama.cpp's own LoRA GGUF, for an adapter of a GGUF base artifact (issue #41).

The file is what llama.cpp's convert_lora_to_gguf.py writes and `llama_adapter_lora_init` (the
server's `--lora`) reads: ``general.type = adapter``, ``adapter.type = lora``,
``adapter.lora.alpha``, and per target module ``blk.N.<name>.weight.lora_a`` [rank, in] and
``.lora_b`` [out, rank] in F16. Two things differ from the HF factors:

* llama.cpp computes ``scale * alpha / rank`` with the scale given at load time (1.0 unless a
  request says otherwise), so the user's scale from deploy.yaml is folded into the alpha written;
* a Llama base GGUF stores q_proj and k_proj with their rows permuted for llama.cpp's rotary
  layout (`deployer.build.gguf_writer`), so B of those modules gets the same row permutation (A is
  untouched: the permutation acts on output rows only); a Qwen2 base keeps HF's rows.

Written from the sorted factors with no timestamps, so the same adapter gives the same bytes.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from deployer.build.gguf_writer import GGUF_LAYOUTS, permute_rows
from deployer.core.gguf_io import GGUF_FILE, read_gguf_header
from deployer.core.lora import ADAPTER_GGUF, LoraAdapter
from deployer.errors import BuildError

__all__ = ["gguf_base", "write_gguf_adapter"]


def gguf_base(base_artifact_dir: Path) -> Path | None:
    """The base artifact's GGUF file, or None when the base is a safetensors artifact."""
    path = base_artifact_dir / GGUF_FILE
    return path if path.is_file() else None


def write_gguf_adapter(adapter: LoraAdapter, base_gguf: Path, directory: Path) -> Path:
    """Write `directory`/adapter.gguf for `adapter` on the base GGUF `base_gguf`; return its path.

    Raises BuildError for a target module the base GGUF has no tensor for.
    """
    header = read_gguf_header(base_gguf)
    arch = header.string("general.architecture") or "llama"
    blocks = header.integer(f"{arch}.block_count")
    heads = header.integer(f"{arch}.attention.head_count")
    kv_heads = header.integer(f"{arch}.attention.head_count_kv") or heads
    if blocks is None or heads is None or kv_heads is None:
        raise BuildError(
            f"{base_gguf}: no {arch}.block_count or attention head counts in its metadata",
            hint="rebuild the base artifact with this sits-deployer",
        )
    model_arch, permuted = GGUF_LAYOUTS.get(arch, GGUF_LAYOUTS["llama"])
    names = gguf.get_tensor_name_map(model_arch, blocks)
    stored = header.by_name()
    out = directory / ADAPTER_GGUF
    writer = gguf.GGUFWriter(out, arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    # llama.cpp's factor is scale * alpha / rank with scale 1.0 by default: fold the user's in.
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(adapter.scale * adapter.alpha))
    for module in sorted(adapter.tensors):
        a, b = adapter.tensors[module]
        name = names.get_name(f"{module}.weight", try_suffixes=(".weight",))
        if name is None or name not in stored:
            raise BuildError(
                f"adapter {adapter.name}: module {module} has no tensor in the base GGUF {base_gguf}",
                hint="an adapter of a GGUF base may target only the base's linear layers",
            )
        permute = heads if ".q_proj" in module else kv_heads if ".k_proj" in module else None
        b = permute_rows(b, permute) if permute and permuted else b
        writer.add_tensor(f"{name}.lora_a", np.ascontiguousarray(a, dtype=np.float16))
        writer.add_tensor(f"{name}.lora_b", np.ascontiguousarray(b, dtype=np.float16))
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return out
