"""The `sits-manifest.json` of an artifact (docs/artifact-format.md) as pydantic models.

Imports only pydantic and the standard library (no torch, no build code), so the device agent
can read manifests with it and the build spec can share its scheme names cheaply.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
)

from deployer.core.canonical import parse_json
from deployer.errors import FormatError

MANIFEST_NAME = "sits-manifest.json"
# 2: int4 zero points are fp16 (exact-range int4) and the spec may record activation-aware
# scaling or llama.cpp's quantizer. The builder writes 2 only where an artifact needs it (int4
# weights or AWQ in a safetensors artifact, a `gguf_type` GGUF), so other artifacts stay
# readable by agents that know only 1.
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)
SHA256_PATTERN = r"^[0-9a-f]{64}$"
# The manifest describes every file; it is small, so anything larger is refused unread.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
# The storage schemes a module entry may name (`ModuleInfo.scheme`).
FLOAT_SCHEMES = ("fp32", "fp16", "bf16")
INTEGER_SCHEMES = ("int8", "int4")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class ModelInfo(_Strict):
    """Which model this is."""

    name: str
    version: str
    architecture: str


class SourceInfo(_Strict):
    """The source checkpoint the artifact was built from."""

    sha256: str = Field(pattern=SHA256_PATTERN)


class OverrideInfo(_Strict):
    """One per-module override, as asked."""

    pattern: str
    scheme: str
    group_size: int | None = None


class AwqInfo(_Strict):
    """Activation-aware scaling (format 2): which calibration text chose the scales."""

    calibration_sha256: str = Field(pattern=SHA256_PATTERN)
    tokens: int = Field(ge=1)


class ImatrixInfo(_Strict):
    """The importance matrix llama.cpp's quantizer weighed rounding errors by: its digest, and
    the calibration text (and how many of its tokens) it was computed on."""

    sha256: str = Field(pattern=SHA256_PATTERN)
    tokens: int = Field(ge=1)
    calibration_sha256: str = Field(pattern=SHA256_PATTERN)


class GgufInfo(_Strict):
    """A GGUF made by llama.cpp's own quantizer (format 2): its recipe, and the matrix if any."""

    type: Literal["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"]
    imatrix: ImatrixInfo | None


class AutoModuleInfo(_Strict):
    """One decoder linear of `scheme: auto`: the precision chosen, and the estimated mean KL per
    token (reference || quantized) of each precision, measured with that linear alone changed."""

    choice: Literal["int4-g128", "int4-g32", "int8"]
    kl: dict[str, float]


class AutoInfo(_Strict):
    """Measured mixed precision (format 2): the calibration text it measured on, how many of its
    tokens, the stored tensors' bytes, and each chosen linear's record."""

    calibration_sha256: str = Field(pattern=SHA256_PATTERN)
    tokens: int = Field(ge=1)
    size: int = Field(ge=0)
    modules: dict[str, AutoModuleInfo]


class SpecInfo(_Strict):
    """The quantization spec, as asked (presets not expanded); `max_size`, `auto`, `awq` and `gguf`
    only in format 2, and absent (not null) when not used, so format 1 manifests keep their bytes."""

    scheme: str
    group_size: int
    overrides: list[OverrideInfo]
    max_size: int | None = Field(default=None, ge=1)
    auto: AutoInfo | None = None
    awq: AwqInfo | None = None
    gguf: GgufInfo | None = None

    @model_serializer(mode="wrap")
    def _omit_unused(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for key in ("max_size", "auto", "awq", "gguf"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ModuleInfo(_Strict):
    """How one 2-D weight is stored; `in_padded` > `in` only for padded int4."""

    scheme: Literal["fp32", "fp16", "bf16", "int8", "int4"]
    group_size: int | None
    in_features: int = Field(alias="in", ge=1)
    in_padded: int = Field(ge=1)
    out: int = Field(ge=1)


class QuantizationInfo(_Strict):
    """The spec and, per module, what it resolved to."""

    spec: SpecInfo
    modules: dict[str, ModuleInfo]


class FileInfo(_Strict):
    """One file of the artifact."""

    sha256: str = Field(pattern=SHA256_PATTERN)
    size: int = Field(ge=0)


class TensorInfo(_Strict):
    """One stored tensor; `sha256` is over its raw little-endian bytes."""

    file: str
    dtype: str
    shape: list[int]
    sha256: str = Field(pattern=SHA256_PATTERN)


class PerplexityInfo(_Strict):
    """Perplexity of the unquantized and the quantized model on the eval text."""

    reference: float
    quantized: float
    increase_pct: float


class QualityInfo(_Strict):
    """What the quality gate measured."""

    eval_sha256: str = Field(pattern=SHA256_PATTERN)
    tokens: int
    perplexity: PerplexityInfo
    top1_agreement: float
    mean_kl: float


class BuilderInfo(_Strict):
    """What built it."""

    name: str
    version: str


class ArtifactManifest(_Strict):
    """The whole manifest. Its canonical bytes' sha256 is the artifact id."""

    format_version: Literal[1, 2]
    kind: Literal["sits-artifact"]
    model: ModelInfo
    source: SourceInfo
    quantization: QuantizationInfo
    files: dict[str, FileInfo]
    tensors: dict[str, TensorInfo]
    quality: QualityInfo | None
    builder: BuilderInfo

    def to_json(self) -> dict:
        """The JSON object (with the manifest's own key names, e.g. "in")."""
        return self.model_dump(mode="json", by_alias=True)


def parse_manifest(data: bytes, where: str) -> ArtifactManifest:
    """Parse manifest bytes; raises FormatError naming `where` and the first problem."""
    doc = parse_json(data, where)
    version = doc.get("format_version") if isinstance(doc, dict) else None
    if isinstance(version, int) and version not in READ_VERSIONS:
        raise FormatError(
            f"{where}: artifact format_version {version} is not one this sits-deployer reads "
            f"({', '.join(map(str, READ_VERSIONS))})",
            hint="upgrade sits-deployer (the device agent) to install it, or build the artifact "
            "with the sits-deployer version the devices run",
        )
    try:
        manifest = ArtifactManifest.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise FormatError(
            f"{where}: invalid manifest at {loc or '<root>'}: {first['msg']}",
            hint="the artifact is corrupt or from an incompatible builder; rebuild it",
        ) from exc
    spec = manifest.quantization.spec
    for key, value in (
        ("max_size", spec.max_size),
        ("auto", spec.auto),
        ("awq", spec.awq),
        ("gguf", spec.gguf),
    ):
        if manifest.format_version == 1 and value is not None:
            raise FormatError(
                f"{where}: invalid manifest: quantization.spec.{key} needs format_version 2",
                hint="the artifact is corrupt or from an incompatible builder; rebuild it",
            )
    return manifest


def read_manifest(artifact_dir: Path) -> ArtifactManifest:
    """Read and validate `<artifact_dir>/sits-manifest.json`. Raises FormatError."""
    path = artifact_dir / MANIFEST_NAME
    try:
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            raise FormatError(f"{path}: manifest larger than {MAX_MANIFEST_BYTES} bytes")
        data = path.read_bytes()
    except OSError as exc:
        raise FormatError(f"{path}: cannot read manifest ({exc.strerror or exc})") from exc
    return parse_manifest(data, str(path))
