"""Unit-bearing values of deploy.yaml: Kubernetes quantities, durations and percentages.

* CPU in Kubernetes notation: ``4000m`` (millicores), ``4``, ``0.5`` -> millicores.
* Memory and disk: ``8Gi``, ``512Mi``, ``1G``, ``1e9``, ``1073741824`` -> bytes.
* Durations: ``30s``, ``5m``, ``2h``, ``30d``, ``1h30m`` -> `timedelta`.
* Percentages: ``"25%"`` -> 25.
* Link rates: ``2Mbit``, ``500kbit/s``, ``1mbit`` (as tc writes it), ``1MB/s``, ``256KiB/s`` ->
  bytes per second. A unit is required: a bare number could mean bits or bytes.

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
_RATE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*(k|K|M|G|Ki|Mi|Gi|m|g)?(bit|B)(?:/s)?$")
_RATE_PREFIX = {"k": 10**3, "K": 10**3, "M": 10**6, "m": 10**6, "G": 10**9, "g": 10**9}
_RATE_PREFIX |= {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}

QUANTITY_PATTERN = _QUANTITY.pattern
DURATION_PATTERN = r"^([0-9]+(ms|s|m|h|d|w))+$"
PERCENT_PATTERN = _PERCENT.pattern
RATE_PATTERN = _RATE.pattern


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


def parse_rate(value: str | int | float) -> float:
    """A link rate in bytes per second: ``"2Mbit"`` -> 250000.0, ``"1MB/s"`` -> 1e6, ``"256KiB/s"``
    -> 262144.0. ``bit`` is bits, ``B`` bytes; ``m``/``g`` are accepted as tc writes them (``1mbit``)."""
    example = "'2Mbit', '500kbit/s' or '1MB/s'"
    if isinstance(value, bool) or not isinstance(value, str):
        raise ValueError(f"a rate needs a unit (bits or bytes per second), like {example}; got {value!r}")
    match = _RATE.match(value.strip())
    if match is None:
        raise ValueError(f"invalid rate {value!r}; write it like {example}")
    number, prefix, unit = match.groups()
    per_second = float(Decimal(number) * _RATE_PREFIX.get(prefix or "", 1)) / (8 if unit == "bit" else 1)
    if per_second <= 0:
        raise ValueError(f"rate {value!r} must be above 0; leave the field out for no limit")
    return per_second


def format_rate(bytes_per_s: float) -> str:
    """A rate for people, in bits per second as links are sold: 250000.0 -> '2 Mbit/s'."""
    bits = bytes_per_s * 8
    for unit, size in (("Gbit/s", 10**9), ("Mbit/s", 10**6), ("kbit/s", 10**3)):
        if bits >= size:
            return f"{bits / size:.3g} {unit}"
    return f"{bits:.3g} bit/s"


def format_seconds(seconds: float) -> str:
    """A duration for people: 42.3 -> '42s', 3725 -> '1h02m', 90061 -> '1d01h'."""
    whole = round(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


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
