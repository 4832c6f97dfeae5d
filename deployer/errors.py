"""The one exception tree of SITS-Deployer.

Every error says what went wrong, where, and what to do next. Foreign exceptions
(OSError, yaml, pydantic, cryptography, paramiko, ...) are wrapped at module
boundaries, so callers only ever catch these::

    SitsError
    ├── ConfigError           deploy.yaml / inventory problems (carries findings with positions)
    ├── BuildError            building an artifact
    │   ├── SourceModelError      the input model directory is missing, corrupt or unsupported
    │   └── QualityGateError      the quantized model degraded past the configured limits
    ├── IntegrityError        something failed verification; nothing was installed
    │   ├── FormatError           a file (safetensors, patch, manifest) is malformed or lies
    │   ├── HashMismatchError     content does not match its declared sha256
    │   ├── SignatureError        missing, invalid, untrusted or too few signatures
    │   ├── ExpiredError          the release manifest has expired
    │   ├── ReplayError           release counter not above the installed one (rollback/replay)
    │   ├── BaseMismatchError     the patch is for another base than the one installed
    │   └── UnsafePathError       a file name escapes its directory (.., absolute, symlink)
    ├── KeyFileError          a key file is missing, unreadable, encrypted without passphrase, wrong type
    ├── HookError             a user hook failed, hung past its timeout, or could not start
    ├── TransportError        talking to a device failed (unreachable, auth, host key, dropped)
    │   └── RefusedError          it answered but refused us (auth): never retried, never "offline"
    │       └── HostKeyError          unknown or changed host key: never trusted silently
    └── AgentError            the device agent refused or failed an operation
        └── GrammarError          a request's output constraints left its model no token to write

This module imports nothing but the standard library: the device agent uses it too.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "AgentError",
    "BaseMismatchError",
    "BuildError",
    "ConfigError",
    "ExpiredError",
    "FormatError",
    "GrammarError",
    "HashMismatchError",
    "HookError",
    "HostKeyError",
    "IntegrityError",
    "KeyFileError",
    "QualityGateError",
    "RefusedError",
    "ReplayError",
    "SignatureError",
    "SitsError",
    "SourceModelError",
    "TransportError",
    "UnsafePathError",
]


class SitsError(Exception):
    """Base of every error SITS-Deployer raises on purpose.

    ``hint`` is what the user can do about it; the CLI prints it on its own line.
    """

    exit_code: int = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} (hint: {self.hint})"


class ConfigError(SitsError):
    """The configuration is invalid. ``findings`` holds every problem found, not just the first."""

    def __init__(self, message: str, *, findings: list | None = None, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.findings = list(findings or [])


class BuildError(SitsError):
    """Building a model artifact failed; no partial artifact was left in the store."""


class SourceModelError(BuildError):
    """The source model directory is missing, corrupt, or of an unsupported architecture/dtype."""


class QualityGateError(BuildError):
    """The quantized model degraded past the limits in deploy.yaml. ``report`` has the figures."""

    def __init__(self, message: str, *, report: dict | None = None, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.report = dict(report or {})


class IntegrityError(SitsError):
    """Verification failed. Nothing was installed or promoted."""


class FormatError(IntegrityError):
    """A file is malformed, truncated, or its header contradicts its contents."""


class HashMismatchError(IntegrityError):
    """Content does not match the sha256 it was declared with."""


class SignatureError(IntegrityError):
    """Signatures are missing, invalid, from untrusted keys, or below the threshold."""


class ExpiredError(IntegrityError):
    """The release manifest is past its expiry time."""


class ReplayError(IntegrityError):
    """The release counter is not above the installed one: a replay or a downgrade."""


class BaseMismatchError(IntegrityError):
    """The patch was made for a different base version than the one installed."""


class UnsafePathError(IntegrityError):
    """A file name would escape its directory: '..', an absolute path, or a symlink."""


class KeyFileError(SitsError):
    """A key file is missing, unreadable, of the wrong type, or needs a passphrase we do not have."""


class HookError(SitsError):
    """A hook could not be started, exited non-zero, or ran past its timeout.

    ``returncode`` is the hook's own status (``exit_code`` stays the CLI's, as for every SitsError):
    None when it never ran, negative when a signal ended it; ``output`` holds
    the tail of what it printed; ``phase`` is pre-deploy, post-deploy, pre-rollback or post-rollback.
    """

    def __init__(
        self,
        message: str,
        *,
        phase: str,
        path: Path,
        returncode: int | None = None,
        output: str = "",
        hint: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.phase = phase
        self.path = path
        self.returncode = returncode
        self.output = output


class TransportError(SitsError):
    """Talking to a device failed: unreachable, refused, authentication, or a dropped connection."""


class RefusedError(TransportError):
    """The device answered but the connection must not go on: its host key or our credentials.
    Retrying cannot fix it, and such a device is never skipped as if it were offline."""


class HostKeyError(RefusedError):
    """A device's host key is unknown or changed. It is never trusted silently."""


class AgentError(SitsError):
    """The device agent refused or failed an operation. ``param`` names the request field a
    refusal concerns, as the client sent it (the API's error object carries it), when one does."""

    def __init__(self, message: str, *, hint: str | None = None, param: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.param = param


class GrammarError(AgentError):
    """A request's grammar (response_format, tools) refused to go on: it allows no token at this
    point, or refused the one picked. The request has failed; requests beside it are unaffected."""
