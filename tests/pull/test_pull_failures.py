"""Bad networks: a dropped connection resumes with HTTP Range, a byte budget spreads a download over
polls, and an unreachable server or a 404 is recorded and retried with backoff."""

from __future__ import annotations

from pathlib import Path

import pytest

from deployer.agent.ota.fetch import ByteBudgetExceeded
from deployer.errors import TransportError
from tests.pull.direct import DirectMirror
from tests.pull.nginx import Nginx
from tests.pull.project import Project, make_device
from tests.transport.proxy import CuttingProxy


def _metadata_bytes(channel: Path) -> int:
    return sum(p.stat().st_size for p in (channel / "metadata").iterdir())


def test_dropped_connection_resumes_where_it_stopped(tmp_path: Path, project: Project, nginx: Nginx) -> None:
    project.publish(nginx.root, "1.0.0")
    channel = nginx.root / "stable"
    # Past the metadata (with headers), into the middle of the artifact's downloads.
    proxy = CuttingProxy(
        ("127.0.0.1", nginx.port), cut_after=_metadata_bytes(channel) + 80_000, direction="down"
    )
    try:
        device = make_device(tmp_path / "d1", project, f"http://127.0.0.1:{proxy.port}/stable/")
        outcome = device.poll()
    finally:
        proxy.close()
    assert proxy.cut and proxy.connections >= 2
    assert outcome.result == "updated" and device.store.current_version() == "1.0.0"
    assert any(status == 206 for _, status, _ in nginx.requests())  # resumed, not restarted


def test_byte_budget_spreads_a_download_over_polls(tmp_path: Path, project: Project, nginx: Nginx) -> None:
    project.publish(nginx.root, "1.0.0")
    device = make_device(tmp_path / "d1", project, f"{nginx.url}/stable/", max_bytes_per_poll=96 * 1024)
    polls = 0
    while device.store.current_version() is None:
        polls += 1
        assert polls < 50, "the download makes no progress"
        try:
            device.poll(force=True)
        except ByteBudgetExceeded:
            assert device.read_state().result == "failed"
    assert polls > 1 and device.read_state().result == "updated"
    resumed = [size for _, status, size in nginx.requests() if status == 206]
    assert resumed and all(size <= 96 * 1024 for size in resumed)


@pytest.mark.parametrize("where", ["closed port", "missing channel"])
def test_unreachable_or_missing_channel_is_retried_with_backoff(
    tmp_path: Path, project: Project, mirror: DirectMirror, where: str
) -> None:
    project.publish(mirror.root, "1.0.0")
    url = "http://127.0.0.1:9/stable/" if where == "closed port" else f"{mirror.url}/nosuch/"
    device = make_device(tmp_path / "d1", project, f"{mirror.url}/stable/")
    device = type(device)(device.store, device.updater, device.settings.model_copy(update={"url": url}))
    with pytest.raises(TransportError) as info:
        device.poll()
    assert ("404" in info.value.message) == (where == "missing channel")
    state = device.read_state()
    assert (state.result, state.failures) == ("failed", 1) and state.retry_after
    skipped = device.poll()  # inside the backoff window: nothing is fetched
    assert skipped.result == "skipped" and skipped.requests == 0 and "backing off" in skipped.detail
    with pytest.raises(TransportError):
        device.poll(force=True)
    assert device.read_state().failures == 2
