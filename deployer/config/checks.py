"""Semantic checks beyond the schema: what pydantic cannot know from one field alone.

Unique device names, known profiles, reachable devices, referenced files that exist, executable
hooks, readable EC P-256 keys, selectors that select, strategy parameters that fit the fleet,
and resources (and the model) that fit each device profile. Each check looks only at the sections
that validated, so one broken section does not hide the problems of the others.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from deployer.config import fit
from deployer.config.adapters import adapter_findings, adapter_memory
from deployer.config.estimate import SMOLLM2_SHAPE, ModelShape, auto_size_bounds, estimate_memory
from deployer.config.findings import FieldPath, Finding
from deployer.config.keyfiles import KeyProblem, private_key_problem, public_key_problem
from deployer.config.models import (
    AgentSettings,
    Device,
    Fallback,
    Hooks,
    ModelSpec,
    Profile,
    Quantization,
    Resources,
    Signing,
    Strategy,
    merge_fallbacks,
)
from deployer.config.sourcemap import SourceMap
from deployer.core.architectures import unsupported_reason
from deployer.core.calibration import DEFAULT_CALIBRATION, MIN_WORDS, text_problem

GGUF_BLOCK = 32  # weights per GGUF 4-bit block (Q4_0/Q4_1)


@dataclass(frozen=True)
class CheckInput:
    """The sections that validated (None where a section did not), and where they came from.

    ``devices`` is the whole fleet in order (inline, then inventory), with None for a device
    that did not validate; fleet-wide checks run only when every device did.
    """

    base_dir: Path
    positions: SourceMap
    environ: Mapping[str, str]
    model: ModelSpec | None = None
    signing: Signing | None = None
    devices: list[Device | None] | None = None
    profiles: dict[str, Profile] | None = None
    strategy: Strategy | None = None
    resources: Resources | None = None
    hooks: Hooks | None = None
    agent: AgentSettings | None = None
    secrets: bool = True  # False for commands that sign nothing: an encrypted key is not opened
    fallback: Fallback | None = None

    @property
    def fleet(self) -> list[Device] | None:
        """All devices, or None when any of them (or the inventory) did not validate."""
        if self.devices is None or any(d is None for d in self.devices):
            return None
        return [d for d in self.devices if d is not None]

    def resolve(self, relative: str) -> Path:
        """A config path (``~`` expanded) resolved against the directory of deploy.yaml."""
        path = Path(relative).expanduser()
        return path if path.is_absolute() else self.base_dir / path


def run_checks(given: CheckInput) -> list[Finding]:
    """Every semantic finding for the sections in ``given``."""
    findings = _device_findings(given) + _hook_findings(given) + _signing_findings(given)
    findings += _collision_findings(given)
    findings += _strategy_findings(given) + fit.plausibility_findings(
        given.profiles, given.resources, given.positions
    )
    shape, model_findings = _model_findings(given)
    if given.model is not None:
        model_findings += adapter_findings(given.model, shape, given.positions, given.resolve)
        model_findings += _auto_findings(given, given.model, shape)
    findings += model_findings + _engine_findings(given) + _agent_findings(given) + _fallback_findings(given)
    if given.fleet is not None and given.profiles is not None:
        used = {d.profile for d in given.fleet if d.profile}
        findings += fit.quota_findings(given.resources, given.profiles, used, given.positions)
        if shape is not None and given.model is not None and given.agent is not None:
            adapters = adapter_memory(given.model, given.resolve)
            estimate = estimate_memory(shape, given.model, given.agent, adapter_bytes=adapters)
            findings += fit.model_fit_findings(
                given.model, estimate, given.resources, given.profiles, used, given.positions
            )
            findings += fit.swap_policy_findings(
                given.model, estimate, given.agent, given.profiles, used, given.positions
            )
    return findings


def _device_findings(given: CheckInput) -> list[Finding]:
    if given.devices is None:
        return []
    findings: list[Finding] = []
    first: dict[str, int] = {}
    for index, device in enumerate(given.devices):
        if device is None:
            continue
        at = ("fleet", "devices", index)
        if device.name in first:
            earlier, _ = given.positions.locate(("fleet", "devices", first[device.name], "name"))
            findings.append(
                given.positions.finding(
                    (*at, "name"),
                    f"duplicate device name '{device.name}' (also at {earlier.file}:{earlier.line})",
                    "device names identify devices in plans and state: make them unique",
                )
            )
        first.setdefault(device.name, index)
        if device.profile and given.profiles is not None and device.profile not in given.profiles:
            findings.append(
                given.positions.finding(
                    (*at, "profile"),
                    f"unknown profile '{device.profile}'",
                    _suggest(device.profile, list(given.profiles), "define it under profiles"),
                )
            )
        if device.transport == "ssh" and not device.host:
            findings.append(
                given.positions.finding(
                    (*at, "host"),
                    f"device '{device.name}' uses ssh but has no host",
                    "add host: <address>, or use transport: local",
                )
            )
        for field in ("identity_file", "known_hosts"):
            value = getattr(device, field)
            if value is not None and not given.resolve(value).is_file():
                findings.append(_missing_file(given, (*at, field), value))
    return findings


def _collision_findings(given: CheckInput) -> list[Finding]:
    """Two devices on one host cannot share an agent port or a root: every request meant for the
    second would reach the first's agent, and their stores would overwrite each other."""
    fleet, agent = given.fleet, given.agent
    if fleet is None or agent is None:
        return []
    findings: list[Finding] = []
    seen: dict[tuple[str, str, object], int] = {}
    for index, device in enumerate(fleet):
        local = device.transport == "local"
        host = "this machine" if local else (device.host or device.name)
        root = str(given.resolve(device.root).resolve()) if local else device.root.rstrip("/") or "/"
        port = device.agent_port or agent.port
        for field, value, fix in (
            ("agent_port", port, "give each device on one host its own agent_port"),
            ("root", root, "give each device on one host its own root directory"),
        ):
            key = (host, field, value)
            if key in seen:
                other = fleet[seen[key]].name
                at = ("fleet", "devices", index, field)
                findings.append(
                    given.positions.finding(
                        at,
                        f"device '{device.name}' has the same {field} as '{other}' on {host}: {value}",
                        fix,
                    )
                )
            seen.setdefault(key, index)
    return findings


