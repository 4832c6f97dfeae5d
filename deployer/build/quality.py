"""The quality gate: how much did quantization hurt, measured on an eval text.

The reference runs through `transformers`' own modules on CPU in fp32, straight from the source
checkpoint. The quantized model runs where it will run on the device: a GGUF artifact through
llama.cpp's own kernels (when llama-cpp-python is installed), a safetensors artifact (or a GGUF
without llama.cpp) through the same modules with its weights dequantized to fp32. We compare perplexity,
top-1 agreement of the next-token predictions, and the mean KL divergence KL(reference ||
quantized) per position. Figures are rounded to 4 significant digits before they go into the
manifest, so float noise from thread scheduling cannot change the artifact id.

Both torch models are streamed, so gating an 8B model holds about one decoder layer in fp32 (under
1 GB), never the model: the architecture's modules are built on the meta device (no memory), the
eval windows' hidden states go through one decoder layer at a time (that layer's weights read,
dequantized, run over every window, dropped), and the output head's logits are computed a block
of vocabulary rows at a time. Only the windows' hidden states and one window's logits are kept.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from deployer.build.quantize import is_head_or_embedding
from deployer.build.source import SourceModel, SourceTensor, read_rows
from deployer.build.spec import GateSpec, QualityReport
from deployer.core.hashing import sha256_file
from deployer.core.manifest import QualityInfo
from deployer.core.memory import release_freed_heap
from deployer.core.quant_layout import ModuleQuant
from deployer.core.safetensors_io import DTYPE_SIZES
from deployer.errors import BuildError, QualityGateError, SourceModelError

# Windows are scored independently; 512 keeps logits memory small (window x vocab x 4 bytes).
MAX_WINDOW = 512
# fp32 bytes of the head's (or embedding's) rows converted at once: 64 MB is 4096 rows of
# Llama-3-8B's width.
BLOCK_BYTES = 64 * 1024 * 1024
# Positions scored at once: bounds the score's temporaries (a few positions x vocab fp32 tensors).
SCORE_POSITIONS = 128

# A model under test: the logits (positions x vocab, fp32) it gives for one window of token ids.
Scorer = Callable[[list[int]], torch.Tensor]


@runtime_checkable
class Weights(Protocol):
    """A model's weights in fp32 under the source checkpoint's names, a few at a time: what the
    gate streams through the source architecture's modules."""

    def tensors(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The named tensors (one decoder layer's, or the final norm)."""
        ...

    def row_blocks(self, name: str, rows: int) -> Iterator[torch.Tensor]:
        """The tensor `name`, `rows` rows at a time, in order (the embedding, the head)."""
        ...


# What the gate scores: weights streamed through torch, or a runtime that gives whole-window logits.
Quantized = Weights | Scorer


class SourceWeights:
    """The source checkpoint's weights (see `Weights`), read from its safetensors files."""

    def __init__(self, source: SourceModel) -> None:
        self._source = source
        self._by_name = {t.name: t for t in source.tensors}

    def tensors(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The named tensors in fp32."""
        state = {}
        for name in names:
            t = self._tensor(name)
            state[name] = _as_fp32(read_rows(t.path, t.entry))
        return state

    def row_blocks(self, name: str, rows: int) -> Iterator[torch.Tensor]:
        """The tensor `name`, `rows` rows at a time, in fp32."""
        t = self._tensor(name)
        for start in range(0, t.entry.shape[0], rows):
            yield _as_fp32(read_rows(t.path, t.entry, start, start + rows))

    def _tensor(self, name: str) -> SourceTensor:
        tensor = self._by_name.get(name)
        if tensor is None:
            raise SourceModelError(
                f"{self._source.path}: the checkpoint has no tensor {name!r}, which its "
                f"{self._source.architecture} config needs",
                hint="the weights and config.json must come from the same model",
            )
        return tensor


def _as_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """fp32, without a copy when it already is."""
    return tensor if tensor.dtype == torch.float32 else tensor.float()


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


def measure(
    source: SourceModel,
    quantized: Quantized,
    gate: GateSpec,
    bits: float,
    reference: Weights | None = None,
) -> QualityReport:
    """Score the quantized model (`bits` per weight) against the source model on the gate's eval
    text, both streamed (see the module docstring) unless `quantized` is a whole-window Scorer.

    `reference` replaces the source checkpoint's weights as the reference (the architecture and
    the tokenizer stay the source's): an adapter's gate scores against the merged model this way,
    without writing it to disk."""
    tokens = eval_tokens(source, gate.eval_text, gate.max_tokens)
    size = window(source)
    windows = [tokens[start : start + size + 1] for start in range(0, len(tokens) - 1, size)]
    inputs = [chunk[:-1] for chunk in windows]
    totals = _Totals()
    with torch.inference_mode():
        model = _Decoder(source)
        reference = reference if reference is not None else SourceWeights(source)
        reference_states = model.hidden_states(reference, inputs)
        quantized_logits = _window_logits(model, quantized, inputs)
        for i, chunk in enumerate(windows):
            ref_logits = model.logits(reference, reference_states[i])
            q_logits = quantized_logits(i)
            targets = torch.tensor(chunk[1:])
            for p in range(0, len(targets), SCORE_POSITIONS):
                rows = slice(p, p + SCORE_POSITIONS)
                totals = totals + _score(ref_logits[rows], q_logits[rows], targets[rows])
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


def _window_logits(
    model: _Decoder, quantized: Quantized, inputs: list[list[int]]
) -> Callable[[int], torch.Tensor]:
    """Window i's logits of the quantized model: streamed weights run through `model` (every
    window's hidden states computed once, up front, layer by layer), or a Scorer called per window."""
    if isinstance(quantized, Weights):
        states = model.hidden_states(quantized, inputs)
        return lambda i: model.logits(quantized, states[i])
    scorer = quantized
    return lambda i: scorer(inputs[i])


class _Decoder:
    """The source architecture's modules from `transformers`, built on the meta device (no memory)
    and given one decoder layer's weights at a time."""

    def __init__(self, source: SourceModel) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # our own progress reporting owns the terminal
        config = AutoConfig.from_pretrained(source.path)
        with torch.device("meta"):
            # sdpa, as from_pretrained picks on CPU: with no mask it attends causally.
            skeleton = AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, attn_implementation="sdpa"
            )
        decoder: Any = skeleton.get_decoder()
        self._prefix = f"{skeleton.base_model_prefix}."
        self._layers: list[torch.nn.Module] = list(decoder.layers)
        self._norm: torch.nn.Module = decoder.norm
        self._rotary: torch.nn.Module = type(decoder.rotary_emb)(config=config)
        self._vocab = int(config.vocab_size)
        self._embedding = f"{self._prefix}embed_tokens.weight"
        self._head = self._embedding if source.tied_embeddings else "lm_head.weight"
        self._block_rows = max(1, BLOCK_BYTES // (4 * int(config.hidden_size)))

    def hidden_states(self, weights: Weights, windows: list[list[int]]) -> list[torch.Tensor]:
        """Each window's hidden states after the final norm ([positions, hidden] fp32), one decoder
        layer's weights in memory at a time."""
        states = self._embed(weights, windows)
        positions = [torch.arange(len(ids))[None] for ids in windows]
        rope = [self._rotary(h, p) for h, p in zip(states, positions, strict=True)]
        for i, layer in enumerate(self._layers):
            self._load(layer, f"{self._prefix}layers.{i}.", weights)
            states = [
                layer(h, position_ids=p, position_embeddings=r)
                for h, p, r in zip(states, positions, rope, strict=True)
            ]
            layer.to("meta")  # drops this layer's weights
            release_freed_heap()  # and hands them back, so layers do not pile up in glibc's heap
        self._load(self._norm, f"{self._prefix}norm.", weights)
        normed = [self._norm(h)[0] for h in states]
        self._norm.to("meta")
        return normed

    def logits(self, weights: Weights, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits for `hidden` ([positions, vocab] fp32), a block of vocabulary rows at
        a time."""
        out = torch.empty(len(hidden), self._vocab)
        start = 0
        for block in weights.row_blocks(self._head, self._block_rows):
            if start + len(block) > self._vocab:
                break
            out[:, start : start + len(block)] = hidden @ block.T
            start += len(block)
        if start != self._vocab:
            raise BuildError(f"internal: {self._head} does not have the config's {self._vocab} rows")
        return out

    def _load(self, module: torch.nn.Module, prefix: str, weights: Weights) -> None:
        state = weights.tensors([prefix + name for name in module.state_dict()])
        module.load_state_dict({name[len(prefix) :]: t for name, t in state.items()}, assign=True)

    def _embed(self, weights: Weights, windows: list[list[int]]) -> list[torch.Tensor]:
        """The windows' token embeddings ([1, positions, hidden]), the table read a block at a time."""
        wanted = sorted({t for ids in windows for t in ids})
        if wanted[-1] >= self._vocab:
            raise BuildError(
                f"token id {wanted[-1]} of the eval text is outside the model's vocabulary ({self._vocab})",
                hint="the tokenizer files and config.json must come from the same model",
            )
        rows: dict[int, torch.Tensor] = {}
        start = 0
        for block in weights.row_blocks(self._embedding, self._block_rows):
            rows.update({t: block[t - start].clone() for t in wanted if start <= t < start + len(block)})
            start += len(block)
        return [torch.stack([rows[t] for t in ids])[None] for ids in windows]


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
