"""Host-key policy for SSH: known_hosts is the truth; nothing unknown or changed is trusted silently.

Strict by default: an unknown key is refused with its SHA256 fingerprint, so the operator can check
it against the device. Trust on first use is opt-in and records the key in the known_hosts file, so
from then on a changed key is refused like any other. A changed key is always refused.
"""

from __future__ import annotations

import threading
from pathlib import Path

import paramiko

from deployer.errors import HostKeyError

__all__ = ["KnownHostsPolicy", "changed_key_error", "fingerprint", "known_hosts_name"]

_append_lock = threading.Lock()  # transports of one fleet append to one file from many threads


def fingerprint(key: paramiko.PKey) -> str:
    """The OpenSSH-style fingerprint, e.g. 'SHA256:47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU'."""
    return key.fingerprint


def known_hosts_name(host: str, port: int) -> str:
    """How known_hosts names a host: bare for port 22, '[host]:port' otherwise."""
    return host if port == 22 else f"[{host}]:{port}"


class KnownHostsPolicy(paramiko.MissingHostKeyPolicy):
    """What to do with a host that known_hosts does not list: refuse, or (TOFU) record and accept."""

    def __init__(self, known_hosts: Path, *, trust_on_first_use: bool) -> None:
        self.known_hosts = known_hosts
        self.trust_on_first_use = trust_on_first_use

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        """Refuse with the fingerprint, or record the key when trust on first use is on."""
        if not self.trust_on_first_use:
            raise HostKeyError(
                f"{hostname} offered an unknown host key {key.get_name()} {fingerprint(key)}; "
                f"it is not in {self.known_hosts}, so the connection was refused",
                hint="compare the fingerprint with `ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` on "
                "the device and add the key to known_hosts, or enable trust on first use for this device",
            )
        _append(self.known_hosts, hostname, key)
        client.get_host_keys().add(hostname, key.get_name(), key)


def changed_key_error(
    host: str, port: int, offered: paramiko.PKey, expected: paramiko.PKey, known_hosts: Path
) -> HostKeyError:
    """The error for a host whose key differs from the one on record."""
    name = known_hosts_name(host, port)
    return HostKeyError(
        f"the host key of {name} CHANGED: it offered {offered.get_name()} {fingerprint(offered)}, "
        f"{known_hosts} has {expected.get_name()} {fingerprint(expected)}; the connection was refused",
        hint="if the device was reinstalled, check the new fingerprint on the device, then replace its "
        f"line (ssh-keygen -R '{name}' -f {known_hosts}); otherwise treat this as an attack",
    )


def _append(known_hosts: Path, hostname: str, key: paramiko.PKey) -> None:
    line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
    with _append_lock:
        known_hosts.parent.mkdir(parents=True, exist_ok=True)
        with known_hosts.open("a") as f:
            f.write(line)
