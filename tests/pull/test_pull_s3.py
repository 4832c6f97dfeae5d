"""Publishing to S3: moto's server (system python, loopback only) stands in for the bucket; a device
then polls the objects over plain HTTP, as it would through a CDN in front of the bucket."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deployer.errors import TransportError
from tests.ports import reserved_port
from tests.pull.project import Project, make_device

boto3 = pytest.importorskip("boto3")
# moto runs as its own server process, from this same environment.
MOTO_PYTHON = sys.executable


def _moto_available() -> bool:
    probe = subprocess.run(
        [MOTO_PYTHON, "-c", "import moto.server"], capture_output=True, timeout=60, check=False
    )
    return probe.returncode == 0


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A moto S3 server on a free loopback port; its endpoint URL. Dummy credentials only."""
    if not _moto_available():
        pytest.skip("moto's server mode is not installed (pip install 'moto[server]')")
    port = reserved_port()
    proc = subprocess.Popen(
        [MOTO_PYTHON, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "SITS_S3_ENDPOINT_URL": endpoint,
    }.items():
        monkeypatch.setenv(name, value)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("moto server did not start")
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_publish_to_s3_then_device_pulls_from_the_bucket(tmp_path: Path, project: Project, s3: str) -> None:
    client = boto3.client("s3", endpoint_url=s3)
    client.create_bucket(Bucket="fleet")
    result = project.publish("s3://fleet/sits", "1.0.0")
    assert result.uploaded > 0
    keys = {o["Key"] for o in client.list_objects_v2(Bucket="fleet")["Contents"]}
    assert "sits/stable/metadata/timestamp.json" in keys
    cache = client.head_object(Bucket="fleet", Key="sits/stable/metadata/timestamp.json")["CacheControl"]
    assert cache == "max-age=60"
    again = project.publish("s3://fleet/sits", "1.0.0")
    assert not again.changed and again.uploaded < result.uploaded  # targets are not re-sent

    device = make_device(tmp_path / "d1", project, f"{s3}/fleet/sits/stable/")
    with pytest.raises(TransportError, match="HTTP 403"):  # a private bucket: refused, clearly
        device.poll()
    public_read = {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Principal": "*",
                "Action": "s3:GetObject",
                "Resource": "arn:aws:s3:::fleet/*",
            }
        ],
    }
    client.put_bucket_policy(Bucket="fleet", Policy=json.dumps(public_read))
    assert device.poll(force=True).result == "updated" and device.store.current_version() == "1.0.0"


def test_missing_bucket_is_a_clear_error(project: Project, s3: str) -> None:
    with pytest.raises(TransportError) as info:
        project.publish("s3://no-such-bucket/sits", "1.0.0")
    assert "no-such-bucket" in info.value.message and "permission" in (info.value.hint or "")
