"""`keygen`, `sign`, `verify`, `delta`, `patch-apply` and `release`: thin wrappers, one call each."""

from __future__ import annotations

import os
import re
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import click

from deployer.cli.common import emit_json, examples, info, output_option
from deployer.core.adapter_release import ADAPTER_MANIFEST
from deployer.core.fsutil import atomic_write
from deployer.core.hashing import sha256_file
from deployer.core.manifest import MANIFEST_NAME, read_manifest
from deployer.core.redact import Secret
from deployer.core.release import Envelope, PatchRef, make_release, read_envelope
from deployer.core.verify import (
    Installed,
    TrustedKeys,
    apply_verified_patch,
    load_trusted_keys,
    verify_artifact_dir,
    verify_patch_file,
    verify_release,
)
from deployer.errors import KeyFileError, SitsError

PASSPHRASE_ENV = "SITS_SIGNING_PASSPHRASE"
_DURATION = re.compile(r"^(\d+)([dhms])$")
_UNITS = {"d": "days", "h": "hours", "m": "minutes", "s": "seconds"}

passphrase_env_option = click.option(
    "--passphrase-env",
    default=PASSPHRASE_ENV,
    show_default=True,
    metavar="NAME",
    help="Environment variable holding the key passphrase (prompted for when unset).",
)
trusted_key_option = click.option(
    "--trusted-key",
    "trusted_keys",
    multiple=True,
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="A trusted public key PEM (repeat for several).",
)
threshold_option = click.option(
    "--threshold", default=1, show_default=True, help="Valid trusted signatures required (k of n)."
)
counter_option = click.option(
    "--installed-counter",
    default=0,
    show_default=True,
    help="Release counter installed now; the release must be above it.",
)


def _passphrase(env_name: str, *, confirm: bool) -> Secret:
    """The passphrase from `env_name`, else from a prompt on a terminal. Never echoed."""
    value = Secret.from_env(env_name, os.environ)
    if value is not None:
        return value
    if not sys.stdin.isatty():
        raise KeyFileError(
            f"no passphrase: ${env_name} is unset and there is no terminal to ask on",
            hint=f"export {env_name}=... or run interactively",
        )
    text = click.prompt("Key passphrase", hide_input=True, confirmation_prompt=confirm, err=True)
    return Secret(str(text), "<the passphrase typed>")


def _duration(text: str) -> timedelta:
    match = _DURATION.match(text)
    if not match:
        raise click.BadParameter(f"{text!r}: use a number and a unit, e.g. 30d, 12h, 90m")
    return timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})


def _trusted(paths: tuple[Path, ...], threshold: int) -> TrustedKeys:
    if not paths:
        raise KeyFileError("no trusted keys given", hint="pass --trusted-key PUB (repeatable)")
    return load_trusted_keys(paths, threshold)


def _artifact_id(directory: Path) -> str | None:
    manifest = directory / MANIFEST_NAME
    return sha256_file(manifest) if manifest.is_file() else None


def _signed(envelope: Envelope, keys: tuple[Path, ...], passphrase_env: str) -> Envelope:
    """`envelope` with a signature added by each key (passphrase asked for once, if needed)."""
    from deployer.release.sign import add_signature, is_encrypted, load_private_key

    secret = None
    for path in keys:
        if is_encrypted(path) and secret is None:
            secret = _passphrase(passphrase_env, confirm=False)
        envelope = add_signature(envelope, load_private_key(path, secret if is_encrypted(path) else None))
    return envelope


def _write_envelope(envelope: Envelope, path: Path) -> None:
    atomic_write(path, envelope.to_bytes())


@click.command(
    epilog=examples(
        "sits-deployer keygen -o keys/release",
        "SITS_SIGNING_PASSPHRASE=... sits-deployer keygen -o keys/release --output json",
    )
)
@click.option(
    "-o",
    "--out",
    "prefix",
    required=True,
    type=click.Path(path_type=Path),
    help="Path prefix: writes PREFIX.key (private) and PREFIX.pub (public).",
)
@passphrase_env_option
@click.option(
    "--unencrypted",
    is_flag=True,
    help="Write the private key WITHOUT encryption (tests and throwaway keys only).",
)
@output_option
def keygen(prefix: Path, passphrase_env: str, unencrypted: bool, output: str) -> None:
    """Make an ECDSA P-256 signing key pair (private key encrypted with a passphrase)."""
    from deployer.release.sign import generate_key

    passphrase = None if unencrypted else _passphrase(passphrase_env, confirm=True)
    pair = generate_key(
        prefix.with_name(prefix.name + ".key"),
        prefix.with_name(prefix.name + ".pub"),
        passphrase=passphrase,
        unencrypted=unencrypted,
    )
    data = {"keyid": pair.keyid, "private": str(pair.private_path), "public": str(pair.public_path)}
    if output == "json":
        emit_json(data)
    else:
        info(f"key {pair.keyid}: private {pair.private_path} (mode 0600), public {pair.public_path}")


