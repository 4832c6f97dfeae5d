"""The quality gate: how much did quantization hurt, measured on an eval text.

Both models run through `transformers` on CPU in fp32: the reference straight from the source
checkpoint, the quantized one from the artifact's weights dequantized to fp32. We compare
perplexity, top-1 agreement of the next-token predictions, and the mean KL divergence
KL(reference || quantized) per position. Figures are rounded to 4 significant digits before
they go into the manifest, so float noise from thread scheduling cannot change the artifact id.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from deployer.build.source import SourceModel
from deployer.build.spec import GateSpec, QualityReport
from deployer.core.hashing import sha256_file
from deployer.core.manifest import QualityInfo
from deployer.errors import BuildError, QualityGateError

# Windows are scored independently; 512 keeps logits memory small (window x vocab x 4 bytes).
MAX_WINDOW = 512


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
    from tokenizers import Tokenizer

    try:
        text = eval_text.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BuildError(
            f"{eval_text}: cannot read the eval text ({exc})",
            hint="quality_gate.eval_text must name a UTF-8 text file",
        ) from exc
    tokenizer = Tokenizer.from_file(str(source.path / "tokenizer.json"))
    ids = tokenizer.encode(text, add_special_tokens=False).ids[:max_tokens]
    if len(ids) < 2:
        raise BuildError(f"{eval_text}: the eval text has fewer than 2 tokens")
    return ids


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


def measure(source: SourceModel, state: dict[str, torch.Tensor], gate: GateSpec) -> QualityReport:
    """Score the quantized weights `state` against the source model on the gate's eval text."""
    tokens = eval_tokens(source, gate.eval_text, gate.max_tokens)
    window = min(MAX_WINDOW, int(source.config.get("max_position_embeddings", MAX_WINDOW)))
    reference = load_model(source)
    quantized = load_model(source, state)
    totals = _Totals()
    with torch.inference_mode():
        for start in range(0, len(tokens) - 1, window):
            chunk = torch.tensor([tokens[start : start + window + 1]])
            if chunk.shape[1] >= 2:
                totals = totals + _score(reference, quantized, chunk)
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
    )


def _score(reference: torch.nn.Module, quantized: torch.nn.Module, chunk: torch.Tensor) -> _Totals:
    """NLL, agreement and KL over the positions of one window (predicting tokens 1..n)."""
    inputs, targets = chunk[:, :-1], chunk[0, 1:]
    ref_logp = torch.log_softmax(reference(inputs).logits[0].float(), dim=-1)
    q_logp = torch.log_softmax(quantized(inputs).logits[0].float(), dim=-1)
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


def report_from_manifest(quality: QualityInfo) -> QualityReport:
    """The figures a cached artifact recorded, to judge them against today's limits."""
    return QualityReport(
        eval_sha256=quality.eval_sha256,
        tokens=quality.tokens,
        reference_perplexity=quality.perplexity.reference,
        quantized_perplexity=quality.perplexity.quantized,
        increase_pct=quality.perplexity.increase_pct,
        top1_agreement=quality.top1_agreement,
        mean_kl=quality.mean_kl,
    )


def enforce(report: QualityReport, label: str) -> None:
    """Raise QualityGateError with a readable report when any limit was passed."""
    if report.passed:
        return
    lines = [
        f"quality gate failed for {label} on {report.tokens} eval tokens:",
        f"  perplexity  reference {report.reference_perplexity:.4g}  "
        f"quantized {report.quantized_perplexity:.4g}  ({report.increase_pct:+.2f}%)",
        f"  top-1 agreement {report.top1_agreement:.4f}   mean KL {report.mean_kl:.4g}",
        *(f"  FAILED: {f}" for f in report.failures),
    ]
    raise QualityGateError(
        "\n".join(lines),
        report={**report.to_json(), "failures": list(report.failures)},
        hint="use a gentler scheme (int8, a smaller int4 group, overrides) or relax "
        "model.quality_gate in deploy.yaml",
    )
