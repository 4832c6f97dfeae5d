"""The quality gate: how much did quantization hurt, measured on an eval text.

The reference runs through `transformers` on CPU in fp32, straight from the source checkpoint.
The quantized model runs where it will run on the device: a GGUF artifact through llama.cpp's own
kernels (when llama-cpp-python is installed), a safetensors artifact (or a GGUF without
llama.cpp) through `transformers` with its weights dequantized to fp32. We compare perplexity,
top-1 agreement of the next-token predictions, and the mean KL divergence KL(reference ||
quantized) per position. Figures are rounded to 4 significant digits before they go into the
manifest, so float noise from thread scheduling cannot change the artifact id.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch

from deployer.build.quantize import is_head_or_embedding
from deployer.build.source import SourceModel
from deployer.build.spec import GateSpec, QualityReport
from deployer.core.hashing import sha256_file
from deployer.core.manifest import QualityInfo
from deployer.core.quant_layout import ModuleQuant
from deployer.core.safetensors_io import DTYPE_SIZES
from deployer.errors import BuildError, QualityGateError

# Windows are scored independently; 512 keeps logits memory small (window x vocab x 4 bytes).
MAX_WINDOW = 512

# A model under test: the logits (positions x vocab, fp32) it gives for one window of token ids.
Scorer = Callable[[list[int]], torch.Tensor]


@dataclass(frozen=True)
class _Totals:
    """Sums over scored positions, accumulated window by window."""

    positions: int = 0
    reference_nll: float = 0.0
    quantized_nll: float = 0.0
    agree: int = 0
    kl: float = 0.0

    def __add__(self, other: _Totals) -> _Totals:
        return _Totals(
            self.positions + other.positions,
            self.reference_nll + other.reference_nll,
            self.quantized_nll + other.quantized_nll,
            self.agree + other.agree,
            self.kl + other.kl,
        )


def eval_tokens(source: SourceModel, eval_text: Path, max_tokens: int) -> list[int]:
    """The first `max_tokens` tokens of the eval text, with the model's own tokenizer."""
    try:
        text = eval_text.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BuildError(
            f"{eval_text}: cannot read the eval text ({exc})",
            hint="quality_gate.eval_text must name a UTF-8 text file",
        ) from exc
    ids = encode(source, text)[:max_tokens]
    if len(ids) < 2:
        raise BuildError(f"{eval_text}: the eval text has fewer than 2 tokens")
    return ids


