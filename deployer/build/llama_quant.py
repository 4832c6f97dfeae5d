"""llama.cpp's own quantizer for GGUF artifacts (`model.quantization.gguf_type`): the K-quants
(Q4_K_M, Q5_K_M, Q6_K) and Q8_0, made by `llama_model_quantize` (through llama-cpp-python, the
binding the project already builds) from an f16 GGUF the pipeline writes, with an importance
matrix computed here on the calibration text.

The importance matrix is our own, not llama-imatrix's: llama-imatrix is one of llama.cpp's
programs, not part of the library the binding wraps, so using it would mean compiling llama.cpp's
tools on every build machine. What it computes is simple to reproduce: for each matrix the mean
of the squared input activations per input channel over the calibration tokens, keyed by the
GGUF tensor name. Ours runs the source model (float64, one sequence of up to 1024 tokens) in
torch; llama-imatrix runs the f16 GGUF in chunks of its context. The quantizer receives it as
llama.cpp's `llama_model_imatrix_data` array, as llama-quantize does after reading its file.

The build stays byte-reproducible: the float64 forward does not depend on thread scheduling, the
library writes no file names into the GGUF, and its rows do not depend on the thread count.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from deployer.build import quality
from deployer.build.awq import CALIBRATION_TOKENS, Calibration
from deployer.build.gguf_writer import GGUFTensorPlan, GGUFTensorRecord
from deployer.build.source import SourceModel
from deployer.core.gguf_io import read_gguf_header
from deployer.errors import BuildError

__all__ = ["Imatrix", "compute_imatrix", "gguf_records", "quantize", "quantizer_version", "threads"]

# llama_ftype of each `gguf_type` (llama.h; the binding's LLAMA_FTYPE_MOSTLY_* constants), and of
# Q4_0 and Q4_1, which bench/quality.py has llama.cpp make for comparison with our writer's.
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}


@dataclass(frozen=True)
class Imatrix:
    """Per GGUF matrix, the mean squared input activation of each input channel; `tokens` is
    how many calibration tokens it averages over."""

    values: dict[str, np.ndarray]
    tokens: int

    @property
    def sha256(self) -> str:
        """A digest of the names and float32 values (recorded in the manifest)."""
        digest = hashlib.sha256()
        for name in sorted(self.values):
            digest.update(name.encode() + b"\0" + self.values[name].tobytes())
        return digest.hexdigest()


def compute_imatrix(
    source: SourceModel, plans: list[GGUFTensorPlan], calibration: Calibration, log: Callable[[str], None]
) -> Imatrix:
    """The importance matrix of every linear of `source` (and of the output head) over the
    calibration text, keyed by the GGUF names in `plans`."""
    gguf_names = {plan.source: plan.name for plan in plans}
    if source.tied_embeddings:  # the head reads the embedding matrix: llama.cpp quantizes that
        gguf_names["lm_head.weight"] = gguf_names["model.embed_tokens.weight"]
    limit = min(CALIBRATION_TOKENS, quality.window(source))
    ids = quality.encode(source, calibration.text)[:limit]
    log(f"importance matrix: {len(ids)} calibration tokens through the source model")
    model = quality.load_model(source).to(torch.float64)
    sums: dict[str, torch.Tensor] = {}

    def collect(name: str) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].reshape(-1, args[0].shape[-1])
            sums[name] = (x * x).sum(dim=0)

        return hook

    handles = [
        module.register_forward_pre_hook(collect(gguf_names[f"{name}.weight"]))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and f"{name}.weight" in gguf_names
    ]
    try:
        with torch.inference_mode():
            model(torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    values = {name: (s / len(ids)).to(torch.float32).numpy() for name, s in sorted(sums.items())}
    return Imatrix(values, len(ids))


def quantize(f16: Path, out: Path, gguf_type: str, imatrix: Imatrix | None, nthread: int) -> None:
    """Quantize the f16 GGUF `f16` to `gguf_type` (weighing by `imatrix` when given) into `out`.

    Raises BuildError when llama-cpp-python is missing or llama.cpp refuses the file.
    """
    try:
        import llama_cpp
    except ImportError as exc:
        raise BuildError(
            "model.quantization.gguf_type needs llama-cpp-python, which is not installed",
            hint="run scripts/setup.sh (without SITS_NO_LLAMACPP=1), or remove gguf_type",
        ) from exc
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[gguf_type]
    params.nthread = nthread
    if imatrix is not None:
        # A null-name-terminated array; `entries` (and the arrays it points into) must outlive the call.
        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix.values) + 1))()
        for entry, (name, values) in zip(entries, imatrix.values.items(), strict=False):
            entry.name = name.encode()
            entry.data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entry.size = values.size
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    if llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise BuildError(
            f"llama.cpp's quantizer failed making {gguf_type} from {f16}",
            hint="llama.cpp logged the cause above this message; report it with the model's config.json",
        )


def quantizer_version() -> str:
    """The installed llama-cpp-python's version (its llama.cpp quantizes), or "none"."""
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def gguf_records(path: Path) -> dict[str, GGUFTensorRecord]:
    """Each tensor of the GGUF at `path`: its type, shape (ggml order) and sha256 of its bytes."""
    records = {}
    with path.open("rb") as f:
        for tensor in read_gguf_header(path).tensors:
            f.seek(tensor.offset)
            digest, left = hashlib.sha256(), tensor.length
            while left:  # in pieces: one tensor of a large model is hundreds of MB
                piece = f.read(min(left, 1 << 24))
                if not piece:
                    raise BuildError(f"{path}: tensor {tensor.name} runs past the end of the file")
                digest.update(piece)
                left -= len(piece)
            records[tensor.name] = GGUFTensorRecord(tensor.dtype, tensor.shape, digest.hexdigest())
    return records


def threads() -> int:
    """The CPUs this process may use: the quantizer's thread count (results do not depend on it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
