"""The offline bundle: what `sits-deployer bundle` writes and `sits-agent install --from` reads.

A directory, or the same tree in a tar file (optionally gzip-compressed)::

    sits-bundle.json                        the index: a release envelope whose `signed` part is
                                            a BundleIndex, signed by the release key(s)
    full/release.json, full/artifact/<f>    the signed release of the whole artifact
    patch/<base sha256>/release.json        a signed release as a patch from that base,
    patch/<base sha256>/delta.patch         and the patch
    wheels/<f>.whl, wheels/requirements.txt optional: the agent's wheels for one platform, and the
                                            pins with their sha256 (`pip install --no-index
                                            --require-hashes -r`) that install the agent from them

The index names the device class the bundle is for and every other file's sha256 and size; the
releases inside are verified on the device exactly as pushed or pulled ones (signatures, expiry,
counter, base, hashes). Signing the index binds the class, so a bundle cannot be relabelled for
another class without the key.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployer.core.release import SHA256, TIMESTAMP, FileHash
from deployer.errors import FormatError

__all__ = [
    "AGENT_WHEEL",
    "BUNDLE_INDEX",
    "FULL_DIR",
    "PATCH_DIR",
    "REQUIREMENTS",
    "WHEELS_DIR",
    "BundleIndex",
    "parse_bundle_index",
]

BUNDLE_INDEX = "sits-bundle.json"
FULL_DIR = "full"
PATCH_DIR = "patch"
WHEELS_DIR = "wheels"
REQUIREMENTS = f"{WHEELS_DIR}/requirements.txt"  # the wheels' pins with their sha256, for pip
AGENT_WHEEL = "sits_agent"  # the agent's distribution, as its wheel's file name spells it
MAX_FILES = 4096


class BundleIndex(BaseModel):
    """The signed part of `sits-bundle.json`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["sits-bundle"] = "sits-bundle"
    format_version: Literal[1] = 1
    application: str = Field(min_length=1, max_length=200)
    # deploy.yaml's profile of the devices it is for; None: devices without a profile.
    device_class: str | None = Field(default=None, min_length=1, max_length=200)
    version: str = Field(min_length=1, max_length=100)
    artifact_sha256: str = Field(pattern=SHA256)
    created: str = Field(pattern=TIMESTAMP)
    files: dict[str, FileHash] = Field(max_length=MAX_FILES)

    def patch_bases(self) -> tuple[str, ...]:
        """The artifact ids the bundle carries a patch from."""
        prefix = f"{PATCH_DIR}/"
        return tuple(
            sorted({p.split("/")[1] for p in self.files if p.startswith(prefix) and p.count("/") == 2})
        )

    def wheels(self) -> tuple[str, ...]:
        """The files under wheels/: the agent's wheels and their requirements.txt."""
        return tuple(sorted(p for p in self.files if p.startswith(f"{WHEELS_DIR}/")))

    def agent_version(self) -> str | None:
        """The version of the sits-agent wheel the bundle carries (None: it carries none)."""
        prefix = f"{WHEELS_DIR}/{AGENT_WHEEL}-"
        # A wheel's name is name-version-...; a version holds no '-' (PEP 427).
        wheels = [p for p in self.files if p.startswith(prefix) and p.endswith(".whl")]
        return wheels[0][len(prefix) :].split("-")[0] if wheels else None


def parse_bundle_index(signed: dict[str, Any], where: str) -> BundleIndex:
    """Validate the (signature-checked) signed part of a bundle index. Raises FormatError."""
    try:
        return BundleIndex.model_validate(signed)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise FormatError(f"{where}: not a bundle index: {loc}: {first['msg']}") from exc
