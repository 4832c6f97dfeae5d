"""Helpers for release tests: artifacts built for real, a fleet of them with keys, snapshots."""

from __future__ import annotations

import bz2
import hashlib
import json
import shutil
import struct
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import torch
import zstandard
from cryptography.hazmat.primitives.asymmetric import ec
from safetensors.torch import load_file, save_file

from deployer.build.pipeline import build_artifact
from deployer.build.spec import BuildRequest, QuantSpec
from deployer.core.canonical import legacy_canonical_json
from deployer.core.hashing import sha256_file
from deployer.core.patch_format import MAGIC, PREFIX_BYTES, TRAILER_BYTES
from deployer.core.release import Envelope, PatchRef, make_release
from deployer.core.verify import TrustedKeys, key_id
from deployer.release.sign import add_signature, envelope_for

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


def split_patch(patch: Path) -> tuple[dict[str, Any], list[bytes]]:
    """A patch's header as a JSON document, and its payload streams as stored (compressed)."""
    data = patch.read_bytes()
    (header_len,) = struct.unpack("<Q", data[len(MAGIC) : PREFIX_BYTES])
    header = json.loads(
        zstandard.ZstdDecompressor().decompress(data[PREFIX_BYTES : PREFIX_BYTES + header_len])
    )
    payload, streams = data[PREFIX_BYTES + header_len : -TRAILER_BYTES], []
    for spec in header["streams"]:
        streams.append(payload[: spec["length"]])
        payload = payload[spec["length"] :]
    return header, streams


def forge_patch(
    path: Path,
    header: dict[str, Any],
    streams: list[bytes],
    *,
    header_len: int | None = None,
    magic: bytes = MAGIC,
    raw_header: bytes | None = None,
) -> Path:
    """A patch of any header and streams, with a correct checksum: only their lies are left to catch.

    `header_len`, `magic` and `raw_header` (the compressed header) replace what would be written.
    """
    if raw_header is None:
        # An attacker's JSON need not be canonical, nor keep to RFC 8785's integer range.
        raw_header = zstandard.ZstdCompressor().compress(legacy_canonical_json(header))
    length = len(raw_header) if header_len is None else header_len
    body = magic + struct.pack("<Q", length) + raw_header + b"".join(streams)
    path.write_bytes(body + hashlib.sha256(body).digest())
    return path


def decode_stream(coder: str, raw: bytes) -> bytes:
    """A whole payload stream, decompressed."""
    if coder == "bz2":
        return bz2.decompress(raw)
    with zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True) as reader:
        return reader.read()


def encode_stream(coder: str, data: bytes) -> bytes:
    """`data` compressed as a payload stream of `coder`."""
    return bz2.compress(data) if coder == "bz2" else zstandard.ZstdCompressor().compress(data)


def stream_range(header: dict[str, Any], path: str, index: int) -> tuple[int, int, int]:
    """(stream, start, end) of the decoded stream bytes that segment `index` of file `path` reads."""
    used = [0] * len(header["streams"])
    for target in header["targets"]:
        for i, seg in enumerate(target["segments"]):
            if seg["stream"] is None:
                continue
            if target["path"] == path and i == index:
                start = used[seg["stream"]]
                return seg["stream"], start, start + seg["stream_bytes"]
            used[seg["stream"]] += seg["stream_bytes"]
    raise KeyError(f"{path} has no segment {index} that reads a stream")
