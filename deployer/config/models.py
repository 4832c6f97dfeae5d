"""The deploy.yaml and inventory models (pydantic v2, unknown fields rejected).

These are the trust boundary for configuration: everything past `deployer.config.load_config`
works with a validated, frozen `Config`. Field names are the contract the other parts code to;
`schemas/deploy.schema.json` is generated from these classes (`sits-deployer schema`).

Shorthands: ``strategy: canary`` means ``strategy: {type: canary}``; a hook may be a bare path.
Durations become `timedelta`, CPU becomes millicores (int), memory and disk become bytes (int).
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import timedelta
from ipaddress import IPv4Address
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    IPvAnyAddress,
    PlainSerializer,
    PrivateAttr,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import core_schema

from deployer.config.quantity import (
    DURATION_PATTERN,
    PERCENT_PATTERN,
    QUANTITY_PATTERN,
    RATE_PATTERN,
    format_duration,
    parse_cpu,
    parse_duration,
    parse_memory,
    parse_percent,
    parse_rate,
)
from deployer.core.yaml_words import on_off

API_VERSION: Final = "sits.dev/v1"  # Final: its type is the Literal the models declare
BUILTIN_SMOLLM2 = "builtin:smollm2-135m-instruct"
SEMVER_PATTERN = (
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?$"
)
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
DEVICE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"

Scheme = Literal["fp32", "fp16", "bf16", "int8", "int4", "layered", "auto"]
GroupSize = Literal[32, 64, 128]
GGUFInt4 = Literal["Q4_1", "Q4_0"]  # the gguf package quantizes these two 4-bit types (not the K-quants)
# llama.cpp's own quantizer's whole-model recipes (deployer/build/spec.py: LLAMA_QUANT_TYPES).
GGUFType = Literal["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"]
IMATRIX_GGUF_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K")  # those whose quantizer reads an importance matrix
StrategyType = Literal["all-at-once", "rolling", "canary", "blue-green"]
STRATEGY_TYPES: tuple[str, ...] = ("all-at-once", "rolling", "canary", "blue-green")
# bandwidth.max_in_flight: at least one SFTP write request (32 KiB); at most what a resume may send
# again without it being a download of its own.
MIN_IN_FLIGHT = 32 * 1024
MAX_IN_FLIGHT = 64 * 1024 * 1024


def _matches(pattern: str, what: str, example: str) -> AfterValidator:
    """A validator with a readable message instead of pydantic's raw regex."""
    compiled = re.compile(pattern)

    def check(value: str) -> str:
        if not compiled.match(value):
            raise ValueError(f"{value!r} is not a valid {what}; write it like {example}")
        return value

    return AfterValidator(check)


def _step(value: Any) -> int | str:
    """A canary step: a device count (>= 1) or a percentage of the fleet such as '25%'."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"a step must be at least 1 device, got {value}")
        return value
    if isinstance(value, str):
        parse_percent(value)
        return value
    raise ValueError(f"a step is a device count or a percentage like '25%', got {value!r}")


def _count_or_percent(value: Any) -> int | str:
    """A device count (>= 0) or a percentage of the fleet."""
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return 0
    return _step(value)


_COUNT_OR_PERCENT_SCHEMA = {
    "anyOf": [{"type": "integer", "minimum": 1}, {"type": "string", "pattern": PERCENT_PATTERN}]
}
Duration = Annotated[
    timedelta,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "pattern": DURATION_PATTERN, "examples": ["30s", "5m"]}),
]
Cpu = Annotated[
    int,
    BeforeValidator(parse_cpu),
    WithJsonSchema(
        {"anyOf": [{"type": "string", "pattern": QUANTITY_PATTERN}, {"type": "number"}]},
        mode="validation",
    ),
]
Memory = Annotated[
    int,
    BeforeValidator(parse_memory),
    WithJsonSchema(
        {"anyOf": [{"type": "string", "pattern": QUANTITY_PATTERN}, {"type": "integer"}]},
        mode="validation",
    ),
]
Rate = Annotated[
    float,
    BeforeValidator(parse_rate),
    WithJsonSchema({"type": "string", "pattern": RATE_PATTERN, "examples": ["2Mbit", "1MB/s"]}),
]
Step = Annotated[int | str, BeforeValidator(_step), WithJsonSchema(_COUNT_OR_PERCENT_SCHEMA)]
CountOrPercent = Annotated[
    int | str, BeforeValidator(_count_or_percent), WithJsonSchema(_COUNT_OR_PERCENT_SCHEMA)
]
Semver = Annotated[
    str,
    _matches(SEMVER_PATTERN, "semantic version", "'1.2.0'"),
    WithJsonSchema({"type": "string", "pattern": SEMVER_PATTERN}),
]
DnsName = Annotated[
    str,
    _matches(DNS_LABEL_PATTERN, "name (lowercase letters, digits, '-')", "'sits-prod-v3'"),
    WithJsonSchema({"type": "string", "pattern": DNS_LABEL_PATTERN}),
]
DeviceName = Annotated[
    str,
    _matches(DEVICE_NAME_PATTERN, "device name (letters, digits, '.', '_', '-')", "'edge-01'"),
    WithJsonSchema({"type": "string", "pattern": DEVICE_NAME_PATTERN}),
]
EnvName = Annotated[
    str,
    _matches(ENV_NAME_PATTERN, "environment variable name", "'SITS_SIGNING_PASSPHRASE'"),
    WithJsonSchema({"type": "string", "pattern": ENV_NAME_PATTERN}),
]
FilePath = Annotated[str, Field(min_length=1)]
Port = Annotated[int, Field(ge=1, le=65535)]


class BareString:
    """Annotation: accept a bare string as shorthand for ``{key: string}`` (and say so in the schema)."""

    def __init__(self, key: str, short: dict[str, Any]) -> None:
        self.key = key
        self.short = short

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_before_validator_function(self._expand, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> dict[str, Any]:
        return {"anyOf": [self.short, handler(schema)]}

    def _expand(self, value: Any) -> Any:
        return {self.key: value} if isinstance(value, str) else value


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class QuantOverride(_Model):
    """A different scheme for the modules whose names match ``pattern`` (fnmatch, e.g. '*.mlp.*')."""

    pattern: Annotated[str, Field(min_length=1)]
    scheme: Scheme
    group_size: GroupSize | None = None


class Quantization(_Model):
    """How weights are stored. ``layered``: embeddings/head fp16, attention int4, MLP int8.
    ``auto`` (torch engine; needs ``max_size``, the stored tensors' bytes, e.g. ``120M``): each
    decoder linear int4-g128, int4-g32 or int8, chosen by its sensitivity measured on
    ``calibration`` (the estimated KL increase with that linear alone changed), greedily by KL
    removed per byte within ``max_size``; the choice and the measurements go in the manifest.
    Measured on SmolLM2 (held-out text): ``auto`` at 4.8 bits per weight +3.0 % perplexity, mean
    KL 0.034, where ``layered`` (7.2 bits) gives +16.3 %, 0.163 (docs/concepts.md).

    int4 groups keep their own range where that fits them best (artifact format 2). ``awq``:
    activation-aware scaling (torch engine): per-input-channel scales searched on
    ``calibration`` (a UTF-8 text file relative to deploy.yaml, at least 200 words; default: a
    text shipped with sits-deployer), folded into the norms and linears before quantizing; same
    size, same speed. The calibration
    text must differ from ``quality_gate.eval_text``. Measured on SmolLM2 (held-out text,
    perplexity vs fp32): int4 group 32 +0.00 % at 5.0 bits per weight; group 128 +38.6 % plain,
    +11.6 % with awq, at 4.6 (docs/concepts.md, "Choosing a quantization"). ``gptq``: int4
    weights rounded by GPTQ (error-compensating, on the same ``calibration`` text), after AWQ's
    scaling when ``awq`` is on too; same format, size and speed. On SmolLM2 int4 group 128:
    +33.5 % alone, +12.4 % with awq (mean KL 0.133 against awq's 0.145, top-1 0.788 against 0.769).

    ``gguf_int4`` picks the GGUF type of int4 weights for ``agent.engine: llama.cpp``: Q4_1
    (asymmetric, with a per-block minimum, like the torch engine's int4) or Q4_0 (symmetric:
    10% smaller, a little less accurate).

    ``gguf_type`` (``agent.engine: llama.cpp`` only) has llama.cpp's own quantizer make the GGUF
    from an f16 one, with its per-tensor recipe: Q4_K_M, Q5_K_M, Q6_K or Q8_0 (``scheme``,
    ``group_size``, ``overrides`` and ``gguf_int4`` then do not apply). The K-quants weigh
    rounding errors by an importance matrix computed on ``calibration`` (default: the shipped
    text) unless ``imatrix: false``.
    """

    scheme: Scheme = "int8"
    group_size: GroupSize = 128
    overrides: list[QuantOverride] = []
    max_size: Memory | None = None
    awq: bool = False
    gptq: bool = False
    calibration: FilePath | None = None
    gguf_int4: GGUFInt4 = "Q4_1"
    gguf_type: GGUFType | None = None
    imatrix: bool = True

    @property
    def uses_imatrix(self) -> bool:
        """True when llama.cpp's quantizer is given an importance matrix (so a calibration text)."""
        return self.imatrix and self.gguf_type in IMATRIX_GGUF_TYPES

    @property
    def uses_calibration(self) -> bool:
        """True when the build reads a calibration text (awq, gptq, auto or an importance matrix)."""
        return self.awq or self.gptq or self.scheme == "auto" or self.uses_imatrix

    def scheme_for(self, module: str) -> tuple[Scheme, int]:
        """(scheme, group size) of a linear module such as 'model.layers.0.mlp.up_proj'.

        The first override whose pattern matches wins; then ``layered`` picks int4 for attention
        and int8 for MLP modules (anything else fp16); ``auto`` int8, the widest it may choose
        for a decoder linear (what it chooses is known only once built); otherwise the top-level
        scheme applies.
        """
        for override in self.overrides:
            if fnmatch.fnmatchcase(module, override.pattern):
                return override.scheme, override.group_size or self.group_size
        if self.scheme == "layered":
            if ".self_attn." in module:
                return "int4", self.group_size
            return ("int8" if ".mlp." in module else "fp16"), self.group_size
        if self.scheme == "auto":
            return "int8", self.group_size
        return self.scheme, self.group_size


class QualityGate(_Model):
    """Limits the quantized model must stay within, measured on ``eval_text``, or the build fails."""

    eval_text: FilePath
    max_tokens: Annotated[int, Field(ge=16)] = 512
    max_perplexity_increase_pct: Annotated[float, Field(ge=0)] = 5.0
    min_top1_agreement: Annotated[float, Field(ge=0, le=1)] = 0.9
    max_mean_kl: Annotated[float, Field(ge=0)] | None = None


class AdapterSpec(_Model):
    """A LoRA adapter of the model, shipped and rolled out as a release of its own
    (docs/operating.md, "LoRA adapters"): built for each base artifact, signed with a counter of its
    own, rolled back alone (``rollback --adapter``), hot-loaded beside the base, which serves on.

    ``validate`` reads ``adapter_config.json`` and the safetensors header (no tensor data) and
    reports at the adapter's ``source``: a missing file; a PEFT variant one low-rank pair per module
    cannot carry (``use_dora``, ``use_rslora``, ``rank_pattern``, ``alpha_pattern``,
    ``modules_to_save``, a ``peft_type`` other than LORA); a module the base lacks (LoRA targets
    are the decoder's q/k/v/o and gate/up/down projections of its layers); a factor whose shape is
    not ``r`` and the base module's in/out features (a rank that does not match the tensors, or an
    adapter of a base of another shape); a ``base_model_name_or_path`` that names another base; at
    ``name``, a name used twice or the model's own. The build refuses NaN or infinite factors and,
    with ``model.quality_gate``, gates each adapter: the quantized base with its fp16 factors
    against the fp32 source with it merged in, on ``eval_text`` (a safetensors base only).

    Measured on SmolLM2-135M-Instruct int8 (166.9 MB): a rank-8 q/v adapter is 0.94 MB (0.56 % of
    the base) and an update from its previous version a 0.86 MB patch (0.52 %), where the fine-tune
    merged into a new model would reload the whole base (bench/adapter_bytes.py). On the torch
    engine requests for different adapters share decode steps: 1, 4 and 16 clients on 4 adapters got
    0.90, 0.80 and 1.04 times the tokens per second of as many clients on the base, on 2 shared
    cores under load, and 0.84, 0.85 and 0.93 times on an H100, where steps with adapter rows
    replay CUDA graphs of their own (bench/adapters.py; docs/openai-api.md). The llama.cpp engine
    serves the adapter's LoRA GGUF, which the build writes for a GGUF base; llama.cpp applies an
    adapter to a whole context, so there requests for different adapters do not batch together: 4
    clients on 4 adapters got 0.45 times the base's tokens per second, on one adapter 0.93
    (bench/adapters.py --engine llama.cpp).
    """

    name: Annotated[
        DnsName,
        Field(description="The model id clients select it by (the answer names `name@version`)."),
    ]
    version: Annotated[
        Semver,
        Field(
            description="Its own version; raising it releases the new factors, as a patch from the "
            "version a device has."
        ),
    ]
    source: Annotated[
        FilePath,
        Field(
            description="A PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`, "
            "as `peft`'s `save_pretrained` writes them), relative to deploy.yaml."
        ),
    ]
    scale: Annotated[
        float,
        Field(
            gt=0,
            le=16,
            description="Multiplies the adapter's effect: its factor is `scale * lora_alpha / r`.",
        ),
    ] = 1.0
    base_sha256: Annotated[
        str | None,
        Field(
            pattern=r"^[0-9a-f]{64}$",
            description="Pins the base: the build refuses a source model whose hash (the artifact "
            "manifest's `source.sha256`) differs.",
        ),
    ] = None


class ModelSpec(_Model):
    """The model to ship: an HF-layout directory (relative to deploy.yaml) or the builtin demo."""

    name: DnsName
    version: Semver
    source: Annotated[str, Field(min_length=1)]
    quantization: Quantization = Quantization()
    quality_gate: QualityGate | None = None
    adapters: list[AdapterSpec] = []

    @field_validator("source")
    @classmethod
    def _known_builtin(cls, source: str) -> str:
        if source.startswith("builtin:") and source != BUILTIN_SMOLLM2:
            raise ValueError(f"unknown builtin model {source!r}; use {BUILTIN_SMOLLM2!r}")
        return source

    @property
    def is_builtin(self) -> bool:
        """True when the source is the embedded demo model rather than a directory."""
        return self.source == BUILTIN_SMOLLM2


class Signing(_Model):
    """Release signing: the private key (build/release only) and the keys devices trust."""

    private_key: FilePath | None = None
    passphrase_env: EnvName = "SITS_SIGNING_PASSPHRASE"
    trusted_keys: list[FilePath] = []
    threshold: Annotated[int, Field(ge=1)] = 1
    expires_in: Duration = Field(default="30d", validate_default=True)


class Channel(_Model):
    """A pull channel (a ring such as canary or stable): devices whose labels match ``selector`` poll it."""

    name: DnsName
    selector: dict[str, str] = {}


class RoleKeys(_Model):
    """The keys of one TUF role: public key files (``.pub``), ``threshold`` of which must sign.

    The private half, ``<name>.key`` beside each ``<name>.pub`` (as ``sits-deployer keygen`` writes
    them), is read only when the role signs, so root and targets keys can stay offline.
    """

    keys: Annotated[list[FilePath], Field(min_length=1)]
    threshold: Annotated[int, Field(ge=1)] = 1

    @field_validator("keys")
    @classmethod
    def _public_files(cls, keys: list[str]) -> list[str]:
        for key in keys:
            if not key.endswith(".pub"):
                raise ValueError(
                    f"{key!r}: name the public key (.pub); its private half <name>.key is read beside it"
                )
        if len(set(keys)) != len(keys):
            raise ValueError("a key is named twice")
        return keys

    @model_validator(mode="after")
    def _threshold_met(self) -> RoleKeys:
        if self.threshold > len(self.keys):
            raise ValueError(
                f"threshold {self.threshold} cannot be met by {len(self.keys)} key(s): "
                "name more keys or lower the threshold"
            )
        return self


class Roles(_Model):
    """Keys per TUF role. A role left out is signed by ``signing.private_key`` alone.

    Keep root and targets offline (publishing a new release needs targets; rotating or renewing the
    root needs root); timestamp and snapshot are online: a routine re-sign needs only them.
    """

    root: RoleKeys | None = None
    targets: RoleKeys | None = None
    snapshot: RoleKeys | None = None
    timestamp: RoleKeys | None = None


class Publish(_Model):
    """Pull mode: signed TUF channels on static HTTP or S3 (``sits-deployer publish``) that devices poll.

    The TUF roles are signed with the keys under ``roles`` (default: ``signing.private_key``). Targets
    and snapshot live as long as ``signing.expires_in``; only the timestamp is short-lived: re-publish
    (or re-sign it) more often than ``timestamp_expires``. With ``base_url`` set, ``apply`` provisions
    each device whose labels match a channel to poll ``<base_url>/<channel>/``.
    """

    channels: Annotated[list[Channel], Field(min_length=1)] = [Channel(name="stable")]
    base_url: Annotated[str, Field(pattern=r"^https?://")] | None = None
    roles: Roles = Roles()
    timestamp_expires: Duration = Field(default="1d", validate_default=True)
    root_expires: Duration = Field(default="365d", validate_default=True)
    patch_bases: Annotated[int, Field(ge=0, le=32)] = 3

    @field_validator("channels")
    @classmethod
    def _unique_names(cls, channels: list[Channel]) -> list[Channel]:
        names = [c.name for c in channels]
        if len(set(names)) != len(names):
            raise ValueError(f"channel names must be unique, got {', '.join(names)}")
        return channels

    def channel_for(self, labels: Mapping[str, str]) -> Channel | None:
        """The channel a device with these labels polls: the first whose selector they all match."""
        return next(
            (c for c in self.channels if all(labels.get(k) == v for k, v in c.selector.items())), None
        )


class UpstreamKey(_Model):
    """Where the controller finds the fallback upstream's API key: never in deploy.yaml itself.

    `env` names an environment variable, `file` a secrets file whose first line is the key (relative
    to deploy.yaml). The controller sends it to each device as a 0600 file only the agent reads.
    """

    env: EnvName | None = None
    file: FilePath | None = None

    @model_validator(mode="after")
    def _one_source(self) -> UpstreamKey:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of env (a variable name) or file (a secrets file)")
        return self


class Upstream(_Model):
    """The OpenAI-compatible model a device falls back to: a bigger model, or another device's agent."""

    base_url: Annotated[str, Field(pattern=r"^https?://[^\s]+$", examples=["http://10.0.0.5:8080/v1"])]
    model: Annotated[str, Field(min_length=1)]
    api_key: UpstreamKey | None = None
    first_token_timeout: Duration = Field(default="10s", validate_default=True)


class FallbackTriggers(_Model):
    """When a device under ``policy: on-trigger`` asks the upstream instead of its own model.

    ``min_confidence`` (off unless set; 0.6 is a usual value) compares the mean probability of the
    device's first ``confidence_tokens`` tokens; a stream holds those tokens back until they are
    judged (docs/fallback.md).
    """

    deadline_ms: Annotated[int, Field(ge=1)] | None = 300
    min_confidence: Annotated[float, Field(gt=0, lt=1)] | None = None
    confidence_tokens: Annotated[int, Field(ge=1, le=64)] = 4
    not_ready: bool = True
    overloaded: bool = True


class Fallback(_Model):
    """Edge-cloud fallback (docs/fallback.md): per request, the device's model or the upstream's.

    Set fleet-wide at the top level; a profile's or a device's ``fallback`` overrides the fields it
    sets (``policy: off`` turns it off there).
    """

    policy: Annotated[Literal["off", "on-trigger", "always"], BeforeValidator(on_off)] = "on-trigger"
    upstream: Upstream | None = None
    triggers: FallbackTriggers = FallbackTriggers()


def merge_fallbacks(*layers: Fallback | None) -> Fallback | None:
    """Later layers' explicitly set fields over earlier ones' (dicts merged key by key)."""

    def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for key, value in over.items():
            out[key] = (
                merge(out[key], value)
                if isinstance(value, dict) and isinstance(out.get(key), dict)
                else value
            )
        return out

    given = [layer for layer in layers if layer is not None]
    if not given:
        return None
    data: dict[str, Any] = {}
    for layer in given:
        data = merge(data, layer.model_dump(mode="json", exclude_unset=True))
    return Fallback.model_validate(data)


class Bandwidth(_Model):
    """A device's link (docs/operating.md, "Slow and metered links"). Set fleet-wide at the top
    level; a profile's or a device's ``bandwidth`` overrides the fields it sets.

    ``rate`` caps what one device is sent (push) or downloads (pull), in bits or bytes per second
    (``2Mbit``, ``1MB/s``). On a ``metered`` link a device that runs a model gets patches only:
    where no patch from its version can be made, the full artifact is sent (or downloaded) only
    with ``allow_full_on_metered``; otherwise plan marks it blocked and says why.

    ``max_in_flight`` (push over SSH, ``32Ki`` to ``64Mi``) bounds the upload bytes sent but not
    yet acknowledged by the device (``256Ki`` when unset): what a cut link loses and the resume
    sends again. A link whose rate times round trip exceeds it runs below its rate: raise it there
    (a 10 Mbit/s satellite link with a 600 ms round trip needs about ``1Mi``); the device's SSH
    channel window bounds it too.
    """

    rate: Rate | None = None
    metered: bool = False
    allow_full_on_metered: bool = False
    max_in_flight: Annotated[Memory, Field(ge=MIN_IN_FLIGHT, le=MAX_IN_FLIGHT)] | None = None


class FleetBandwidth(Bandwidth):
    """The fleet's ``bandwidth``: the devices' defaults, and totals over every device at once.

    ``push_total`` is shared by every upload of one apply (whatever ``--parallel``); ``pull_total``
    is split evenly among the devices that poll a channel (each polls by itself, so each gets its
    share as its own cap).
    """

    push_total: Rate | None = None
    pull_total: Rate | None = None


@dataclass(frozen=True)
class Link:
    """One device's resolved link: its own rate cap (bytes/s, None: no limit) and metering."""

    rate: float | None = None
    metered: bool = False
    allow_full_on_metered: bool = False
    max_in_flight: int | None = None  # bytes; None: the transport's default


class Device(_Model):
    """One edge device and how to reach it."""

    name: DeviceName
    host: str | None = None
    port: Port = 22
    user: Annotated[str, Field(min_length=1)] = "root"
    identity_file: FilePath | None = None
    known_hosts: FilePath | None = None
    trust_on_first_use: bool = False
    labels: dict[str, str] = {}
    profile: str | None = None
    transport: Literal["ssh", "local"] = "ssh"
    root: FilePath = "/"
    python: Annotated[str, Field(min_length=1)] = "python3"
    agent_port: Port | None = None  # the agent's HTTP port on this device (default: agent.port)
    fallback: Fallback | None = None  # overrides the profile's and the fleet's
    bandwidth: Bandwidth | None = None  # overrides the profile's and the fleet's


class Fleet(_Model):
    """The devices, inline and/or from an inventory file (relative to deploy.yaml)."""

    devices: list[Device] = []
    inventory: FilePath | None = None

    @model_validator(mode="after")
    def _has_devices(self) -> Fleet:
        if not self.devices and self.inventory is None:
            raise ValueError("the fleet has no devices: list them under devices or name an inventory")
        return self


class Inventory(_Model):
    """An inventory file: the same device list as ``fleet.devices``."""

    api_version: Literal["sits.dev/v1"] = Field(default=API_VERSION, alias="apiVersion")
    kind: Literal["Inventory"] = "Inventory"
    devices: Annotated[list[Device], Field(min_length=1)]


class Profile(_Model):
    """A device class, e.g. jetson-orin-nx: what one such device offers."""

    memory: Memory
    cpu: Cpu | None = None
    disk: Memory | None = None
    accelerator: Annotated[
        str | None,
        Field(
            description="The device's GPU or NPU, by any name (nvidia-orin, ...). Named, the agent's "
            "unit keeps device nodes visible (no PrivateDevices=) so the agent can use it; unnamed, "
            "they are hidden and agent.device cuda is refused by validate."
        ),
    ] = None
    torch: Annotated[
        Literal["wheelhouse", "system"],
        Field(
            description="Where the agent's torch comes from. wheelhouse: the controller sends it with "
            "the other wheels. system: the device's own (Jetson boards get torch from NVIDIA's JetPack "
            "wheels); the agent's venv sees the system site packages (or the agent runs in the "
            "device's configured `python`) and the wheelhouse leaves torch out."
        ),
    ] = "wheelhouse"
    fallback: Fallback | None = None  # overrides the fleet's for this profile's devices
    bandwidth: Bandwidth | None = None  # overrides the fleet's for this profile's devices


class Strategy(_Model):
    """How the fleet is updated. ``steps`` are cumulative device counts or percentages (canary)."""

    type: StrategyType = "all-at-once"
    batch_size: Annotated[int, Field(ge=1)] | None = None
    max_unavailable: Annotated[int, Field(ge=1)] | None = None
    steps: list[Step] | None = None
    pause: Duration = Field(default="0s", validate_default=True)
    analysis_window: Duration = Field(default="60s", validate_default=True)
    failure_threshold: CountOrPercent = 1
    auto_rollback: bool = True
    offline: Literal["skip", "fail"] = "fail"
    selector: dict[str, str] = {}

    def resolved_steps(self, fleet_size: int) -> list[int]:
        """Cumulative device counts per step, ending at the whole fleet (canary default 1, 50%)."""
        raw: list[int | str] = self.steps if self.steps is not None else [1, "50%"]
        counts = [min(fleet_size, _count(step, fleet_size)) for step in raw]
        return counts if counts and counts[-1] == fleet_size else [*counts, fleet_size]

    def failure_limit(self, fleet_size: int) -> int:
        """Failed devices at which the rollout halts (0 means: never halt)."""
        return _count(self.failure_threshold, fleet_size)


def _count(value: int | str, fleet_size: int) -> int:
    if isinstance(value, int):
        return value
    return max(1, math.ceil(parse_percent(value) * fleet_size / 100))


class Health(_Model):
    """What 'healthy' means after an update."""

    readiness_timeout: Duration = Field(default="120s", validate_default=True)
    smoke_prompts: list[Annotated[str, Field(min_length=1)]] = ["Reply with the single word: ok"]
    latency_budget_ms: Annotated[int, Field(ge=1)] = 5000


class Resources(_Model):
    """The quota the agent runs under on each device (Kubernetes notation)."""

    cpu: Cpu | None = None
    memory: Memory | None = None


class Hook(_Model):
    """A script run around a deployment, relative to deploy.yaml. A bare path is shorthand."""

    path: FilePath
    timeout: Duration = Field(default="5m", validate_default=True)


HookField = Annotated[Hook | None, BareString("path", {"type": "string", "minLength": 1})]


class Hooks(_Model):
    """Scripts run with SITS_DEVICE, SITS_HOST, SITS_FROM_VERSION, SITS_TO_VERSION, SITS_PHASE."""

    pre_deploy: HookField = Field(default=None, alias="pre-deploy")
    post_deploy: HookField = Field(default=None, alias="post-deploy")
    pre_rollback: HookField = Field(default=None, alias="pre-rollback")
    post_rollback: HookField = Field(default=None, alias="post-rollback")


class ApiKeys(_Model):
    """Where the controller finds the agent's bearer API keys: never in deploy.yaml itself.

    `env` names an environment variable holding the keys (separated by commas or whitespace);
    `file` a secrets file, one key per line (relative to deploy.yaml). The device stores only their
    SHA-256 (/etc/sits/api-keys); the controller sends the first key with its own requests.
    """

    env: EnvName | None = None
    file: FilePath | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ApiKeys:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of env (a variable name) or file (a secrets file)")
        return self


class AgentSettings(_Model):
    """The device agent's serving settings."""

    engine: Literal["torch", "llama.cpp"] = "torch"
    device: Annotated[
        Literal["auto", "cpu", "cuda"],
        Field(
            description="Where the model runs. auto: the GPU when torch on the device sees a CUDA "
            "device, else the CPU (`/v1/models` and the agent's journal say which and why). cuda: "
            "the GPU, or the load fails; an ssh device's profile must then name its `accelerator`, "
            "whose device nodes its agent unit otherwise hides (validate checks). The llama.cpp "
            "engine runs on the CPU (auto); it refuses cuda."
        ),
    ] = "auto"
    compile: Annotated[
        Literal["auto", "on", "off"],
        BeforeValidator(on_off),
        Field(
            description="Whether the torch engine compiles decode with inductor. auto: on CUDA only. "
            "on: on a CPU too, for faster decode (1.5-1.8x on SmolLM2 int4), compiled in the "
            "background while the model already serves eager steps: the first compile takes minutes "
            "(258-354 s on two slow cores; later loads reuse the cache under /var/lib/sits/cache), "
            "uses the cores meanwhile, and needs a C++ compiler and the Python headers on the device "
            "(without them the agent serves eager, and /v1/models says why). Not for llama.cpp."
        ),
    ] = "auto"
    draft: Annotated[
        Literal["off", "int4"],
        Field(
            description="Speculative decoding in the torch engine on a CPU. int4: an int4 copy of "
            "the model, made at load, proposes up to 5 tokens at a time (fewer where it is unsure) "
            "and one pass of the model checks them, so a lone greedy request gets several tokens "
            "for about one read of the weights: "
            "the text is the model's own, only faster (SmolLM2 fp32: see docs/torch-engine.md). "
            "Requests that sample, or that carry logprobs, penalties, biases or a grammar, and "
            "steps of several requests at once decode as without it. For fp32, bf16, fp16 and "
            "int8 models (an int4 model would be its own draft); costs the int4 copy's memory "
            "(about 170 MB for SmolLM2-135M, which validate's memory estimate counts). "
            "Not for CUDA or llama.cpp."
        ),
    ] = "off"
    kv_cache_type: Annotated[
        Literal["auto", "fp32", "fp16", "bf16", "int8"],
        Field(
            description="How the torch engine stores its KV cache (llama.cpp's --cache-type-k/-v): "
            "fp32, fp16, bf16, or int8 (symmetric per position and head, an fp32 scale each, "
            "roughly llama.cpp's q8_0; CPU only). On a CPU attention runs in fp32 whatever the "
            "storage, converting the positions it reads: fp16 halves the cache, int8 quarters it "
            "(Llama-3-8B, 4 x 2,048 positions: 2.15 GB at fp32), for a small cost in speed and, "
            "for int8, in accuracy (see docs/torch-engine.md). auto: fp32 on a CPU, the model's "
            "dtype on CUDA. Not for llama.cpp."
        ),
    ] = "auto"
    # Loopback by default; beyond it every route but /healthz and /readyz needs an API key.
    host: IPvAnyAddress = IPv4Address("127.0.0.1")
    api_keys: ApiKeys | None = None
    port: Port = 8080
    max_concurrent: Annotated[int, Field(ge=1)] = 4
    queue_length: Annotated[int, Field(ge=0)] = 16
    max_tokens: Annotated[int, Field(ge=1)] = 512
    swap_policy: Literal["side-by-side", "unload-first", "auto"] = "auto"

    @model_validator(mode="after")
    def _keys_beyond_loopback(self) -> AgentSettings:
        if not self.host.is_loopback and self.api_keys is None:
            raise ValueError(
                f"host {self.host} serves beyond loopback: set agent.api_keys (env or file) so that "
                "the API needs a key"
            )
        return self


class Config(_Model):
    """A whole deploy.yaml (with inventory devices merged into ``fleet.devices``)."""

    api_version: Literal["sits.dev/v1"] = Field(default=API_VERSION, alias="apiVersion")
    kind: Literal["Deployment"] = "Deployment"
    application: DnsName
    namespace: DnsName = "default"
    model: ModelSpec
    signing: Signing | None = None
    fleet: Fleet
    profiles: dict[str, Profile] = {}
    strategy: Annotated[Strategy, BareString("type", {"type": "string", "enum": list(STRATEGY_TYPES)})] = (
        Strategy()
    )
    health: Health = Health()
    resources: Resources = Resources()
    hooks: Hooks = Hooks()
    agent: AgentSettings = AgentSettings()
    publish: Publish | None = None
    fallback: Fallback | None = None
    bandwidth: FleetBandwidth | None = None

    _path: Path | None = PrivateAttr(default=None)

    @property
    def base_dir(self) -> Path:
        """The directory relative paths in this config are resolved against."""
        # Absolute, so a path resolved here means the same from any working directory
        # (device commands run with their own cwd).
        return self._path.absolute().parent if self._path is not None else Path.cwd()

    def resolve(self, relative: str) -> Path:
        """A path from this config (``~`` expanded) resolved against `base_dir`."""
        path = Path(relative).expanduser()
        return path if path.is_absolute() else self.base_dir / path

    def fallback_for(self, device: Device) -> Fallback | None:
        """The device's fallback: the fleet's, then its profile's and its own fields over it."""
        profile = self.profiles.get(device.profile) if device.profile else None
        return merge_fallbacks(self.fallback, profile.fallback if profile else None, device.fallback)

    def link_for(self, device: Device) -> Link:
        """The device's link: the fleet's ``bandwidth``, then its profile's and its own fields over it."""
        profile = self.profiles.get(device.profile) if device.profile else None
        own = {f.name for f in fields(Link)}  # the fleet's totals are not a device's
        merged: dict[str, Any] = {}
        for layer in (self.bandwidth, profile.bandwidth if profile else None, device.bandwidth):
            if layer is not None:
                merged |= {k: getattr(layer, k) for k in layer.model_fields_set & own}
        return Link(**merged)
