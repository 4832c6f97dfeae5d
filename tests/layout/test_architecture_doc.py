"""docs/architecture.md names every module of deployer/ in its folder's paragraph, so a newcomer who
reads it finds each one (a new module without a line there fails here)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"


def _paragraphs() -> dict[str, str]:
    """The text of each folder's paragraph (it starts with **`folder/`**), by folder."""
    text = DOC.read_text(encoding="utf-8").split("## The folders", 1)[1].split("\n## ", 1)[0]
    starts = list(re.finditer(r"^\*\*`(\w+)/`\*\*", text, flags=re.MULTILINE))
    ends = [m.start() for m in starts[1:]] + [len(text)]
    return {m.group(1): text[m.start() : end] for m, end in zip(starts, ends, strict=True)} | {
        "": text[: starts[0].start()]
    }


def test_every_module_is_named_in_its_folders_paragraph():
    paragraphs = _paragraphs()
    missing = []
    for path in sorted((REPO / "deployer").rglob("*.py")):
        if path.name == "__init__.py":
            continue
        parts = path.relative_to(REPO / "deployer").parts
        folder = parts[0] if len(parts) > 1 else ("cli" if path.name == "__main__.py" else "")
        if f"`{path.name}`" not in paragraphs.get(folder, ""):
            missing.append(f"{path.relative_to(REPO)} (in the {folder or 'intro'} paragraph)")
    assert not missing, "docs/architecture.md does not name: " + ", ".join(missing)