def _hook_findings(given: CheckInput) -> list[Finding]:
    if given.hooks is None:
        return []
    findings = []
    for name, info in Hooks.model_fields.items():
        hook = getattr(given.hooks, name)
        if hook is None:
            continue
        at = ("hooks", info.alias or name, "path")
        path = given.resolve(hook.path)
        if not path.is_file():
            findings.append(_missing_file(given, at, hook.path))
        elif not os.access(path, os.X_OK):
            findings.append(
                given.positions.finding(at, f"hook {hook.path} is not executable", f"chmod +x {hook.path}")
            )
    return findings


def _model_findings(given: CheckInput) -> tuple[ModelShape | None, list[Finding]]:
    """Problems with the model's files, and its shape when it could be read."""
    model = given.model
    if model is None:
        return None, []
    findings = _calibration_findings(given, model)
    gate = model.quality_gate
    if gate is not None and not given.resolve(gate.eval_text).is_file():
        findings.append(_missing_file(given, ("model", "quality_gate", "eval_text"), gate.eval_text))
    if model.is_builtin:
        return SMOLLM2_SHAPE, findings
    source = given.resolve(model.source)
    at = ("model", "source")
    if not source.is_dir():
        hint = f"looked for {source}; or use builtin:smollm2-135m-instruct"
        findings.append(given.positions.finding(at, f"model directory {model.source} does not exist", hint))
        return None, findings
    if not any(source.glob("*.safetensors")):
        findings.append(
            given.positions.finding(
                at,
                f"model directory {model.source} has no *.safetensors weights",
                "point source at an HF-layout directory (config.json, *.safetensors, tokenizer)",
            )
        )
    try:
        config = json.loads((source / "config.json").read_text(encoding="utf-8"))
        reason = unsupported_reason(config) if isinstance(config, dict) else None
        if reason is not None:
            findings.append(
                given.positions.finding(
                    at,
                    f"{model.source}/config.json: {reason}",
                    "choose a Llama, Qwen2 or Mistral checkpoint (docs/torch-engine.md says what "
                    "the engines run)",
                )
            )
            return None, findings
        return ModelShape.from_config_json(source / "config.json"), findings
    except (OSError, ValueError, KeyError, TypeError) as exc:
        detail = f"missing {exc}" if isinstance(exc, KeyError) else type(exc).__name__
        findings.append(
            given.positions.finding(
                at,
                f"{model.source}/config.json is not a readable model config ({detail})",
                "a Llama-style HF config.json is needed (hidden_size, num_hidden_layers, ...)",
            )
        )
        return None, findings


