"""Transport tests: the lab fixtures (tests/lab/fixtures.py) plus a wire-cutting proxy into the hub."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.lab.lab import Lab
from tests.lab.netns import require_hub_for
from tests.transport.proxy import CuttingProxy


@pytest.fixture
def proxy_to(hub: Lab) -> Iterator[Callable[..., CuttingProxy]]:
    """Factory: proxy_to(host, port=22, cut_after=None, cuts=1) -> a CuttingProxy on 127.0.0.1 inside
    the hub."""
    proxies: list[CuttingProxy] = []

    def make(host: str, port: int = 22, cut_after: int | None = None, cuts: int = 1) -> CuttingProxy:
        require_hub_for(host)  # raises unless this thread is in the hub
        proxy = CuttingProxy((host, port), cut_after=cut_after, cuts=cuts)
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        proxy.close()
