"""The one layout check both weight-file readers (safetensors, GGUF) run on a tensor table."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from deployer.errors import FormatError

__all__ = ["TensorSpan", "check_tensor_layout"]


class TensorSpan(Protocol):
    """A tensor's byte range in its file (absolute offset)."""

    @property
    def name(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def length(self) -> int: ...


def check_tensor_layout(path: Path, spans: Iterable[TensorSpan], data_start: int, file_size: int) -> None:
    """`spans` sorted by offset: names unique, no overlaps, nothing before the data section or past
    the end of the file. Raises FormatError naming the tensor."""
    names: set[str] = set()
    cursor = data_start
    for t in spans:
        if t.name in names:
            raise FormatError(f"{path}: tensor {t.name!r} appears twice in the tensor table")
        names.add(t.name)
        if t.offset < cursor:
            raise FormatError(f"{path}: tensor {t.name!r} overlaps the previous tensor")
        if t.offset + t.length > file_size:
            raise FormatError(
                f"{path}: tensor {t.name!r} ends at byte {t.offset + t.length}, past the end of "
                f"the file ({file_size} bytes)",
                hint="the file is truncated; rebuild or re-download it",
            )
        cursor = t.offset + t.length
