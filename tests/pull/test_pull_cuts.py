"""A flaky link under pull: a 20 MB patch through a proxy that drops the connection every 2.8 MB
arrives after 5 cuts, resumed with HTTP Range, with at most 1.1x its size sent in total (counted
at the proxy), and is used only once its signed length and hash match."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from tuf.api.metadata import TargetFile

from deployer.agent.ota.fetch import PullFetcher
from deployer.agent.ota.poll import Channel
from deployer.errors import IntegrityError
from tests.pull.nginx import Nginx
from tests.transport.proxy import CuttingProxy

SIZE = 20 * 1024 * 1024
CUTS = 5
BASE = "ab" * 32  # the installed artifact's sha256 the patch applies to


def _publish_patch(nginx: Nginx, data: bytes) -> TargetFile:
    """Serve `data` where a channel serves a patch target, and its signed TUF entry."""
    digest = hashlib.sha256(data).hexdigest()
    served = nginx.root / "stable/targets/patch" / BASE / f"{digest}.delta.patch"
    served.parent.mkdir(parents=True)
    served.write_bytes(data)
    return TargetFile(len(data), {"sha256": digest}, f"patch/{BASE}/delta.patch")


def _channel(tmp_path: Path, url: str) -> Channel:
    fetcher = PullFetcher(timeout_s=5, budget=4 * SIZE, max_resumes=CUTS)
    return Channel(url, tmp_path / "metadata", tmp_path / "downloads", fetcher)


def test_a_20mb_patch_arrives_through_5_cuts_sending_at_most_1_1x(tmp_path: Path, nginx: Nginx) -> None:
    data = os.urandom(SIZE)
    info = _publish_patch(nginx, data)
    proxy = CuttingProxy(
        ("127.0.0.1", nginx.port), cut_after=SIZE * 7 // 10 // CUTS, cuts=CUTS, direction="down"
    )
    try:
        channel = _channel(tmp_path, f"http://127.0.0.1:{proxy.port}/stable")
        path = channel.download(info)
    finally:
        proxy.close()
    print(
        f"\n[pull cuts] {proxy.cuts_made} cuts, {proxy.connections} connections, {proxy.total} bytes "
        f"for {SIZE} ({proxy.total / SIZE:.4f}x)"
    )
    assert proxy.cuts_made == CUTS and proxy.connections == CUTS + 1
    assert path.read_bytes() == data
    assert proxy.total <= 1.1 * SIZE
    assert [status for _, status, _ in nginx.requests()] == [200] + [206] * CUTS  # resumed, never restarted


def test_a_partial_file_with_foreign_bytes_is_rejected_not_trusted(tmp_path: Path, nginx: Nginx) -> None:
    data = os.urandom(256 * 1024)
    info = _publish_patch(nginx, data)
    channel = _channel(tmp_path, f"{nginx.url}/stable")
    part = tmp_path / "downloads" / info.hashes["sha256"] / "delta.patch.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"\0" * 1000)  # left on disk by an earlier poll, but not the signed file's bytes
    with pytest.raises(IntegrityError):
        channel.download(info)
    assert not part.exists()  # deleted: the next poll starts afresh instead of resuming it forever
    assert channel.download(info).read_bytes() == data
