"""What the fallback's tests share: an upstream that misbehaves on purpose."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.agent.serving.hostile_upstream import HostileUpstream


@pytest.fixture
def hostile() -> Iterator[Callable[..., HostileUpstream]]:
    """`hostile(mode, **options)`: a HostileUpstream, closed at teardown."""
    servers: list[HostileUpstream] = []

    def make(mode: str, **options: object) -> HostileUpstream:
        servers.append(HostileUpstream(mode, **options))
        return servers[-1]

    yield make
    for server in servers:
        server.close()
