"""Fixtures of the push tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def links(tmp_path, monkeypatch) -> Path:
    """pip's only source: this folder (no index, no user configuration, our builds in a cache of
    the test's own)."""
    folder = tmp_path / "links"
    folder.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    monkeypatch.setenv("SITS_CACHE_DIR", str(tmp_path / "cache"))
    return folder