def _calibration_findings(given: CheckInput, model: ModelSpec) -> list[Finding]:
    """The calibration text of `awq`, `gptq` or llama.cpp's importance matrix: used only with them, a
    readable UTF-8 text long enough, and not the quality gate's eval text (the gate must score
    unseen text)."""
    quant, gate = model.quantization, model.quality_gate
    at = ("model", "quantization", "calibration")
    if quant.calibration is not None and not quant.uses_calibration:
        hint = (
            "set awq: true, gptq: true or scheme: auto (torch), or gguf_type: Q4_K_M (llama.cpp), "
            "or remove calibration"
        )
        message = "calibration is used only with awq, gptq, scheme auto or a K-quant gguf_type"
        return [given.positions.finding(at, message, hint)]
    if not quant.uses_calibration:
        return []
    path = given.resolve(quant.calibration) if quant.calibration else DEFAULT_CALIBRATION
    if not path.is_file():
        return [_missing_file(given, at, quant.calibration or str(path))]
    try:
        data = path.read_bytes()
    except OSError as exc:
        return [given.positions.finding(at, f"cannot read {path} ({exc.strerror or exc})", "fix the path")]
    problem = text_problem(data)
    if problem is not None:
        return [
            given.positions.finding(
                at,
                f"{path}:{problem.line}:{problem.column}: the calibration text {problem.message}",
                f"use a UTF-8 text of at least {MIN_WORDS} words, like what the model will read",
            )
        ]
    eval_path = given.resolve(gate.eval_text) if gate is not None else None
    if eval_path is not None and eval_path.is_file() and eval_path.read_bytes() == data:
        where = at if quant.calibration else ("model", "quality_gate", "eval_text")
        return [
            given.positions.finding(
                where,
                "the calibration text and quality_gate.eval_text are the same text",
                "calibrate and evaluate on different texts: the gate must score text the quantizer never saw",
            )
        ]
    return []


def _auto_findings(given: CheckInput, model: ModelSpec, shape: ModelShape | None) -> list[Finding]:
    """`scheme: auto` needs `max_size`, which nothing else uses, one that its smallest choice fits
    (checked when the model's shape is known), and the torch engine's layouts."""
    quant = model.quantization
    at = ("model", "quantization")
    if quant.scheme != "auto":
        if quant.max_size is None:
            return []
        message = f"max_size is used only with scheme auto, not {quant.scheme}"
        return [given.positions.finding((*at, "max_size"), message, "set scheme: auto, or remove max_size")]
    if quant.max_size is None:
        return [
            given.positions.finding(
                (*at, "scheme"),
                "scheme auto needs max_size, the budget of the stored weights it chooses within",
                "add max_size (bytes, or a quantity like 120M) under model.quantization",
            )
        ]
    findings = []
    if given.agent is not None and given.agent.engine == "llama.cpp":
        findings.append(
            given.positions.finding(
                (*at, "scheme"),
                "scheme auto chooses among the torch engine's int4 and int8 layouts, not GGUF types",
                "use agent.engine: torch, or gguf_type: Q4_K_M for llama.cpp's own mixed recipe",
            )
        )
    if shape is not None:
        low, high = auto_size_bounds(shape, quant)
        if quant.max_size < low:
            findings.append(
                given.positions.finding(
                    (*at, "max_size"),
                    f"max_size {quant.max_size:,} bytes is below the smallest choice of scheme auto: "
                    f"{low:,} bytes ({low / 1e6:.1f} MB, every decoder linear int4 group 128; all int8 "
                    f"would be {high / 1e6:.1f} MB)",
                    f"raise max_size to at least {low} (bytes), or choose a scheme yourself",
                )
            )
    return findings


def _engine_findings(given: CheckInput) -> list[Finding]:
    """The llama.cpp engine runs a GGUF artifact, whose 4-bit types quantize blocks of 32 weights;
    `gguf_int4` means something only there, and only when some weights are int4."""
    model, agent = given.model, given.agent
    if model is None or agent is None:
        return []
    quant = model.quantization
    uses = _int4_group_sizes(quant)
    llama_cpp = agent.engine == "llama.cpp"
    findings = []
    if "gguf_int4" in quant.model_fields_set and not (llama_cpp and uses):
        unused = "no weight is int4" if llama_cpp else "agent.engine is not llama.cpp"
        findings.append(
            given.positions.finding(
                ("model", "quantization", "gguf_int4"),
                f"gguf_int4 is not used: {unused}",
                "remove it, or use agent.engine: llama.cpp with int4 weights (scheme int4 or layered)",
            )
        )
    findings += _gguf_type_findings(given, quant, llama_cpp)
    for key in ("awq", "gptq"):
        if getattr(quant, key) and llama_cpp:
            findings.append(
                given.positions.finding(
                    ("model", "quantization", key),
                    f"{key} is built for the torch engine's artifacts, not llama.cpp's GGUF",
                    f"remove {key}: true, or set agent.engine: torch",
                )
            )
    if quant.gptq and not llama_cpp and not uses:
        findings.append(
            given.positions.finding(
                ("model", "quantization", "gptq"),
                f"gptq rounds int4 weights, and no weight is int4 (scheme {quant.scheme})",
                "remove gptq: true, or use scheme: int4 (or layered, or an int4 override)",
            )
        )
    return findings + [
        given.positions.finding(
            path,
            f"agent.engine llama.cpp needs int4 with group size {GGUF_BLOCK} (GGUF's 4-bit blocks), "
            f"not {size}",
            f"set group_size: {GGUF_BLOCK}, use int8/fp16, or set agent.engine: torch",
        )
        for path, size in uses
        if llama_cpp and size != GGUF_BLOCK and quant.gguf_type is None
    ]


def _gguf_type_findings(given: CheckInput, quant: Quantization, llama_cpp: bool) -> list[Finding]:
    """`gguf_type` hands the whole GGUF to llama.cpp's quantizer: it needs the llama.cpp engine,
    and the settings of our own quantizer beside it would be silently ignored."""
    at = ("model", "quantization")
    if quant.gguf_type is None:
        if "imatrix" not in quant.model_fields_set:
            return []
        return [
            given.positions.finding(
                (*at, "imatrix"), "imatrix is not used: no gguf_type", "remove it, or set gguf_type: Q4_K_M"
            )
        ]
    if not llama_cpp:
        return [
            given.positions.finding(
                (*at, "gguf_type"),
                "gguf_type is not used: agent.engine is not llama.cpp",
                "remove it, or set agent.engine: llama.cpp",
            )
        ]
    ignored = ("scheme", "group_size", "overrides", "gguf_int4")
    return [
        given.positions.finding(
            (*at, key),
            f"{key} is not used: gguf_type {quant.gguf_type} picks every tensor's type",
            f"remove {key}, or remove gguf_type to quantize with scheme",
        )
        for key in ignored
        if key in quant.model_fields_set
    ]


