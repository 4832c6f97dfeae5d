"""The SSH transport (paramiko): key auth, checked host keys, one reused connection, resumable SFTP.

Connection errors (refused, unreachable, timed out, dropped during the handshake) are retried with
jittered exponential backoff; authentication and host-key failures are not (retrying cannot fix
them). A command is never re-run after its connection dropped: it may already have run. Uploads
go through `Transport.put`, which resumes a partial file after reconnecting.
"""

from __future__ import annotations

import contextlib
import re
import select
import shlex
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paramiko
from paramiko.hostkeys import InvalidHostKey

from deployer.core.redact import Secret
from deployer.errors import HostKeyError, KeyFileError, RefusedError, TransportError
from deployer.transport.base import ConnectionDropped, RetryPolicy, RunResult, Transport, copy_range
from deployer.transport.hostkeys import KnownHostsPolicy, changed_key_error

__all__ = ["SshOptions", "SshTransport"]

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_MISSING = 3  # exit code of the hashing command when the file does not exist
_EOF_GRACE_S = 2.0  # after exit, how long to wait for the output to end


@dataclass(frozen=True)
class SshOptions:
    """How to reach devices over SSH; one instance usually serves a whole fleet."""

    user: str = "root"
    key_file: Path | None = None  # None: the SSH agent and ~/.ssh/id_* keys
    passphrase: Secret | None = None  # of key_file; a Secret never shows in a repr or message
    known_hosts: Path = field(default_factory=lambda: Path("~/.ssh/known_hosts").expanduser())
    trust_on_first_use: bool = False
    connect_timeout_s: float = 10.0
    io_timeout_s: float = 30.0  # a transfer that stalls this long counts as a dropped connection
    hash_timeout_s: float = 300.0
    # Upload bytes sent but not yet acknowledged by the device: what a cut link can lose and the
    # resume must send again. paramiko alone keeps up to the channel window (2 MB) in flight; this
    # bounds it, at the cost of throughput where bandwidth x round trip exceeds it (raise it there).
    max_in_flight: int = 256 * 1024
    retry: RetryPolicy = field(default_factory=RetryPolicy)


