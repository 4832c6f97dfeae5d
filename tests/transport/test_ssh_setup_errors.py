"""SSH set-up errors that are found before any packet is sent: key files and known_hosts files."""

from __future__ import annotations

import paramiko
import pytest

from deployer.core.redact import Secret
from deployer.errors import HostKeyError, KeyFileError
from deployer.transport.base import RetryPolicy
from deployer.transport.ssh import SshOptions, SshTransport

# 127.0.0.1 with no connection ever made: each error below is raised before connecting.
HOST = "127.0.0.1"


def _transport(**options) -> SshTransport:
    return SshTransport(HOST, port=9, options=SshOptions(retry=RetryPolicy(attempts=1), **options))


def test_missing_key_file_is_a_key_file_error(tmp_path):
    with pytest.raises(KeyFileError, match=r"cannot read SSH key .*nokey"):
        _transport(key_file=tmp_path / "nokey", known_hosts=tmp_path / "kh").run("true")


def test_encrypted_key_without_passphrase_is_refused_without_echoing_secrets(tmp_path):
    key = tmp_path / "enc_key"
    paramiko.ECDSAKey.generate().write_private_key_file(str(key), password="s3cret-pass")
    with pytest.raises(KeyFileError) as caught:
        _transport(key_file=key, known_hosts=tmp_path / "kh").run("true")
    assert "enc_key" in str(caught.value)
    with pytest.raises(KeyFileError) as caught:
        _transport(key_file=key, passphrase=Secret("wrong-pass"), known_hosts=tmp_path / "kh").run("true")
    assert "wrong-pass" not in str(caught.value) and "s3cret" not in str(caught.value)


def test_options_never_show_the_passphrase():
    options = SshOptions(passphrase=Secret("hunter2"))
    assert "hunter2" not in repr(options) and "hunter2" not in f"{options.passphrase} {options}"


def test_broken_known_hosts_file_is_a_host_key_error(tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("10.0.0.1 ssh-ed25519 not-base64!!\n")
    with pytest.raises(HostKeyError, match="cannot read known_hosts file"):
        _transport(known_hosts=known).run("true")
