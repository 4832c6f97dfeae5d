"""Fixtures for release tests: two real artifacts (v1 and a fine-tuned-like v2), a patch, keys."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from deployer.release.delta import create_patch
from tests.release.helpers import Fleet, build, perturb


@pytest.fixture(scope="session")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    """v1 = tiny model int8, v2 = the same with 6 tensors nudged (a small fine-tune)."""
    root = tmp_path_factory.mktemp("fleet")
    src_b = perturb(tiny_model_dir, root / "src-b", names=6, scale=0.02, seed=3)
    v1 = build(tiny_model_dir, root / "store", "1.0.0")
    v2 = build(src_b, root / "store", "1.1.0")
    patch = root / "v1-v2.patch"
    create_patch(v1, v2, patch)
    keys = tuple(ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    return Fleet(v1, v2, patch, keys)
