"""Ports for servers the tests start in another process and must name first (agents that `apply`
starts, nginx, moto): reserved for the rest of the test session, never picked and freed (see
deployer/demo/ports.py for why that races). A server a test starts in-process binds port 0."""

from __future__ import annotations

from deployer.demo.ports import PortReservation

# Held until the session ends: an agent a test leaves running keeps its port out of other hands.
_held: list[PortReservation] = []


def reserved_port(host: str = "127.0.0.1") -> int:
    """A port of `host` that nothing but the server it is written for can take."""
    reservation = PortReservation(host)
    _held.append(reservation)
    return reservation.port
