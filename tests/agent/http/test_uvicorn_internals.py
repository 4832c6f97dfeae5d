"""deployer/agent/http/protocol.py subclasses uvicorn's internal H11Protocol (uvicorn has no public
hook for a header deadline or a connection cap), so agent/pyproject.toml pins the uvicorn range it
was tested against. This test names what the subclass reads and overrides, so a uvicorn that drops or
renames one fails here, by name, instead of as a broken connection limit on a device."""

from __future__ import annotations

import asyncio
import importlib.metadata
import socket

import uvicorn
from starlette.responses import PlainTextResponse
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

OVERRIDDEN = (
    "connection_made",
    "connection_lost",
    "data_received",
    "handle_events",
    "on_response_complete",
    "send_400_response",
)
ATTRIBUTES = ("cycle", "connections", "loop", "transport")  # set by H11Protocol itself
CYCLE_ATTRIBUTES = ("response_complete",)


async def _served_once() -> H11Protocol:
    """uvicorn's own protocol after answering one request over a socket pair (no network)."""
    config = uvicorn.Config(app=PlainTextResponse("ok"), log_level="warning")
    config.load()
    protocol = H11Protocol(config=config, server_state=ServerState(), app_state={})
    ours, theirs = socket.socketpair()
    await asyncio.get_running_loop().connect_accepted_socket(lambda: protocol, ours)
    reader, writer = await asyncio.open_connection(sock=theirs)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
    writer.close()
    await writer.wait_closed()
    protocol.transport.close()
    return protocol


def test_uvicorn_has_the_internals_the_connection_limits_subclass():
    protocol = asyncio.run(_served_once())
    missing = [
        f"H11Protocol.{name}()" for name in OVERRIDDEN if not callable(getattr(H11Protocol, name, None))
    ]
    missing += [f"H11Protocol.{name}" for name in ATTRIBUTES if not hasattr(protocol, name)]
    cycle = getattr(protocol, "cycle", None)
    missing += [f"RequestResponseCycle.{name}" for name in CYCLE_ATTRIBUTES if not hasattr(cycle, name)]
    assert not missing, (
        f"uvicorn {importlib.metadata.version('uvicorn')} lacks {', '.join(missing)}, which "
        "deployer/agent/http/protocol.py's _GuardedH11 uses: port the subclass to this uvicorn (and run "
        "tests/agent/http/test_http_faults.py), then widen the uvicorn pin in agent/pyproject.toml"
    )
