"""Unit-bearing values of deploy.yaml: Kubernetes quantities, durations and percentages.

* CPU in Kubernetes notation: ``4000m`` (millicores), ``4``, ``0.5`` -> millicores.
* Memory and disk: ``8Gi``, ``512Mi``, ``1G``, ``1e9``, ``1073741824`` -> bytes.
* Durations: ``30s``, ``5m``, ``2h``, ``30d``, ``1h30m`` -> `timedelta`.
* Percentages: ``"25%"`` -> 25.

Parsers raise ValueError with a message that names the accepted forms (pydantic turns it into a
finding at the value's position).
"""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$")
_DURATION_PART = re.compile(r"([0-9]+)(ms|s|m|h|d|w)")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_PERCENT = re.compile(r"^([0-9]+(?:\.[0-9]+)?)%$")

QUANTITY_PATTERN = _QUANTITY.pattern
DURATION_PATTERN = r"^([0-9]+(ms|s|m|h|d|w))+$"
PERCENT_PATTERN = _PERCENT.pattern


def _amount(value: str | int | float, what: str, example: str) -> Decimal:
    """The quantity as an exact number in base units (a trailing ``m`` means thousandths)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a {what} quantity like {example}, got a boolean")
    if isinstance(value, int | float):
        return Decimal(str(value))
    match = _QUANTITY.match(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"invalid {what} quantity {value!r}; write it like {example}")
    number = Decimal(match.group(1))
    suffix = match.group(2)
    if suffix == "m":
        return number / 1000
    return number * (_BINARY.get(suffix) or _DECIMAL.get(suffix) or 1)


def parse_cpu(value: str | int | float) -> int:
    """CPU in millicores: ``"4000m"`` -> 4000, ``"2"`` -> 2000, ``0.5`` -> 500."""
    return int(_amount(value, "CPU", "'4000m' or '4'") * 1000)


def parse_memory(value: str | int | float) -> int:
    """Memory or disk in bytes: ``"8Gi"`` -> 8589934592, ``"1G"`` -> 10**9."""
    amount = _amount(value, "memory", "'8Gi', '512Mi' or '2G'")
    if amount != amount.to_integral_value():
        raise ValueError(f"memory quantity {value!r} is not a whole number of bytes")
    return int(amount)


def parse_duration(value: str | int | float | timedelta) -> timedelta:
    """A duration: ``"30s"``, ``"5m"``, ``"1h30m"``, ``"30d"``; a bare number means seconds."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return timedelta(seconds=value)
    text = value.strip() if isinstance(value, str) else ""
    if not text or not re.fullmatch(DURATION_PATTERN, text):
        raise ValueError(f"invalid duration {value!r}; write it like '30s', '5m', '2h' or '30d'")
    seconds = sum(int(n) * _DURATION_UNITS[unit] for n, unit in _DURATION_PART.findall(text))
    return timedelta(seconds=seconds)


def format_duration(value: timedelta) -> str:
    """A duration the way deploy.yaml writes it: 60s -> '1m', 30 days -> '30d'."""
    millis = round(value.total_seconds() * 1000)
    for unit in ("w", "d", "h", "m", "s"):
        size = round(_DURATION_UNITS[unit] * 1000)
        if millis % size == 0 and millis:
            return f"{millis // size}{unit}"
    return f"{millis}ms" if millis else "0s"


def parse_percent(value: str) -> float:
    """``"25%"`` -> 25.0; must lie in (0, 100]."""
    match = _PERCENT.match(value.strip())
    if match is None:
        raise ValueError(f"invalid percentage {value!r}; write it like '25%'")
    percent = float(match.group(1))
    if not 0 < percent <= 100:
        raise ValueError(f"percentage {value!r} must be above 0% and at most 100%")
    return percent


def format_bytes(count: int) -> str:
    """Bytes for people, in binary units: 8589934592 -> '8.0 GiB'."""
    if abs(count) < 1024:
        return f"{count} B"
    size = count / 1024
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} PiB"


def format_cpu(millicores: int) -> str:
    """Millicores for people: 4000 -> '4 CPUs', 500 -> '500m'."""
    return f"{millicores // 1000} CPUs" if millicores % 1000 == 0 else f"{millicores}m"
