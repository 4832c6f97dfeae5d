"""The SSH transport against real sshd in booted lab devices (run inside the hub namespace)."""

from __future__ import annotations

import base64
import os
import subprocess
import time
from pathlib import Path

import paramiko
import pytest

from deployer.errors import HostKeyError, RefusedError, TransportError
from deployer.transport.base import RetryPolicy
from deployer.transport.hostkeys import fingerprint
from deployer.transport.pool import run_bounded
from tests.lab.lab import _stale_reason
from tests.lab.netns import require_hub_for
from tests.lab.proc import LabError

pytestmark = pytest.mark.lab

STAGING = "/var/lib/sits/staging"


def _fingerprint_of(key_type: str, key_b64: str) -> str:
    return fingerprint(paramiko.PKey.from_type_string(key_type, base64.b64decode(key_b64)))


def test_run_returns_exit_code_and_both_streams(hub, ssh_to):
    result = ssh_to(hub.device(1).address).run("hostname; echo oops >&2; exit 3")
    assert (result.rc, result.stdout, result.stderr) == (3, "dev1\n", "oops\n")


def test_stream_passes_both_streams_on_and_returns_the_exit_status(hub, ssh_to):
    seen: list[str] = []
    rc = ssh_to(hub.device(1).address).stream("hostname; echo oops >&2; exit 3", seen.append)
    assert (rc, "".join(seen)) == (3, "dev1\noops\n")


def test_run_quotes_an_argv_and_reuses_the_connection(hub, ssh_to, proxy_to, host_key_line, tmp_path):
    proxy = proxy_to(hub.device(1).address)
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{proxy.port} {' '.join(host_key_line(1))}\n")
    transport = ssh_to("127.0.0.1", port=proxy.port, known_hosts=known)
    first = transport.run(["printf", "%s|", "a b", "$HOME", "it's"])
    second = transport.run(["true"])
    assert first.stdout == "a b|$HOME|it's|"
    assert second.ok and proxy.connections == 1  # one TCP connection for both commands


def test_command_past_its_timeout_raises_transport_error(hub, ssh_to):
    with pytest.raises(TransportError, match=r"did not finish within 0\.5 s"):
        ssh_to(hub.device(1).address).run("sleep 30", timeout=0.5)


def test_put_and_get_round_trip_is_verified_on_the_device(hub, ssh_to, tmp_path):
    data = os.urandom(3 * 1024 * 1024 + 17)
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    transport = ssh_to(hub.device(2).address)

    put = transport.put(src, f"{STAGING}/blob.bin")
    on_device = hub.nsenter(2, ["sha256sum", f"{STAGING}/blob.bin"]).split()[0]
    digest = transport.get(f"{STAGING}/blob.bin", tmp_path / "back.bin")

    assert put.sha256 == on_device == digest
    assert (put.bytes_sent, put.resumed_from, put.unchanged) == (len(data), 0, False)
    assert (tmp_path / "back.bin").read_bytes() == data
    assert transport.run(["test", "-e", f"{STAGING}/blob.bin.part"]).rc == 1


def test_second_put_of_the_same_content_sends_nothing(hub, ssh_to, tmp_path):
    src = tmp_path / "same.bin"
    src.write_bytes(os.urandom(100_000))
    transport = ssh_to(hub.device(2).address)
    transport.put(src, f"{STAGING}/same.bin")
    again = transport.put(src, f"{STAGING}/same.bin")
    assert again.unchanged and again.bytes_sent == 0


def test_changed_host_key_is_refused_with_its_fingerprint(hub, ssh_to, host_key_line, tmp_path):
    # known_hosts claims dev2's address has dev1's key: exactly what a swapped or spoofed device looks like.
    known = tmp_path / "known_hosts"
    known.write_text(f"{hub.device(2).address} {' '.join(host_key_line(1))}\n")
    offered = _fingerprint_of(*host_key_line(2))
    for tofu in (False, True):  # trust on first use never covers a changed key
        with pytest.raises(HostKeyError, match="CHANGED") as caught:
            ssh_to(hub.device(2).address, known_hosts=known, trust_on_first_use=tofu).run("true")
        assert offered in str(caught.value)
        assert _fingerprint_of(*host_key_line(1)) in str(caught.value)