def encode(source: SourceModel, text: str) -> list[int]:
    """`text` as token ids of the source model's own tokenizer (no special tokens added)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(source.path / "tokenizer.json"))
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


class _StoredTensor(Protocol):
    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> Sequence[int]: ...


def bits_per_weight(tensors: Mapping[str, _StoredTensor], modules: Mapping[str, ModuleQuant]) -> float:
    """Stored bits per weight of the decoder's linear layers (what the scheme quantizes: the
    embeddings, the output head and the norms are left out), scales and zero points included.

    `modules` are a safetensors artifact's module records; a GGUF artifact has none, and its
    `blk.*` matrices are counted by their ggml types instead.
    """
    bits = weights = 0
    if modules:
        for module, quant in modules.items():
            if is_head_or_embedding(module):
                continue
            weights += quant.in_features * quant.out_features
            for suffix in ("weight", "weight_scale", "weight_zero"):
                if (t := tensors.get(f"{module}.{suffix}")) is not None:
                    bits += 8 * DTYPE_SIZES[t.dtype] * math.prod(t.shape)
    else:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        for name, t in tensors.items():
            if name.startswith("blk.") and len(t.shape) == 2:
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType[t.dtype]]
                weights += math.prod(t.shape)
                bits += 8 * size * math.prod(t.shape) // block
    return round(bits / weights, 3) if weights else 0.0


def load_model(source: SourceModel, state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """A transformers model of the source architecture: the source weights, or `state`."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress reporting owns the terminal
    if state is None:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
        return model.eval()
    config = AutoConfig.from_pretrained(source.path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or (missing and missing != ["lm_head.weight"]):
        raise BuildError(f"internal: artifact weights do not fit the model ({missing}, {unexpected})")
    model.tie_weights()
    return model.eval()


def window(source: SourceModel) -> int:
    """How many tokens one scored window holds (the model's context, at most MAX_WINDOW)."""
    return min(MAX_WINDOW, int(source.config.get("max_position_embeddings", MAX_WINDOW)))


@contextmanager
def torch_scorer(source: SourceModel, state: dict[str, torch.Tensor] | None = None) -> Iterator[Scorer]:
    """Score in `transformers`: the source weights, or `state` (fp32, the source checkpoint's names)."""
    model = load_model(source, state)
    yield lambda ids: model(torch.tensor([ids])).logits[0].float()


def llama_cpp_available() -> bool:
    """True when llama-cpp-python is installed (a GGUF is then scored by llama.cpp itself)."""
    return importlib.util.find_spec("llama_cpp") is not None


@contextmanager
def llama_cpp_scorer(gguf_path: Path, context: int) -> Iterator[Scorer]:
    """Score a GGUF file with llama.cpp's kernels (what the llama.cpp engine runs), `context` tokens
    at most per window. Raises BuildError when llama.cpp cannot load the file."""
    from llama_cpp import Llama

    try:
        llm = Llama(
            model_path=str(gguf_path),
            n_ctx=context,
            n_batch=context,
            n_ubatch=context,
            n_threads=len(os.sched_getaffinity(0)),
            logits_all=True,  # the gate needs every position's prediction, not only the last
            verbose=False,
        )
    except (ValueError, RuntimeError) as exc:
        raise BuildError(
            f"{gguf_path}: llama.cpp could not load the GGUF for the quality gate: {exc}"
        ) from exc

    def score(ids: list[int]) -> torch.Tensor:
        llm.reset()  # each window starts from an empty context, as in transformers
        llm.eval(ids)
        return torch.tensor(llm.scores[: len(ids)], dtype=torch.float32)

    try:
        yield score
    finally:
        llm.close()


def measure(source: SourceModel, quantized: Scorer, gate: GateSpec, bits: float) -> QualityReport:
    """Score the quantized model `quantized` (`bits` per weight) against the source model on the
    gate's eval text."""
    tokens = eval_tokens(source, gate.eval_text, gate.max_tokens)
    size = window(source)
    totals = _Totals()
    with torch_scorer(source) as reference, torch.inference_mode():
        for start in range(0, len(tokens) - 1, size):
            chunk = tokens[start : start + size + 1]
            if len(chunk) >= 2:
                inputs = chunk[:-1]
                totals = totals + _score(reference(inputs), quantized(inputs), torch.tensor(chunk[1:]))
    ref_ppl = math.exp(totals.reference_nll / totals.positions)
    q_ppl = math.exp(totals.quantized_nll / totals.positions)
    return QualityReport(
        eval_sha256=sha256_file(gate.eval_text),
        tokens=len(tokens),
        reference_perplexity=_sig(ref_ppl),
        quantized_perplexity=_sig(q_ppl),
        increase_pct=_sig((q_ppl / ref_ppl - 1.0) * 100.0),
        top1_agreement=round(totals.agree / totals.positions, 6),
        mean_kl=_sig(totals.kl / totals.positions),
        bits_per_weight=bits,
    )


def _score(ref_logits: torch.Tensor, q_logits: torch.Tensor, targets: torch.Tensor) -> _Totals:
    """NLL, agreement and KL over the positions of one window (logits predicting `targets`)."""
    ref_logp = torch.log_softmax(ref_logits, dim=-1)
    q_logp = torch.log_softmax(q_logits, dim=-1)
    picked = targets[:, None]
    kl = (ref_logp.exp() * (ref_logp - q_logp)).sum(dim=-1)
    return _Totals(
        positions=int(targets.numel()),
        reference_nll=-float(ref_logp.gather(1, picked).sum()),
        quantized_nll=-float(q_logp.gather(1, picked).sum()),
        agree=int((ref_logp.argmax(-1) == q_logp.argmax(-1)).sum()),
        kl=float(kl.clamp(min=0.0).sum()),
    )


def _sig(value: float) -> float:
    """Round to 4 significant digits."""
    return float(f"{value:.4g}")


def apply_limits(report: QualityReport, gate: GateSpec) -> QualityReport:
    """The report with `failures` filled in from the gate's limits."""
    failures = []
    if gate.max_perplexity_increase_pct is not None and (
        report.increase_pct > gate.max_perplexity_increase_pct
    ):
        failures.append(
            f"perplexity rose {report.increase_pct:.2f}% (limit {gate.max_perplexity_increase_pct:g}%)"
        )
    if gate.min_top1_agreement is not None and report.top1_agreement < gate.min_top1_agreement:
        failures.append(f"top-1 agreement {report.top1_agreement:.4f} (minimum {gate.min_top1_agreement:g})")
    if gate.max_mean_kl is not None and report.mean_kl > gate.max_mean_kl:
        failures.append(f"mean KL {report.mean_kl:.4g} (limit {gate.max_mean_kl:g})")
    return replace(report, failures=tuple(failures))


def report_from_manifest(quality: QualityInfo, bits: float) -> QualityReport:
    """The figures a cached artifact recorded (`bits` per weight, from its tensors), to judge
    them against today's limits."""
    return QualityReport(
        eval_sha256=quality.eval_sha256,
        tokens=quality.tokens,
        reference_perplexity=quality.perplexity.reference,
        quantized_perplexity=quality.perplexity.quantized,
        increase_pct=quality.perplexity.increase_pct,
        top1_agreement=quality.top1_agreement,
        mean_kl=quality.mean_kl,
        bits_per_weight=bits,
    )


def enforce(report: QualityReport, label: str) -> None:
    """Raise QualityGateError with a readable report when any limit was passed."""
    if report.passed:
        return
    lines = [
        f"quality gate failed for {label} on {report.tokens} eval tokens:",
        f"  perplexity  reference {report.reference_perplexity:.4g}  "
        f"quantized {report.quantized_perplexity:.4g}  ({report.increase_pct:+.2f}%)",
        f"  top-1 agreement {report.top1_agreement:.4f}   mean KL {report.mean_kl:.4g}   "
        f"bits per weight {report.bits_per_weight:g}",
        *(f"  FAILED: {f}" for f in report.failures),
    ]
    raise QualityGateError(
        "\n".join(lines),
        report={**report.summary(), "failures": list(report.failures)},
        hint="use a gentler scheme (int8, a smaller int4 group, overrides) or relax "
        "model.quality_gate in deploy.yaml",
    )