@click.command(
    epilog=examples(
        "sits-deployer sign release.json --key keys/release.key",
        "sits-deployer sign release.json --key keys/a.key --key keys/b.key -o signed.json",
    )
)
@click.argument("manifest", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option(
    "--key",
    "keys",
    multiple=True,
    required=True,
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="Private key to sign with (repeat for several).",
)
@click.option("-o", "--out", type=click.Path(path_type=Path), help="Write here (default: in place).")
@passphrase_env_option
@output_option
def sign(manifest: Path, keys: tuple[Path, ...], out: Path | None, passphrase_env: str, output: str) -> None:
    """Add signatures to a release manifest."""
    envelope = _signed(read_envelope(manifest), keys, passphrase_env)
    _write_envelope(envelope, out or manifest)
    keyids = [s.keyid for s in envelope.signatures]
    if output == "json":
        emit_json({"manifest": str(out or manifest), "signatures": keyids})
    else:
        info(f"{out or manifest}: signed by {', '.join(keyids)}")


@click.command(
    epilog=examples(
        "sits-deployer verify release.json --trusted-key keys/release.pub",
        "sits-deployer verify release.json --trusted-key keys/release.pub --installed ./v1 --patch v.patch",
    )
)
@click.argument("manifest", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@trusted_key_option
@threshold_option
@counter_option
@click.option(
    "--installed",
    type=click.Path(path_type=Path, file_okay=False),
    help="The installed artifact directory (its id is checked against a patch's base).",
)
@click.option(
    "--patch",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="Check this patch's length and sha256 against the release.",
)
@click.option(
    "--artifact",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="Check every file of this artifact directory against the release.",
)
@output_option
def verify(
    manifest: Path,
    trusted_keys: tuple[Path, ...],
    threshold: int,
    installed_counter: int,
    installed: Path | None,
    patch: Path | None,
    artifact: Path | None,
    output: str,
) -> None:
    """Verify a release manifest as a device would: signatures, expiry, counter, base, files."""
    state = Installed(installed_counter, _artifact_id(installed) if installed else None)
    release = verify_release(
        read_envelope(manifest), _trusted(trusted_keys, threshold), now=datetime.now(UTC), installed=state
    )
    if patch is not None:
        verify_patch_file(patch, release)
    if artifact is not None:
        verify_artifact_dir(artifact, release)
    data = {
        "model": release.model.name,
        "version": release.model.version,
        "counter": release.counter,
        "artifact": release.artifact.sha256,
        "expires": release.expires,
        "patch": patch is not None,
        "files": artifact is not None,
    }
    if output == "json":
        emit_json({"ok": True, **data})
    else:
        info(
            f"ok: {release.model.name} {release.model.version} counter {release.counter}, "
            f"expires {release.expires}"
        )


@click.command(
    epilog=examples(
        "sits-deployer delta --from .sits/store/artifacts/<v1> --to .sits/store/artifacts/<v2> -o v1-v2.patch"
    )
)
@click.option(
    "--from",
    "base",
    required=True,
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="The base artifact directory (what devices have).",
)
@click.option(
    "--to",
    "target",
    required=True,
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="The target artifact directory.",
)
@click.option(
    "-o",
    "--out",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="The patch file to write.",
)
@output_option
def delta(base: Path, target: Path, out: Path, output: str) -> None:
    """Make a tensor-aware patch that turns one artifact into another."""
    from deployer.release.delta import create_patch

    summary = create_patch(base, target, out)
    data = {
        "patch": str(summary.path),
        "size": summary.size,
        "sha256": summary.sha256,
        "target_bytes": summary.target_bytes,
        "files": summary.files,
        "codecs": summary.codecs,
    }
    if output == "json":
        emit_json(data)
    else:
        ratio = summary.size / max(summary.target_bytes, 1)
        info(f"{out}: {summary.size:,} bytes ({ratio:.2%} of the target), codecs {summary.codecs}")


@click.command(
    name="patch-apply",
    epilog=examples(
        "sits-deployer patch-apply --base ./v1 --patch v1-v2.patch -o ./staging",
        "sits-deployer patch-apply --base ./v1 --patch v.patch -o out --manifest r.json --trusted-key k.pub",
    ),
)
@click.option(
    "--base",
    required=True,
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="The installed (base) artifact directory.",
)
@click.option(
    "--patch",
    required=True,
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="The patch file.",
)
@click.option(
    "-o",
    "--out",
    required=True,
    type=click.Path(path_type=Path),
    help="Staging directory for the output (created; must be empty).",
)
@click.option(
    "--manifest",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="A signed release manifest to verify first (then --trusted-key is required).",
)
@trusted_key_option
@threshold_option
@counter_option
@output_option
def patch_apply(
    base: Path,
    patch: Path,
    out: Path,
    manifest: Path | None,
    trusted_keys: tuple[Path, ...],
    threshold: int,
    installed_counter: int,
    output: str,
) -> None:
    """Apply a patch into a staging directory, verifying everything (debugging and tests)."""
    from deployer.core.patch_apply import apply_patch

    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise SitsError(f"{out}: the staging directory is not empty", hint="pass an empty directory")
    if manifest is None:
        files = {f.path: f.sha256 for f in apply_patch(patch, base, out).files}
    else:
        state = Installed(installed_counter, _artifact_id(base))
        trusted = _trusted(trusted_keys, threshold)
        release = apply_verified_patch(
            read_envelope(manifest), patch, base, out, trusted, now=datetime.now(UTC), installed=state
        )
        files = {rel: f.sha256 for rel, f in sorted(release.artifact.files.items())}
    if output == "json":
        emit_json({"out": str(out), "files": files, "verified_release": manifest is not None})
    else:
        info(f"{out}: {len(files)} files written and verified")


@click.command(
    epilog=examples(
        "sits-deployer release ./v2 --counter 7 --key keys/release.key -o release.json",
        "sits-deployer release ./v2 --counter 8 --base ./v1 --patch v.patch --key keys/release.key -o r.json",
    )
)
@click.argument("artifact", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option(
    "--counter",
    required=True,
    type=click.IntRange(min=1),
    help="Release counter: above every release the fleet has seen.",
)
@click.option("--expires-in", default="30d", show_default=True, help="Validity, e.g. 30d, 12h.")
@click.option(
    "--base", type=click.Path(path_type=Path, exists=True, file_okay=False), help="Base artifact of --patch."
)
@click.option(
    "--patch",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="A patch from --base to ARTIFACT to bind into the release.",
)
@click.option(
    "--key",
    "keys",
    multiple=True,
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="Sign with this private key (repeatable); unsigned if omitted.",
)
@click.option(
    "-o",
    "--out",
    required=True,
    type=click.Path(path_type=Path, dir_okay=False),
    help="Release manifest to write.",
)
@passphrase_env_option
@output_option
def release(
    artifact: Path,
    counter: int,
    expires_in: str,
    base: Path | None,
    patch: Path | None,
    keys: tuple[Path, ...],
    out: Path,
    passphrase_env: str,
    output: str,
) -> None:
    """Make a release manifest for ARTIFACT (optionally for a patch from --base), and sign it.
    An adapter artifact (it holds sits-adapter.json) gets an adapter release, for `sits-agent
    adapter install`; its counter line is its own."""
    from deployer.release.sign import envelope_for

    if (base is None) != (patch is None):
        raise click.UsageError("--base and --patch go together")
    if (artifact / ADAPTER_MANIFEST).is_file():
        _release_adapter(
            artifact, counter, _duration(expires_in), base, patch, keys, out, passphrase_env, output
        )
        return
    patch_ref = None
    if base is not None and patch is not None:
        base_id = _artifact_id(base) or ""
        patch_ref = PatchRef(
            base_version=read_manifest(base).model.version,
            base_sha256=base_id,
            sha256=sha256_file(patch),
            size=patch.stat().st_size,
        )
    body = make_release(artifact, counter=counter, expires_in=_duration(expires_in), patch=patch_ref)
    envelope = _signed(envelope_for(body), keys, passphrase_env)
    _write_envelope(envelope, out)
    data = {
        "manifest": str(out),
        "version": body.model.version,
        "counter": counter,
        "artifact": body.artifact.sha256,
        "expires": body.expires,
        "signatures": [s.keyid for s in envelope.signatures],
    }
    if output == "json":
        emit_json(data)
    else:
        info(
            f"{out}: {body.model.name} {body.model.version} counter {counter}, "
            f"expires {body.expires}, {len(envelope.signatures)} signature(s)"
        )


def _release_adapter(
    artifact: Path,
    counter: int,
    expires_in: timedelta,
    base: Path | None,
    patch: Path | None,
    keys: tuple[Path, ...],
    out: Path,
    passphrase_env: str,
    output: str,
) -> None:
    """`release` of an adapter artifact: the same flags, an adapter release."""
    from deployer.core.adapter_release import make_adapter_release, read_adapter_manifest
    from deployer.release.sign import envelope_for

    patch_ref = None
    if base is not None and patch is not None:
        patch_ref = PatchRef(
            base_version=read_adapter_manifest(base).adapter.version,
            base_sha256=sha256_file(base / ADAPTER_MANIFEST),
            sha256=sha256_file(patch),
            size=patch.stat().st_size,
        )
    body = make_adapter_release(artifact, counter=counter, expires_in=expires_in, patch=patch_ref)
    envelope = _signed(envelope_for(body), keys, passphrase_env)
    _write_envelope(envelope, out)
    if output == "json":
        emit_json(
            {
                "manifest": str(out),
                "adapter": body.adapter.name,
                "version": body.adapter.version,
                "base_artifact_id": body.base_artifact_id,
                "counter": counter,
                "artifact": body.artifact.sha256,
                "expires": body.expires,
                "signatures": [s.keyid for s in envelope.signatures],
            }
        )
    else:
        info(
            f"{out}: adapter {body.adapter.name} {body.adapter.version} counter {counter}, "
            f"expires {body.expires}, {len(envelope.signatures)} signature(s)"
        )