def _agent_findings(given: CheckInput) -> list[Finding]:
    """Device, compile and draft settings the engine cannot honour."""
    agent = given.agent
    if agent is None:
        return []
    findings = []
    if agent.engine == "llama.cpp" and agent.compile == "on":
        findings.append(
            given.positions.finding(
                ("agent", "compile"),
                "compile: on means nothing for agent.engine llama.cpp, which has no compile step "
                "(the agent refuses it at load)",
                "remove agent.compile, or use agent.engine: torch",
            )
        )
    if agent.engine == "llama.cpp" and agent.device == "cuda":
        findings.append(
            given.positions.finding(
                ("agent", "device"),
                "agent.engine llama.cpp runs on the CPU: device cuda would fail at load",
                "set agent.device: auto (or cpu), or use agent.engine: torch for the GPU",
            )
        )
    if agent.device == "cuda" and agent.engine != "llama.cpp":
        findings += _hidden_gpu_findings(given)
    return findings + _draft_findings(given) + _kv_cache_findings(given)


def _draft_findings(given: CheckInput) -> list[Finding]:
    """agent.draft where it cannot work: llama.cpp refuses it at load; on CUDA and for an int4
    model the torch engine serves without it (and says so in /v1/models)."""
    agent, model = given.agent, given.model
    if agent is None or agent.draft == "off":
        return []
    problem = None
    if agent.engine == "llama.cpp":
        problem = "agent.engine llama.cpp has no draft model here (the agent refuses it at load)"
    elif agent.device == "cuda":
        problem = "the int4 draft is for CPU devices: on CUDA the agent serves without it"
    elif model is not None and model.quantization.scheme == "int4" and not model.quantization.overrides:
        problem = (
            "the model is int4 already: its int4 draft would be the model itself "
            "(the agent serves without it)"
        )
    if problem is None:
        return []
    return [given.positions.finding(("agent", "draft"), problem, "remove agent.draft, or set it to off")]


def _kv_cache_findings(given: CheckInput) -> list[Finding]:
    """agent.kv_cache_type where the engine cannot honour it: llama.cpp keeps its own fp16 cache
    (the agent refuses another at load), and an int8 cache is the torch engine's on a CPU."""
    agent = given.agent
    if agent is None or agent.kv_cache_type == "auto":
        return []
    if agent.engine == "llama.cpp":
        problem, hint = (
            f"kv_cache_type {agent.kv_cache_type} is the torch engine's: llama.cpp keeps its fp16 "
            "KV cache here (the agent refuses it at load)",
            "remove agent.kv_cache_type, or use agent.engine: torch",
        )
    elif agent.kv_cache_type == "int8" and agent.device == "cuda":
        problem, hint = (
            "an int8 KV cache is for CPU devices: on CUDA the agent would keep the model's dtype",
            "set agent.kv_cache_type to auto, fp16 or bf16, or agent.device to cpu",
        )
    else:
        return []
    return [given.positions.finding(("agent", "kv_cache_type"), problem, hint)]


def _hidden_gpu_findings(given: CheckInput) -> list[Finding]:
    """agent.device cuda on an ssh device whose profile names no accelerator: its agent unit gets
    PrivateDevices=yes (deployer.push.units), which hides /dev/nvidia*, so every load would fail."""
    findings = []
    for index, device in enumerate(given.devices or []):
        if device is None or device.transport != "ssh":
            continue  # a local device runs its agent without our unit: it sees the GPU if there is one
        profile = (given.profiles or {}).get(device.profile) if device.profile else None
        if profile is not None and profile.accelerator is not None:
            continue
        where = (
            f"its profile '{device.profile}' names no accelerator" if device.profile else "it has no profile"
        )
        findings.append(
            given.positions.finding(
                ("fleet", "devices", index, "profile" if device.profile else "name"),
                f"agent.device is cuda, but device '{device.name}' would not see a GPU: {where}, so its "
                "agent unit hides device nodes (PrivateDevices=yes) and the model load would fail",
                "name the GPU in the profile (accelerator: ...), or set agent.device: auto",
            )
        )
    return findings


