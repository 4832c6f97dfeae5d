"""Words YAML 1.1 turns into something else: what both deploy.yaml and agent.yaml read back."""

from __future__ import annotations

__all__ = ["on_off"]


def on_off(value: object) -> object:
    """YAML 1.1 reads a bare `on` / `off` as true / false: take them as the words that were written
    (a pydantic BeforeValidator for fields whose values include "on" or "off")."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value