class SshTransport(Transport):
    """Commands and files on one device over SSH. Connects on first use and keeps the connection."""

    def __init__(
        self, host: str, *, port: int = 22, options: SshOptions | None = None, label: str | None = None
    ) -> None:
        self.host = host
        self.port = port
        self.options = options or SshOptions()
        self.retry = self.options.retry
        self.label = label or f"{self.options.user}@{host}:{port}"
        self._client: paramiko.SSHClient | None = None
        self._sftp_client: paramiko.SFTPClient | None = None
        self._pkey: paramiko.PKey | None = None
        self._lock = threading.Lock()

    def run(self, cmd: str | Sequence[str], timeout: float = 60.0) -> RunResult:
        """Run a command on the device; see Transport.run. Never retried once sent."""
        command = cmd if isinstance(cmd, str) else shlex.join(cmd)
        channel = self._open_channel()
        try:
            channel.exec_command(command)
            return _collect(channel, timeout, lambda: self._timed_out(command, timeout))
        except (OSError, EOFError, paramiko.SSHException) as exc:
            self.close()
            raise TransportError(
                f"{self.label}: the connection dropped while running {command!r}: {_describe(exc)}",
                hint="the command may or may not have run; check the device's state before retrying",
            ) from exc
        finally:
            channel.close()

    def stream(self, cmd: str, write: Callable[[str], None]) -> int:
        """See Transport.stream. Closing the channel (Ctrl-C) hangs up the remote command."""
        channel = self._open_channel()
        try:
            channel.set_combine_stderr(True)
            channel.exec_command(cmd)
            while data := channel.recv(65536):
                write(data.decode("utf-8", errors="replace"))
            return channel.recv_exit_status()
        except (OSError, EOFError, paramiko.SSHException) as exc:
            self.close()
            raise TransportError(
                f"{self.label}: the connection dropped while running {cmd!r}: {_describe(exc)}"
            ) from exc
        finally:
            channel.close()

    def close(self) -> None:
        """Close the SFTP session and the connection (the next call reconnects)."""
        with self._lock:
            for closable in (self._sftp_client, self._client):
                if closable is not None:
                    with contextlib.suppress(Exception):  # closing a dead connection may raise anything
                        closable.close()
            self._sftp_client = self._client = None

    # connection

    def _connected(self) -> paramiko.SSHClient:
        with self._lock:
            if self._client is not None and _active(self._client):
                return self._client
            self._client = self._sftp_client = None
            self._client = self._connect()
            return self._client

    def _connect(self) -> paramiko.SSHClient:
        last: BaseException | None = None
        for delay in self.retry.delays():
            time.sleep(delay)
            try:
                return self._connect_once()
            except (OSError, EOFError, paramiko.SSHException) as exc:
                last = exc  # refused, unreachable, timed out, handshake cut: worth another try
        raise TransportError(
            f"{self.label}: cannot connect after {self.retry.attempts} attempts "
            f"(timeout {self.options.connect_timeout_s:g} s each): {_describe(last)}",
            hint="check that the device is powered, on the network and running sshd",
        )

    def _connect_once(self) -> paramiko.SSHClient:
        options = self.options
        client = paramiko.SSHClient()
        try:
            _load_known_hosts(client, options.known_hosts)
            client.set_missing_host_key_policy(
                KnownHostsPolicy(options.known_hosts, trust_on_first_use=options.trust_on_first_use)
            )
            pkey = self._private_key()
            timeout = options.connect_timeout_s
            client.connect(
                self.host,
                port=self.port,
                username=options.user,
                pkey=pkey,
                timeout=timeout,
                banner_timeout=timeout,
                auth_timeout=timeout,
                channel_timeout=timeout,
                allow_agent=pkey is None,
                look_for_keys=pkey is None,
            )
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise changed_key_error(
                self.host, self.port, exc.key, exc.expected_key, options.known_hosts
            ) from exc
        except paramiko.AuthenticationException as exc:
            client.close()
            raise RefusedError(
                f"{self.label}: authentication as {options.user!r} failed: {exc}",
                hint=f"authorize the public key of {options.key_file or 'your SSH key'} for that user",
            ) from exc
        except BaseException:
            client.close()
            raise
        _transport(client).set_keepalive(15)
        return client

    def _private_key(self) -> paramiko.PKey | None:
        key_file = self.options.key_file
        if key_file is None or self._pkey is not None:
            return self._pkey
        passphrase = self.options.passphrase.reveal() if self.options.passphrase else None
        try:
            self._pkey = paramiko.PKey.from_path(key_file, password=passphrase)
        except OSError as exc:
            raise KeyFileError(f"cannot read SSH key {key_file}: {exc.strerror or exc}") from exc
        except (ValueError, TypeError, paramiko.SSHException) as exc:
            # cryptography says TypeError for "encrypted, but no passphrase given"; never echo the passphrase.
            raise KeyFileError(
                f"cannot load SSH key {key_file}: {type(exc).__name__}: {exc}",
                hint="use an unencrypted ed25519/ecdsa/rsa key, or give its passphrase",
            ) from exc
        return self._pkey

    def _open_channel(self) -> paramiko.Channel:
        """A session channel; a cached connection that died while idle is replaced once (nothing was sent)."""
        last: BaseException | None = None
        for _ in range(2):
            try:
                transport = _transport(self._connected())
                return transport.open_session(timeout=self.options.connect_timeout_s)
            except (OSError, EOFError, paramiko.SSHException) as exc:
                last = exc
                self.close()
        raise TransportError(f"{self.label}: cannot open a session: {_describe(last)}")

    def _sftp(self) -> paramiko.SFTPClient:
        client = self._connected()
        with self._lock:
            # `sock` is the channel get_channel() returns, typed without get_channel's None.
            if self._sftp_client is None or self._sftp_client.sock.closed:
                self._sftp_client = client.open_sftp()
                self._sftp_client.sock.settimeout(self.options.io_timeout_s)
            return self._sftp_client

    def _timed_out(self, command: str, timeout: float) -> TransportError:
        return TransportError(
            f"{self.label}: {command!r} did not finish within {timeout:g} s; its channel was closed "
            "(the command may still be running on the device)",
            hint="raise the timeout or look at what the command waits for",
        )

    # file primitives for Transport.put / Transport.get

    def _size(self, remote_path: str) -> int | None:
        with self._sftp_io(f"stat {remote_path}"):
            try:
                return self._sftp().stat(remote_path).st_size
            except FileNotFoundError:
                return None

    def _remote_sha256(self, remote_path: str, length: int | None = None) -> str | None:
        path = shlex.quote(remote_path)
        head = f"sha256sum < {path}" if length is None else f"head -c {int(length)} -- {path} | sha256sum"
        result = self.run(
            f"if [ -f {path} ]; then {head}; else exit {_MISSING}; fi", self.options.hash_timeout_s
        )
        if result.rc == _MISSING:
            return None
        digest = result.check(f"{self.label}: hashing {remote_path}").stdout.split(" ", 1)[0].strip()
        if not _SHA256.match(digest):
            raise TransportError(f"{self.label}: sha256sum printed {result.stdout[:80]!r}, not a digest")
        return digest

    def _write(
        self, local_path: Path, remote_path: str, offset: int, on_bytes: Callable[[int], None]
    ) -> None:
        with (
            self._sftp_io(f"upload to {remote_path}"),
            self._sftp().open(remote_path, "r+b" if offset else "wb") as f,
        ):
            f.set_pipelined(True)
            f.seek(offset)
            copy_range(
                local_path, self._paced(_acked_writer(f, self.options.max_in_flight)), offset, on_bytes
            )

    def _read(self, remote_path: str, local_path: Path) -> None:
        with self._sftp_io(f"download of {remote_path}"):
            self._sftp().get(remote_path, str(local_path))

    def _rename(self, src: str, dst: str) -> None:
        with self._sftp_io(f"rename {src} to {dst}"):
            self._sftp().posix_rename(src, dst)

    def _remove(self, remote_path: str) -> None:
        with self._sftp_io(f"remove {remote_path}"), contextlib.suppress(FileNotFoundError):
            self._sftp().remove(remote_path)

    def _makedirs(self, remote_dir: str) -> None:
        self.run(["mkdir", "-p", "--", remote_dir], self.options.connect_timeout_s).check(
            f"{self.label}: creating {remote_dir}"
        )

    @contextlib.contextmanager
    def _sftp_io(self, what: str) -> Iterator[None]:
        """Sort SFTP failures: a lost or stalled connection (resumable) or a remote file error (not)."""
        try:
            yield
        except (TimeoutError, EOFError, paramiko.SSHException) as exc:
            raise ConnectionDropped(f"{what}: {_describe(exc)}") from exc
        except OSError as exc:
            if self._client is None or not _active(self._client):
                raise ConnectionDropped(f"{what}: {_describe(exc)}") from exc
            raise TransportError(f"{self.label}: {what} failed: {exc.strerror or exc}") from exc


def _acked_writer(f: paramiko.SFTPFile, max_in_flight: int) -> Callable[[bytes], None]:
    """`f.write` (pipelined) that waits for the device's acknowledgements of the oldest writes
    whenever more than `max_in_flight` bytes are unacknowledged, so that a dropped connection loses
    at most that much. paramiko keeps its pending write requests (one per MAX_REQUEST_SIZE) in
    `_reqs` and drains them with `_read_response`, as its own write does; neither is in its stubs."""
    pipeline: Any = f
    piece = f.MAX_REQUEST_SIZE
    pending = max(1, max_in_flight // piece)

    def write(data: bytes) -> None:
        view = memoryview(data)
        for start in range(0, len(view), piece):
            f.write(bytes(view[start : start + piece]))
            while len(pipeline._reqs) > pending:
                kind, _ = pipeline.sftp._read_response(pipeline._reqs.popleft())
                if kind != paramiko.sftp.CMD_STATUS:
                    raise paramiko.SFTPError("expected a status in reply to a write")

    return write


def _load_known_hosts(client: paramiko.SSHClient, known_hosts: Path) -> None:
    if not known_hosts.exists():
        return  # every host is unknown: refused, or recorded under trust on first use
    try:
        client.load_host_keys(str(known_hosts))
    except (OSError, paramiko.SSHException, InvalidHostKey) as exc:
        raise HostKeyError(
            f"cannot read known_hosts file {known_hosts}: {exc}",
            hint="fix or remove the broken line (ssh-keygen -F <host> -f <file> finds a host's lines)",
        ) from exc


def _transport(client: paramiko.SSHClient) -> paramiko.Transport:
    """The client's transport; paramiko gives None once the client is closed (by another thread)."""
    transport = client.get_transport()
    if transport is None:
        raise paramiko.SSHException("the connection was closed")
    return transport


def _active(client: paramiko.SSHClient) -> bool:
    transport = client.get_transport()
    return transport is not None and transport.is_active()


def _collect(
    channel: paramiko.Channel, timeout: float, on_timeout: Callable[[], TransportError]
) -> RunResult:
    """Read stdout and stderr until the command exits and its output ends, or raise at the deadline."""
    deadline = time.monotonic() + timeout
    out, err = bytearray(), bytearray()
    exited_at: float | None = None  # a background child may hold the output open after exit
    while True:
        progressed = False
        while channel.recv_ready():
            out += channel.recv(65536)
            progressed = True
        while channel.recv_stderr_ready():
            err += channel.recv_stderr(65536)
            progressed = True
        if exited_at is None and channel.exit_status_ready():
            exited_at = time.monotonic()
        if (
            exited_at is not None
            and not progressed
            and (channel.eof_received or time.monotonic() > exited_at + _EOF_GRACE_S)
        ):
            break
        if time.monotonic() > deadline:
            raise on_timeout()
        if not progressed:
            select.select([channel], [], [], 0.05)  # wakes on stdout data; stderr and exit are polled
    return RunResult(channel.recv_exit_status(), out.decode(errors="replace"), err.decode(errors="replace"))


def _describe(exc: BaseException | None) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc) if exc is not None else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
