"""What an attacker holding some key could write to a channel: metadata re-signed by a chosen key.

Each helper edits the channel as served (under nginx's root), bumping versions so that the device
would accept it if the signatures were right.
"""

from __future__ import annotations

from pathlib import Path

from securesystemslib.signer import CryptoSigner, SSlibKey
from tuf.api.metadata import Metadata, MetaFile, Root, Snapshot, Targets, Timestamp
from tuf.api.serialization.json import JSONSerializer

from deployer.release.sign import load_private_key


def signer(private_key: Path) -> CryptoSigner:
    """A TUF signer over one of the project's (unencrypted) private keys."""
    key = load_private_key(private_key, None)
    return CryptoSigner(key, SSlibKey.from_crypto(key.public_key()))


def _write(path: Path, metadata: Metadata, *signers: CryptoSigner) -> None:
    metadata.signatures.clear()
    for s in signers:
        metadata.sign(s, append=True)
    path.write_bytes(metadata.to_bytes(JSONSerializer(compact=False)))


def timestamp(channel: Path, by: CryptoSigner) -> None:
    """A newer timestamp.json naming the same snapshot, signed by `by` alone."""
    path = channel / "metadata/timestamp.json"
    md = Metadata[Timestamp].from_file(str(path))
    md.signed.version += 1
    _write(path, md, by)


def targets(channel: Path, by: CryptoSigner, online: CryptoSigner) -> None:
    """A newer targets (signed by `by`) with snapshot and timestamp properly signed by `online`:
    what a thief of the online key alone would publish."""
    meta = channel / "metadata"
    ts = Metadata[Timestamp].from_file(str(meta / "timestamp.json"))
    snap = Metadata[Snapshot].from_file(str(meta / f"{ts.signed.snapshot_meta.version}.snapshot.json"))
    tgt = Metadata[Targets].from_file(str(meta / f"{snap.signed.meta['targets.json'].version}.targets.json"))
    tgt.signed.version += 1
    _write(meta / f"{tgt.signed.version}.targets.json", tgt, by)
    snap.signed.version += 1
    snap.signed.meta["targets.json"] = MetaFile(tgt.signed.version)
    _write(meta / f"{snap.signed.version}.snapshot.json", snap, online)
    ts.signed.version += 1
    ts.signed.snapshot_meta = MetaFile(snap.signed.version)
    _write(meta / "timestamp.json", ts, online)


def next_root(channel: Path, new_key: CryptoSigner, *signed_by: CryptoSigner) -> int:
    """Root n+1 trusting only `new_key` for every role, signed by `signed_by`; returns n+1."""
    meta = channel / "metadata"
    current = max(int(p.name.split(".")[0]) for p in meta.glob("*.root.json"))
    md = Metadata[Root].from_file(str(meta / f"{current}.root.json"))
    root = md.signed
    for role in (Root.type, Targets.type, Snapshot.type, Timestamp.type):
        for keyid in list(root.roles[role].keyids):
            root.revoke_key(keyid, role)
        root.add_key(new_key.public_key, role)
    root.version = current + 1
    _write(meta / f"{root.version}.root.json", md, *signed_by)
    return root.version