def _int4_group_sizes(quant: Quantization) -> list[tuple[tuple, int]]:
    """(where in deploy.yaml, group size) of each setting that makes some weights int4."""
    at = ("model", "quantization")
    uses = [((*at, "group_size"), quant.group_size)] if quant.scheme in ("int4", "layered") else []
    return uses + [
        ((*at, "overrides", i, "group_size" if o.group_size else "scheme"), o.group_size or quant.group_size)
        for i, o in enumerate(quant.overrides)
        if o.scheme == "int4"
    ]


def _fallback_layers(given: CheckInput) -> list[tuple[FieldPath, Fallback]]:
    """Each `fallback:` written in the config, with where: the fleet's, profiles', devices'."""
    layers: list[tuple[FieldPath, Fallback]] = []
    if given.fallback is not None:
        layers.append((("fallback",), given.fallback))
    for name, profile in (given.profiles or {}).items():
        if profile.fallback is not None:
            layers.append((("profiles", name, "fallback"), profile.fallback))
    for index, device in enumerate(given.devices or []):
        if device is not None and device.fallback is not None:
            layers.append((("fleet", "devices", index, "fallback"), device.fallback))
    return layers


def _fallback_findings(given: CheckInput) -> list[Finding]:
    """Every device whose fallback is on has an upstream; every upstream key source is there."""
    findings = []
    for at, layer in _fallback_layers(given):
        key = layer.upstream.api_key if layer.upstream else None
        if key is not None and key.env is not None and not given.environ.get(key.env):
            findings.append(
                given.positions.finding(
                    (*at, "upstream", "api_key", "env"),
                    f"${key.env} is not set (the fallback upstream's API key)",
                    f"export {key.env}=<key> where sits-deployer runs",
                )
            )
        if key is not None and key.file is not None and not given.resolve(key.file).is_file():
            findings.append(_missing_file(given, (*at, "upstream", "api_key", "file"), key.file))
    fleet, profiles = given.fleet, given.profiles
    if fleet is None or profiles is None or given.devices is None:
        return findings
    for index, device in enumerate(fleet):
        profile = profiles.get(device.profile) if device.profile else None
        effective = merge_fallbacks(given.fallback, profile.fallback if profile else None, device.fallback)
        if effective is None or effective.policy == "off" or effective.upstream is not None:
            continue
        where: FieldPath = ("fallback",)
        if device.fallback is not None:
            where = ("fleet", "devices", index, "fallback")
        elif profile is not None and profile.fallback is not None:
            where = ("profiles", device.profile or "", "fallback")
        findings.append(
            given.positions.finding(
                where,
                f"device '{device.name}' falls back ({effective.policy}) but no upstream is set",
                "set fallback.upstream (base_url, model) for the fleet, its profile or the device, "
                "or policy: off",
                key=True,
            )
        )
    return findings


def _signing_findings(given: CheckInput) -> list[Finding]:
    signing = given.signing
    if signing is None:
        if not given.fleet:
            return []
        missing = given.positions.finding(
            ("signing",),
            "no signing section: apply and rollback will refuse, since they sign every release and "
            "devices install only signed ones",
            "run `sits-deployer keygen -o keys/release`, then add signing: {private_key: "
            "keys/release.key, trusted_keys: [keys/release.pub]}",
        )
        return [dataclasses.replace(missing, severity="warning")]
    findings = []
    for index, key in enumerate(signing.trusted_keys):
        problem = public_key_problem(given.resolve(key), key)
        findings += _key_finding(given, ("signing", "trusted_keys", index), problem)
    if signing.private_key is not None:
        problem = private_key_problem(
            given.resolve(signing.private_key),
            signing.private_key,
            signing.passphrase_env,
            given.environ,
            secrets=given.secrets,
        )
        findings += _key_finding(given, ("signing", "private_key"), problem)
    if signing.threshold > len(signing.trusted_keys):
        findings.append(
            given.positions.finding(
                ("signing", "threshold") if signing.trusted_keys else ("signing", "trusted_keys"),
                f"threshold {signing.threshold} needs at least {signing.threshold} trusted keys, "
                f"{len(signing.trusted_keys)} listed",
                "list the public keys under signing.trusted_keys, or lower signing.threshold",
            )
        )
    return findings


def _key_finding(given: CheckInput, at: tuple, problem: KeyProblem | None) -> list[Finding]:
    return [given.positions.finding(at, problem.message, problem.hint)] if problem else []


def _strategy_findings(given: CheckInput) -> list[Finding]:
    strategy, devices = given.strategy, given.fleet
    if strategy is None or devices is None:
        return []
    findings = _misplaced_parameters(given, strategy)
    targets = [d for d in devices if all(d.labels.get(k) == v for k, v in strategy.selector.items())]
    if not targets:
        labels = sorted({f"{k}={v}" for d in devices for k, v in d.labels.items()})
        findings.append(
            given.positions.finding(
                ("strategy", "selector"),
                f"selector {_labels(strategy.selector)} matches none of the {len(devices)} devices",
                "labels in the fleet: " + (", ".join(labels) if labels else "none"),
            )
        )
        return findings
    size = len(targets)
    too_many: list[tuple[FieldPath, int | str | None, str]] = [
        (("strategy", "batch_size"), strategy.batch_size, "batch_size")
    ]
    too_many.append((("strategy", "max_unavailable"), strategy.max_unavailable, "max_unavailable"))
    too_many.append((("strategy", "failure_threshold"), strategy.failure_threshold, "failure_threshold"))
    too_many += [
        (("strategy", "steps", i), step, "canary step") for i, step in enumerate(strategy.steps or [])
    ]
    for at, value, what in too_many:
        if isinstance(value, int) and value > size:
            findings.append(
                given.positions.finding(
                    at,
                    f"{what} {value} is more than the {size} devices the strategy targets",
                    f"use at most {size}, or a percentage like '25%'",
                )
            )
    if strategy.type == "canary" and strategy.steps:
        counts = strategy.resolved_steps(size)
        for index in range(1, len(strategy.steps)):
            if counts[index] <= counts[index - 1]:
                findings.append(
                    given.positions.finding(
                        ("strategy", "steps", index),
                        f"canary step {strategy.steps[index]} does not add devices "
                        f"({counts[index - 1]} already updated by then)",
                        "steps are cumulative and must increase, e.g. [1, '25%', '100%']",
                    )
                )
    return findings


_PARAMETER_OWNERS = {"steps": ("canary",), "batch_size": ("rolling",), "max_unavailable": ("rolling",)}


def _misplaced_parameters(given: CheckInput, strategy: Strategy) -> list[Finding]:
    findings = []
    for field, types in _PARAMETER_OWNERS.items():
        if getattr(strategy, field) is not None and strategy.type not in types:
            findings.append(
                given.positions.finding(
                    ("strategy", field),
                    f"{field} is not used by the {strategy.type} strategy",
                    f"remove it, or set strategy.type to {' or '.join(types)}",
                    key=True,
                )
            )
    return findings


def _labels(selector: Mapping[str, str]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in selector.items()) + "}"


def _missing_file(given: CheckInput, at: tuple, value: str) -> Finding:
    return given.positions.finding(
        at, f"file {value} does not exist", f"looked for {given.resolve(value)}; fix the path"
    )


def _suggest(value: str, choices: list[str], fallback: str) -> str:
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else fallback
