"""Where the agent's CPU kernels (agent/engines/native.py) are built and kept.

An agent under systemd keeps them under its store (agent/compile_cache.py points the variable
there). Agents that share one machine (a local fleet: the demo, the quickstart's devices) share
one build instead: the local transport points them at the user's cache.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["KERNEL_CACHE_VARIABLE", "kernel_cache_dir", "shared_kernel_cache"]

KERNEL_CACHE_VARIABLE = "SITS_KERNEL_CACHE_DIR"


def shared_kernel_cache() -> Path:
    """The machine-wide cache: $SITS_CACHE_DIR/kernels, or ~/.cache/sits-deployer/kernels."""
    root = os.environ.get("SITS_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "sits-deployer") / "kernels"


def kernel_cache_dir() -> Path:
    """Where to build and find the kernels now: $SITS_KERNEL_CACHE_DIR, else the shared cache."""
    return Path(os.environ.get(KERNEL_CACHE_VARIABLE) or shared_kernel_cache())
