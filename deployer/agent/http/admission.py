"""What admission control answers when a request cannot run now: the scheduler (deployer.agent.scheduler)
bounds its batch and its waiting queue and raises these; the HTTP layer maps them to 429 and 503, each
with a Retry-After header.
"""

from __future__ import annotations

__all__ = ["Overloaded", "QueueTimeout"]


class Overloaded(Exception):
    """Every batch slot and every queue place is taken (HTTP 429 + Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueTimeout(Exception):
    """A request waited in the queue longer than the request timeout (HTTP 503 + Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
