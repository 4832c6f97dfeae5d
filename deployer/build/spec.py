"""What a build is asked to do, as plain frozen dataclasses (no config module, no pydantic).

The CLI maps deploy.yaml onto these in one small function, so the build core can be tested and
reused without the config loader. Validation here covers only what the build itself relies on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deployer.core.manifest import FLOAT_SCHEMES, FORMAT_VERSION, INTEGER_SCHEMES
from deployer.errors import BuildError

SCHEMES = FLOAT_SCHEMES + INTEGER_SCHEMES
# "layered": a fixed rule (attention int4, MLP int8); "auto": measured per linear within max_size.
PRESETS = ("layered", "auto")
FORMATS = ("safetensors", "gguf")  # gguf: one GGUF file for the llama.cpp engine
GGUF_INT4_TYPES = ("Q4_1", "Q4_0")  # what int4 weights become in a GGUF (Q4_1 first: the default)
# Whole-model recipes of llama.cpp's own quantizer (llama-quantize's names), for `gguf_type`.
LLAMA_QUANT_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
# Those whose quantizer weighs rounding errors by an importance matrix (Q8_0's ignores it).
IMATRIX_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K")
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 128


def _check_scheme(scheme: str, allowed: tuple[str, ...], where: str) -> None:
    if scheme not in allowed:
        raise BuildError(
            f"{where}: unknown quantization scheme {scheme!r}",
            hint=f"use one of {', '.join(allowed)}",
        )


def _check_group_size(group_size: int, where: str) -> None:
    if group_size not in GROUP_SIZES:
        raise BuildError(
            f"{where}: int4 group size {group_size} is not supported",
            hint=f"use one of {', '.join(map(str, GROUP_SIZES))}",
        )


@dataclass(frozen=True)
class Override:
    """Use `scheme` for every module whose name matches the fnmatch `pattern`."""

    pattern: str
    scheme: str
    group_size: int | None = None

    def __post_init__(self) -> None:
        where = f"override {self.pattern!r}"
        _check_scheme(self.scheme, SCHEMES, where)
        if self.group_size is not None:
            _check_group_size(self.group_size, where)

    def to_json(self) -> dict[str, Any]:
        """The manifest form (group_size null when it inherits the spec's)."""
        return {"pattern": self.pattern, "scheme": self.scheme, "group_size": self.group_size}


@dataclass(frozen=True)
class QuantSpec:
    """The quantization asked for: a scheme or a preset, the int4 group size, and per-module
    overrides (the first matching pattern wins; overrides beat the preset). The "auto" preset
    needs `max_size` (bytes of the stored tensors) and measures on `calibration` (None: the text
    shipped with the package); neither means anything for another scheme."""

    scheme: str
    group_size: int = DEFAULT_GROUP_SIZE
    overrides: tuple[Override, ...] = ()
    max_size: int | None = None
    calibration: Path | None = None

    def __post_init__(self) -> None:
        _check_scheme(self.scheme, SCHEMES + PRESETS, "model.quantization")
        _check_group_size(self.group_size, "model.quantization")
        if (self.scheme == "auto") != (self.max_size is not None):
            raise BuildError(
                "model.quantization.max_size: scheme auto needs a size budget, and only it uses one",
                hint="write scheme: auto with max_size (e.g. 120M), or remove max_size",
            )
        if self.calibration is not None and self.scheme != "auto":
            raise BuildError("internal: a calibration text in the QuantSpec of a scheme other than auto")

    def to_json(self) -> dict[str, Any]:
        """The manifest form, exactly as asked (presets are not expanded here; `max_size` only
        for auto, so other specs keep their bytes; the calibration text goes in by its sha256)."""
        budget = {"max_size": self.max_size} if self.max_size is not None else {}
        return {
            "scheme": self.scheme,
            "group_size": self.group_size,
            "overrides": [o.to_json() for o in self.overrides],
            **budget,
        }

    @property
    def label(self) -> str:
        """A short name for tables and engine descriptions, e.g. "int4-g128"."""
        return f"int4-g{self.group_size}" if self.scheme == "int4" else self.scheme

    @property
    def uses_int4(self) -> bool:
        """True when some module may be stored int4 (the scheme, a preset or an override)."""
        return self.scheme in ("int4", *PRESETS) or any(o.scheme == "int4" for o in self.overrides)


@dataclass(frozen=True)
class AwqSpec:
    """Calibrated quantization on `calibration` (None: the text shipped with the package,
    deployer/core/calibration.txt): activation-aware per-input-channel scales folded into the
    model (`scales`, deploy.yaml's `awq`), then GPTQ's error-compensating rounding of int4
    linears (`gptq`)."""

    calibration: Path | None = None
    scales: bool = True
    gptq: bool = False


@dataclass(frozen=True)
class LlamaQuantSpec:
    """A GGUF quantized by llama.cpp's own quantizer to `type` from an f16 GGUF, weighing each
    column by an importance matrix computed on `calibration` (None: the text shipped with the
    package) unless `imatrix` is False or the type ignores one."""

    type: str
    imatrix: bool = True
    calibration: Path | None = None

    def __post_init__(self) -> None:
        if self.type not in LLAMA_QUANT_TYPES:
            raise BuildError(
                f"model.quantization.gguf_type: unknown type {self.type!r}",
                hint=f"use one of {', '.join(LLAMA_QUANT_TYPES)}",
            )

    @property
    def uses_imatrix(self) -> bool:
        """True when an importance matrix is computed and given to the quantizer."""
        return self.imatrix and self.type in IMATRIX_TYPES


@dataclass(frozen=True)
class GateSpec:
    """The quality gate: an eval text, how many of its tokens to use, and the limits."""

    eval_text: Path
    max_tokens: int = 512
    max_perplexity_increase_pct: float | None = None
    min_top1_agreement: float | None = None
    max_mean_kl: float | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 2:
            raise BuildError(
                f"quality_gate.max_tokens is {self.max_tokens}; perplexity needs at least 2 tokens"
            )


@dataclass(frozen=True)
class BuildRequest:
    """Everything one build needs. `store_dir` is the content-addressed store (.sits/store);
    `gguf_int4` is the GGUF type of int4 weights (format gguf only); `llama_quant`, when given,
    has llama.cpp's quantizer make the whole GGUF instead (format gguf only; `quant` is then
    the f16 GGUF it starts from)."""

    source_dir: Path
    name: str
    version: str
    quant: QuantSpec
    store_dir: Path
    gate: GateSpec | None = None
    use_cache: bool = True
    format: str = "safetensors"
    gguf_int4: str = GGUF_INT4_TYPES[0]
    awq: AwqSpec | None = None
    llama_quant: LlamaQuantSpec | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise BuildError(
                f"unknown artifact format {self.format!r}", hint=f"use one of {', '.join(FORMATS)}"
            )
        if self.gguf_int4 not in GGUF_INT4_TYPES:
            raise BuildError(
                f"unknown GGUF int4 type {self.gguf_int4!r}", hint=f"use one of {', '.join(GGUF_INT4_TYPES)}"
            )
        if self.awq is not None and self.format == "gguf":
            field = "awq" if self.awq.scales else "gptq"
            raise BuildError(
                f"model.quantization.{field}: calibrated int4 (awq, gptq) is built for the torch "
                "engine's artifacts, not GGUF",
                hint=f"remove `{field}: true`, or use agent.engine: torch",
            )
        if self.quant.scheme == "auto" and self.format == "gguf":
            raise BuildError(
                "model.quantization.scheme: auto chooses among the torch engine's int4 and int8 "
                "layouts, not GGUF types",
                hint="use agent.engine: torch, or gguf_type: Q4_K_M for llama.cpp's own mixed recipe",
            )
        if self.llama_quant is not None and self.format != "gguf":
            raise BuildError(
                "model.quantization.gguf_type: llama.cpp's quantizer makes GGUF artifacts only",
                hint="remove gguf_type, or use agent.engine: llama.cpp",
            )
        if self.llama_quant is not None and (self.quant.scheme not in FLOAT_SCHEMES or self.quant.overrides):
            raise BuildError(
                f"model.quantization.gguf_type: llama.cpp's quantizer starts from a float GGUF, "
                f"not {self.quant.label}",
                hint="with gguf_type, leave scheme, group_size and overrides out",
            )

    @property
    def label(self) -> str:
        """A short name of the quantization for messages and tables, e.g. "int4-g128", "Q4_K_M"."""
        return self.llama_quant.type if self.llama_quant else self.quant.label

    @property
    def format_version(self) -> int:
        """The artifact format this request needs: 2 for int4 weights (fp16 zero points) or
        AWQ in a safetensors artifact, or for a GGUF of llama.cpp's quantizer (its manifest
        records the recipe), else 1 (readable by agents that know only format 1)."""
        if self.format == "safetensors" and (self.quant.uses_int4 or self.awq is not None):
            return FORMAT_VERSION
        if self.llama_quant is not None:
            return FORMAT_VERSION
        return 1


@dataclass(frozen=True)
class QualityReport:
    """What the gate measured, and which limits (if any) were passed."""

    eval_sha256: str
    tokens: int
    reference_perplexity: float
    quantized_perplexity: float
    increase_pct: float
    top1_agreement: float
    mean_kl: float
    bits_per_weight: float
    failures: tuple[str, ...] = field(default=())

    @property
    def passed(self) -> bool:
        """True when no limit was exceeded."""
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        """The manifest's `quality` object (limits and failures are not part of the artifact;
        nor is `bits_per_weight`, which the manifest's tensors already tell: see `summary`)."""
        return {
            "eval_sha256": self.eval_sha256,
            "tokens": self.tokens,
            "perplexity": {
                "reference": self.reference_perplexity,
                "quantized": self.quantized_perplexity,
                "increase_pct": self.increase_pct,
            },
            "top1_agreement": self.top1_agreement,
            "mean_kl": self.mean_kl,
        }

    def summary(self) -> dict[str, Any]:
        """What the build reports: the manifest's figures and the bits per weight."""
        return {**self.to_json(), "bits_per_weight": self.bits_per_weight}


@dataclass(frozen=True)
class BuildResult:
    """A finished build: where the artifact is, its id (manifest sha256), and what it cost.

    `tensors` counts stored tensors; `bytes_written` is the weights file size (0 on a cache hit).
    """

    artifact_dir: Path
    artifact_id: str
    cached: bool
    quality: QualityReport | None
    tensors: int
    bytes_written: int
    seconds: float
