"""`${VAR}` interpolation of string values from the environment, without ever echoing them.

Secrets (passphrases, tokens, host names one would rather not print) are written as ``${VAR}``
in deploy.yaml and taken from the environment at load time. An unset variable is a finding.
Interpolated values are registered with deployer.core.redact, so that any output mentioning one
(a finding, an error, a plan file, a third party's error text) says "<value from ${VAR}>"
instead. ``$${`` writes a literal ``${``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from deployer.config.findings import FieldPath, Finding
from deployer.config.sourcemap import SourceMap
from deployer.core.redact import redact, register

_REFERENCE = re.compile(r"\$\$\{|\$\{([^}]*)\}|\$\{")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class Interpolated:
    """The data after interpolation, the problems found, and which values came from where.

    ``sources`` labels each interpolated field; ``unresolved`` holds the fields left with a
    ``${...}`` that could not be resolved (already a finding: schema errors there are noise).
    """

    data: Any
    findings: list[Finding] = field(default_factory=list)
    sources: dict[FieldPath, str] = field(default_factory=dict)
    unresolved: set[FieldPath] = field(default_factory=set)


def redact_finding(finding: Finding) -> Finding:
    """``finding`` with every interpolated value (of any file read so far) in its message and
    hint replaced."""
    hint = redact(finding.hint) if finding.hint else finding.hint
    return dataclasses.replace(finding, message=redact(finding.message), hint=hint)


def interpolate(data: Any, positions: SourceMap, environ: Mapping[str, str]) -> Interpolated:
    """Replace ``${VAR}`` in every string value of ``data`` with ``environ[VAR]``."""
    result = Interpolated(None)
    result.data = _walk(data, (), positions, environ, result)
    return result


def _walk(
    value: Any, path: FieldPath, positions: SourceMap, environ: Mapping[str, str], out: Interpolated
) -> Any:
    if isinstance(value, dict):
        return {k: _walk(v, (*path, k), positions, environ, out) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, (*path, i), positions, environ, out) for i, v in enumerate(value)]
    if isinstance(value, str) and "${" in value:
        return _substitute(value, path, positions, environ, out)
    return value


def _substitute(
    text: str, path: FieldPath, positions: SourceMap, environ: Mapping[str, str], out: Interpolated
) -> str:
    names: list[str] = []

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$${":
            return "${"
        name = match.group(1)
        if name is None or not _NAME.fullmatch(name):
            out.unresolved.add(path)
            out.findings.append(
                positions.finding(
                    path,
                    "malformed ${...} reference",
                    "write ${NAME} with letters, digits and '_', or $${ for a literal ${",
                )
            )
            return match.group(0)
        if name not in environ:
            out.unresolved.add(path)
            out.findings.append(
                positions.finding(
                    path,
                    f"environment variable ${{{name}}} is not set",
                    f"export {name} before running, or remove the reference",
                )
            )
            return match.group(0)
        names.append(name)
        return environ[name]

    result = _REFERENCE.sub(replace, text)
    if names:
        label = "<value from " + ", ".join(f"${{{n}}}" for n in names) + ">"
        out.sources[path] = label
        for secret in [result, *(environ[n] for n in names)]:
            register(secret, label)
    return result
