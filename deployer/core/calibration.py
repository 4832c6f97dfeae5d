"""Calibration text for activation-aware int4 (`model.quantization.awq`): the default shipped
with the package, and the checks a user's text file must pass (not empty, not binary, long enough
for the scale search). `validate` reports them at the deploy.yaml field; the build raises them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# A few pages of varied English (prose, dialogue, instructions, code, numbers) written for this
# project; it shares no text with examples/data/eval.txt, the default quality gate's text.
DEFAULT_CALIBRATION = Path(__file__).with_name("calibration.txt")
# The scale search averages |activation| per channel over the text: fewer words than this give
# too few tokens (roughly 1.3 tokens a word) for stable averages.
MIN_WORDS = 200


@dataclass(frozen=True)
class TextProblem:
    """What is wrong with a text file, at `line`:`column` (1-based) inside it."""

    line: int
    column: int
    message: str


def text_problem(data: bytes, min_words: int = MIN_WORDS) -> TextProblem | None:
    """Why `data` cannot serve as calibration text (empty, binary, too short), or None."""
    if not data.strip():
        return TextProblem(1, 1, "is empty")
    bad = _first_binary_byte(data)
    if bad is not None:
        line, column = _position(data, bad)
        return TextProblem(line, column, f"is not UTF-8 text (byte 0x{data[bad]:02x})")
    words = len(data.decode("utf-8").split())
    if words < min_words:
        line, column = _position(data, len(data.rstrip()))
        return TextProblem(line, column, f"has {words} words; the scale search needs at least {min_words}")
    return None


def _first_binary_byte(data: bytes) -> int | None:
    """Offset of the first NUL or invalid UTF-8 byte, or None."""
    nul = data.find(b"\0")
    try:
        data.decode("utf-8")
        invalid = -1
    except UnicodeDecodeError as exc:
        invalid = exc.start
    found = [offset for offset in (nul, invalid) if offset >= 0]
    return min(found) if found else None


def _position(data: bytes, offset: int) -> tuple[int, int]:
    """1-based (line, column in characters) of byte `offset`."""
    line_start = data.rfind(b"\n", 0, offset) + 1
    column = len(data[line_start:offset].decode("utf-8", errors="replace")) + 1
    return data.count(b"\n", 0, offset) + 1, column
