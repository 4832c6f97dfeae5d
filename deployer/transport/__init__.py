"""Talking to devices: one small interface (run, put, get, close) over SSH or on this machine.

`SshTransport` lives in `deployer.transport.ssh` and is imported from there, so that code which only
needs the local transport never imports paramiko.
"""

from deployer.transport.base import PutResult, RetryPolicy, RunResult, Transport
from deployer.transport.local import LocalTransport
from deployer.transport.pool import Outcome, run_bounded

__all__ = ["LocalTransport", "Outcome", "PutResult", "RetryPolicy", "RunResult", "Transport", "run_bounded"]
