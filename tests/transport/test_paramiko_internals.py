"""deployer/transport/ssh.py bounds what a cut loses by draining paramiko's pending SFTP writes
itself (`SFTPFile._reqs`, `SFTPClient._read_response`): neither is public API, so pyproject caps
paramiko below the next major, and this test names what is missing if an upgrade removes them."""

from __future__ import annotations

import inspect
from importlib.metadata import version

import paramiko


def test_paramiko_still_has_the_internals_the_paced_writer_uses():
    missing = []
    if not callable(getattr(paramiko.SFTPClient, "_read_response", None)):
        missing.append("SFTPClient._read_response")
    if "self._reqs" not in inspect.getsource(paramiko.SFTPFile):
        missing.append("SFTPFile._reqs")
    if not hasattr(paramiko.SFTPFile, "MAX_REQUEST_SIZE"):
        missing.append("SFTPFile.MAX_REQUEST_SIZE")
    assert not missing, f"paramiko {version('paramiko')} lacks {', '.join(missing)} (transport/ssh.py)"
