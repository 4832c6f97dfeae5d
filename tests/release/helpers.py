"""Helpers for release tests: artifacts built for real, a fleet of them with keys, snapshots."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric import ec
from safetensors.torch import load_file, save_file

from deployer.build.pipeline import build_artifact
from deployer.build.spec import BuildRequest, QuantSpec
from deployer.core.hashing import sha256_file
from deployer.core.release import Envelope, PatchRef, make_release
from deployer.core.verify import TrustedKeys, key_id
from deployer.sign import add_signature, envelope_for

NOW = datetime(2026, 6, 1, 12, 0, 0, tzinfo=UTC)


def perturb(src: Path, dest: Path, *, names: int, scale: float, seed: int) -> Path:
    """A copy of checkpoint `src` whose first `names` weights moved by about `scale`."""
    shutil.copytree(src, dest)
    tensors = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for name in sorted(tensors)[:names]:
        t = tensors[name]
        tensors[name] = t + scale * torch.randn(t.shape, generator=gen, dtype=t.dtype)
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def build(src: Path, store: Path, version: str, scheme: str = "int8") -> Path:
    """Build an artifact of `src` into `store` and return its directory."""
    request = BuildRequest(
        source_dir=src, name="tiny", version=version, quant=QuantSpec(scheme), store_dir=store
    )
    return build_artifact(request).artifact_dir


@dataclass(frozen=True)
class Fleet:
    """Two artifacts, a patch between them and a trusted key set: what attack tests start from."""

    v1: Path
    v2: Path
    patch: Path
    keys: tuple[ec.EllipticCurvePrivateKey, ...]

    def trusted(self, threshold: int = 1, count: int = 2) -> TrustedKeys:
        """The first `count` keys as trusted public keys."""
        return TrustedKeys({key_id(k.public_key()): k.public_key() for k in self.keys[:count]}, threshold)

    def release(
        self,
        *,
        counter: int = 2,
        signers: tuple[int, ...] = (0,),
        patch: bool = True,
        expires_in: timedelta = timedelta(days=30),
    ) -> Envelope:
        """A release of v2 (with the v1->v2 patch), signed by the keys numbered in `signers`."""
        ref = PatchRef(
            base_version="1.0.0",
            base_sha256=artifact_id(self.v1),
            sha256=sha(self.patch),
            size=self.patch.stat().st_size,
        )
        body = make_release(
            self.v2, counter=counter, expires_in=expires_in, now=NOW, patch=ref if patch else None
        )
        envelope = envelope_for(body)
        for i in signers:
            envelope = add_signature(envelope, self.keys[i])
        return envelope


def sha(path: Path) -> str:
    """sha256 of a file."""
    return sha256_file(path)


def artifact_id(artifact: Path) -> str:
    """The artifact id: sha256 of its sits-manifest.json."""
    return sha(artifact / "sits-manifest.json")


def tree(root: Path) -> dict[str, bytes]:
    """Every regular file under `root` with its bytes: to assert that nothing changed."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }
