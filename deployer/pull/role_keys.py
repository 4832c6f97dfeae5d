"""The TUF role keys of `publish`: which public keys each role lists, and signers loaded on demand.

deploy.yaml `publish.roles.<role>` names public key files with a threshold; the private half of
`<name>.pub` is `<name>.key` beside it (what `sits-deployer keygen -o <name>` writes). A private key
is read only when its role must sign, so the root and targets keys can live offline and a routine
re-sign of the timestamp needs only the online keys. A role left out is signed by
`signing.private_key` alone. Encrypted keys are opened with `signing.passphrase_env`.

Rotating a root needs the OLD root's keys too: they are looked up among every key the config
names and the extra private keys the caller passes (`publish --old-root-key`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from securesystemslib.signer import CryptoSigner, Signer, SSlibKey
from tuf.api.metadata import Root, Snapshot, Targets, Timestamp

from deployer.config.models import Config, Publish, RoleKeys
from deployer.core.verify import load_public_key, read_key_file
from deployer.errors import KeyFileError

__all__ = ["ROLES", "KeyRing", "RoleKey", "RoleSpec", "private_half"]

ROLES = (Root.type, Targets.type, Snapshot.type, Timestamp.type)


@dataclass(frozen=True)
class RoleKey:
    """One key of a role: its public half (what the root lists) and where its private half is."""

    public: SSlibKey
    private: Path


@dataclass(frozen=True)
class RoleSpec:
    """What the root says about one role: its keys and how many must sign."""

    keys: tuple[RoleKey, ...]
    threshold: int

    @property
    def keyids(self) -> frozenset[str]:
        """The ids of the role's keys."""
        return frozenset(k.public.keyid for k in self.keys)


def private_half(public: Path) -> Path:
    """`keys/root.pub` -> `keys/root.key`."""
    return public.with_name(public.name.removesuffix(".pub") + ".key")


class KeyRing:
    """The keys of one config's TUF roles; private keys are loaded (once) only when asked to sign."""

    def __init__(self, config: Config, settings: Publish, extra: Sequence[Path] = ()) -> None:
        self.config = config
        self.settings = settings
        self._signers: dict[Path, CryptoSigner] = {}
        self._specs = {role: self._spec(role) for role in ROLES}
        self._extra = tuple(RoleKey(self._load(path).public_key, path) for path in extra)

    def spec(self, role: str) -> RoleSpec:
        """The keys and threshold deploy.yaml gives `role`."""
        return self._specs[role]

    def signers(self, role: str) -> list[Signer]:
        """Signers for `role`, at least its threshold. Raises KeyFileError when too few are here."""
        spec = self.spec(role)
        return self._enough(spec.keys, spec.threshold, f"signing the {role} role")

    def signers_among(self, keyids: Collection[str], threshold: int, what: str) -> list[Signer]:
        """Signers for `threshold` of `keyids`, found among every key the config names (role keys and
        signing.private_key) and the extra keys: the old root's keys when rotating. Raises
        KeyFileError when too few are here."""
        pool = [*(k for role in ROLES for k in self.spec(role).keys), *self._extra]
        signing = self.config.signing
        release_key = self.config.resolve(signing.private_key) if signing and signing.private_key else None
        if release_key is not None and release_key.is_file():  # it signed every role by default
            pool.append(RoleKey(self._load(release_key).public_key, release_key))
        found: dict[str, RoleKey] = {}
        for key in pool:
            if key.public.keyid in keyids:
                found.setdefault(key.public.keyid, key)
        return self._enough(tuple(found.values()), threshold, what, known=len(found))

    def _enough(
        self, keys: Sequence[RoleKey], threshold: int, what: str, *, known: int | None = None
    ) -> list[Signer]:
        present = [k for k in keys if k.private.is_file()]
        if len(present) < threshold:
            offline = ", ".join(str(k.private) for k in keys if not k.private.is_file())
            found = f"{len(present)} of them are here" + (f" (not here: {offline})" if offline else "")
            if known is not None:
                found += f"; deploy.yaml and --old-root-key name {known} of its keys"
            raise KeyFileError(
                f"{what} needs {threshold} signature(s), but {found}",
                hint="publish where the offline private keys are (each <name>.key beside its <name>.pub), "
                "or pass the old root's keys with --old-root-key",
            )
        signers: list[Signer] = []
        for key in present:
            signer = self._load(key.private)
            if signer.public_key.keyid != key.public.keyid:
                raise KeyFileError(
                    f"{key.private} is not the private half of the key deploy.yaml names for it",
                    hint="each <name>.key must be the pair of <name>.pub (sits-deployer keygen -o <name>)",
                )
            signers.append(signer)
        return signers

    def _spec(self, role: str) -> RoleSpec:
        named: RoleKeys | None = getattr(self.settings.roles, role)
        if named is not None:
            keys = tuple(
                RoleKey(_public_key(self.config.resolve(p)), private_half(self.config.resolve(p)))
                for p in named.keys
            )
            return RoleSpec(keys, named.threshold)
        signing = self.config.signing
        if signing is None or signing.private_key is None:
            raise KeyFileError(
                f"the TUF {role} role has no keys: set publish.roles.{role} or signing.private_key",
                hint="make a key with `sits-deployer keygen -o keys/release` and name it under signing:",
            )
        path = self.config.resolve(signing.private_key)
        return RoleSpec((RoleKey(self._load(path).public_key, path),), 1)

    def _load(self, path: Path) -> CryptoSigner:
        from deployer.release.sign import load_signing_key

        if path not in self._signers:
            env = self.config.signing.passphrase_env if self.config.signing else "SITS_SIGNING_PASSPHRASE"
            key = load_signing_key(path, env)
            self._signers[path] = CryptoSigner(key, SSlibKey.from_crypto(key.public_key()))
        return self._signers[path]


def _public_key(path: Path) -> SSlibKey:
    """An EC P-256 public key PEM as a TUF key. Raises KeyFileError."""
    _, key = load_public_key(read_key_file(path), str(path))
    return SSlibKey.from_crypto(key)
