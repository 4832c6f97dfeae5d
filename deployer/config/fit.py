"""Resource checks: plausible quantities, the quota inside each device profile, the model inside both.

"Resource quota compliance": ``resources`` (the agent's quota) must fit every profile in use,
and the model's estimated memory at its quantization must fit the quota and every profile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

from deployer.config.estimate import MemoryEstimate
from deployer.config.findings import FieldPath, Finding
from deployer.config.models import AgentSettings, ModelSpec, Profile, Resources
from deployer.config.quantity import format_bytes, format_cpu
from deployer.config.sourcemap import SourceMap

# Outside these an edge-device value is a typo (a missing "Gi", an extra zero), not a device.
MEMORY_RANGE = (16 * 2**20, 64 * 2**40)
DISK_RANGE = (64 * 2**20, 2**50)
CPU_RANGE = (10, 1024 * 1000)


def plausibility_findings(
    profiles: Mapping[str, Profile] | None, resources: Resources | None, positions: SourceMap
) -> list[Finding]:
    """Absurd memory, disk or CPU amounts in ``profiles`` and ``resources``."""
    values: list[tuple[FieldPath, int | None, str]] = []
    for name, profile in (profiles or {}).items():
        at = ("profiles", name)
        values += [((*at, "memory"), profile.memory, "memory"), ((*at, "cpu"), profile.cpu, "cpu")]
        values.append(((*at, "disk"), profile.disk, "disk"))
    if resources is not None:
        values.append((("resources", "memory"), resources.memory, "memory"))
        values.append((("resources", "cpu"), resources.cpu, "cpu"))
    findings = []
    for path, value, kind in values:
        problem = _implausible(value, kind)
        if problem:
            findings.append(positions.finding(path, *problem))
    return findings


def _implausible(value: int | None, kind: str) -> tuple[str, str] | None:
    if value is None:
        return None
    low, high = {"memory": MEMORY_RANGE, "disk": DISK_RANGE, "cpu": CPU_RANGE}[kind]
    if low <= value <= high:
        return None
    show: Callable[[int], str] = format_cpu if kind == "cpu" else format_bytes
    unit = "write CPUs like '4' or '4000m'" if kind == "cpu" else "a bare number means bytes"
    return (
        f"{kind} {show(value)} is implausible for an edge device",
        f"expected {show(low)} to {show(high)}; {unit}",
    )


def quota_findings(
    resources: Resources | None,
    profiles: Mapping[str, Profile],
    used: Iterable[str],
    positions: SourceMap,
) -> list[Finding]:
    """``resources`` larger than a profile that devices use."""
    if resources is None:
        return []
    findings = []
    for name in sorted(set(used) & profiles.keys()):
        profile = profiles[name]
        if resources.memory is not None and resources.memory > profile.memory:
            findings.append(
                positions.finding(
                    ("resources", "memory"),
                    f"resources.memory {format_bytes(resources.memory)} exceeds the "
                    f"{format_bytes(profile.memory)} of profile '{name}'",
                    "lower resources.memory, or give those devices a larger profile",
                )
            )
        if resources.cpu is not None and profile.cpu is not None and resources.cpu > profile.cpu:
            findings.append(
                positions.finding(
                    ("resources", "cpu"),
                    f"resources.cpu {format_cpu(resources.cpu)} exceeds the "
                    f"{format_cpu(profile.cpu)} of profile '{name}'",
                    "lower resources.cpu, or give those devices a larger profile",
                )
            )
    return findings


def model_fit_findings(
    model: ModelSpec,
    estimate: MemoryEstimate,
    resources: Resources | None,
    profiles: Mapping[str, Profile],
    used: Iterable[str],
    positions: SourceMap,
) -> list[Finding]:
    """The model's estimated memory above the quota or above a profile in use."""
    limits: list[tuple[FieldPath, str, int]] = []
    if resources is not None and resources.memory is not None:
        limits.append((("resources", "memory"), "resources.memory", resources.memory))
    for name in sorted(set(used) & profiles.keys()):
        limits.append((("profiles", name, "memory"), f"profile '{name}'", profiles[name].memory))
    need = estimate.total
    return [
        positions.finding(
            path,
            f"model {model.name} needs about {format_bytes(need)} at "
            f"{model.quantization.scheme} ({_breakdown(estimate)}), more than the "
            f"{format_bytes(limit)} of {what}",
            "choose a smaller quantization (int4, layered), lower agent.max_concurrent or "
            "agent.max_tokens, store the torch engine's KV cache narrower (agent.kv_cache_type "
            "fp16 or int8), "
            + ("ship fewer or lower-rank LoRA adapters, " if estimate.adapters else "")
            + "or allow more memory",
        )
        for path, what, limit in limits
        if need > limit
    ]


def swap_policy_findings(
    model: ModelSpec,
    estimate: MemoryEstimate,
    agent: AgentSettings,
    profiles: Mapping[str, Profile],
    used: Iterable[str],
    positions: SourceMap,
) -> list[Finding]:
    """Where swap_policy auto will swap unload-first: the profiles in use that hold one copy of
    the model (`estimate`) but not the two a side-by-side swap loads, with the downtime it costs."""
    if agent.swap_policy != "auto":
        return []
    one = estimate.total
    two = dataclasses.replace(estimate, weight_copies=2).total
    tight = [n for n in sorted(set(used) & profiles.keys()) if one <= profiles[n].memory < two]
    if not tight:
        return []
    names = ", ".join(f"'{n}' ({format_bytes(profiles[n].memory)})" for n in tight)
    finding = positions.finding(
        ("agent", "swap_policy"),
        f"two copies of model {model.name} need about {format_bytes(two)}, more than profile {names}: "
        "updates there swap unload-first, and the model answers 503 with Retry-After while the "
        "new version loads (docs/concepts.md)",
        "accept the downtime, or set swap_policy: unload-first to say so, or give those devices "
        "more memory, or lower agent.max_concurrent or agent.max_tokens",
    )
    return [dataclasses.replace(finding, severity="warning")]


def _breakdown(estimate: MemoryEstimate) -> str:
    copies = f" x{estimate.weight_copies} for a side-by-side swap" if estimate.weight_copies > 1 else ""
    draft = f", int4 draft {format_bytes(estimate.draft)}" if estimate.draft else ""
    adapters = f", LoRA adapters {format_bytes(estimate.adapters)}" if estimate.adapters else ""
    return (
        f"weights {format_bytes(estimate.weights)}{copies}, KV cache "
        f"{format_bytes(estimate.kv_cache)}, runtime {format_bytes(estimate.engine)}{draft}{adapters}"
    )