def test_unknown_host_is_refused_without_trust_on_first_use(hub, ssh_to, host_key_line, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("")
    with pytest.raises(HostKeyError, match="unknown host key") as caught:
        ssh_to(hub.device(3).address, known_hosts=known).run("true")
    assert _fingerprint_of(*host_key_line(3)) in str(caught.value)
    assert known.read_text() == ""


def test_trust_on_first_use_records_the_key_for_later_strict_use(hub, ssh_to, host_key_line, tmp_path):
    known = tmp_path / "sub" / "known_hosts"
    assert ssh_to(hub.device(3).address, known_hosts=known, trust_on_first_use=True).run("true").ok
    assert known.read_text() == f"{hub.device(3).address} {' '.join(host_key_line(3))}\n"
    assert ssh_to(hub.device(3).address, known_hosts=known).run("hostname").stdout == "dev3\n"


def test_wrong_client_key_fails_authentication_without_retrying(hub, ssh_to, tmp_path):
    key = tmp_path / "other_key"
    paramiko.ECDSAKey.generate().write_private_key_file(str(key))  # a key no device authorizes
    with pytest.raises(RefusedError, match="authentication as 'root' failed"):
        ssh_to(hub.device(1).address, key_file=key).run("true")


def test_dropped_upload_resumes_without_resending_completed_bytes(
    hub, ssh_to, proxy_to, host_key_line, tmp_path
):
    size = 8 * 1024 * 1024
    src = tmp_path / "model.bin"
    src.write_bytes(os.urandom(size))
    proxy = proxy_to(hub.device(1).address, cut_after=3 * 1024 * 1024)
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{proxy.port} {' '.join(host_key_line(1))}\n")
    transport = ssh_to("127.0.0.1", port=proxy.port, known_hosts=known)

    result = transport.put(src, f"{STAGING}/model.bin")

    first, second = proxy.counted  # the cut connection, then the one that resumed
    # Bytes in flight when the link died are lost; the bytes already on the device's disk are kept...
    assert 1024 * 1024 < result.resumed_from <= first
    # ...and the resumed connection carries only the rest (plus 256 KiB for SSH handshake and framing).
    assert second < size - result.resumed_from + 256 * 1024
    assert hub.nsenter(1, ["sha256sum", f"{STAGING}/model.bin"]).split()[0] == result.sha256


def test_partial_upload_with_foreign_bytes_starts_over(hub, ssh_to, tmp_path):
    src = tmp_path / "fresh.bin"
    src.write_bytes(os.urandom(300_000))
    transport = ssh_to(hub.device(3).address)
    transport.run(["mkdir", "-p", STAGING]).check("mkdir")
    transport.run(f"head -c 100000 /dev/zero > {STAGING}/fresh.bin.part").check("write partial")
    result = transport.put(src, f"{STAGING}/fresh.bin")
    assert (result.resumed_from, result.bytes_sent) == (0, 300_000)


def test_offline_device_gives_a_clear_error_within_the_timeout(hub, ssh_to):
    hub.unplug(3)
    try:
        transport = ssh_to(hub.device(3).address, connect_timeout_s=1.5, retry=RetryPolicy(2, 0.1, 0.2))
        started = time.monotonic()
        with pytest.raises(TransportError, match="cannot connect after 2 attempts") as caught:
            transport.run("true")
        elapsed = time.monotonic() - started
    finally:
        hub.plug(3)
    assert not isinstance(caught.value, HostKeyError)
    assert hub.device(3).address in str(caught.value)
    assert elapsed < 2 * 1.5 + 0.2 + 5  # the timeouts are honoured (generous margin for a busy CI machine)


def test_pool_reaches_every_device_with_bounded_parallelism(hub, ssh_to):
    transports = [ssh_to(device.address) for device in hub.devices]
    outcomes = run_bounded(transports, lambda t: t.run("hostname").stdout.strip(), parallel=2)
    assert [o.result for o in outcomes] == [device.name for device in hub.devices]


def test_a_lab_address_is_refused_outside_the_hub(lab):
    with pytest.raises(LabError, match="outside the hub namespace"):
        require_hub_for(lab.device(1).address)
    require_hub_for("127.0.0.1")  # loopback is fine anywhere


def test_the_guard_route_makes_lab_addresses_unroutable_from_the_root_namespace(lab):
    # Asks the routing table only; no packet is sent.
    route = subprocess.run(["ip", "route", "get", lab.device(1).address], capture_output=True, text=True)
    assert route.returncode != 0 and "No route to host" in route.stderr


def test_known_hosts_file_lists_every_device_key(lab, host_key_line):
    lines = Path(lab.known_hosts).read_text().splitlines()
    assert lines == [f"{d.address} {' '.join(host_key_line(d.index))}" for d in lab.devices]


def test_a_lab_whose_owner_died_or_whose_time_is_up_counts_as_stale():
    # What `up` and the reaper decide on; a dead owner is one whose pid we waited for ourselves.
    gone = subprocess.Popen(["true"])
    gone.wait()
    later = time.time() + 60
    assert _stale_reason({"deadline": later, "owner_pid": gone.pid}) == f"owner pid {gone.pid} is gone"
    assert _stale_reason({"deadline": time.time() - 1, "owner_pid": os.getpid()}) == "time is up"
    assert _stale_reason({"deadline": later, "owner_pid": os.getpid()}) == ""
