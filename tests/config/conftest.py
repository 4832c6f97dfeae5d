"""Helpers for the config tests: a minimal valid deploy.yaml and a way to write variants of it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

# A minimal valid deploy.yaml; broken-config cases edit it, so its line numbers matter.
BASE = """\
application: demo
model:
  name: m
  version: 1.0.0
  source: builtin:smollm2-135m-instruct
fleet:
  devices:
    - name: d1
      transport: local
      root: ./fleet/d1
      profile: small
      labels: {ring: canary}
    - name: d2
      transport: local
      root: ./fleet/d2
      profile: small
      agent_port: 8082
profiles:
  small: {memory: 4Gi, cpu: "2"}
"""
BASE_LINES = BASE.count("\n")

WriteConfig = Callable[..., Path]


@pytest.fixture
def write_config(tmp_path: Path) -> WriteConfig:
    """Write BASE (with ``replace`` pairs applied and ``append`` added) to tmp/deploy.yaml."""

    def write(append: str = "", replace: tuple[tuple[str, str], ...] = (), text: str | None = None) -> Path:
        body = BASE
        for old, new in replace:
            assert old in body, f"{old!r} is not in the base config"
            body = body.replace(old, new, 1)
        path = tmp_path / "deploy.yaml"
        path.write_text(text if text is not None else body + append, encoding="utf-8")
        return path

    return write
