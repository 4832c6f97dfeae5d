"""Bounded parallelism over devices (`--parallel N`): one job per device, at most N at a time.

A job's SitsError is that device's result, not the fleet's: it is recorded and the others go on.
Any other exception is a bug; it propagates once the running jobs have finished, and jobs not yet
started are cancelled (as they are on Ctrl-C).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Generic, TypeVar

from deployer.errors import ConfigError, SitsError

__all__ = ["Outcome", "run_bounded"]

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Outcome(Generic[T, R]):
    """One item's result, or the error it failed with."""

    item: T
    result: R | None = None
    error: SitsError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def run_bounded(
    items: Iterable[T],
    job: Callable[[T], R],
    *,
    parallel: int,
    on_done: Callable[[Outcome[T, R]], None] | None = None,
) -> list[Outcome[T, R]]:
    """Run `job` on every item with at most `parallel` running at once; outcomes in input order.

    `on_done` is called from the worker thread as each item finishes (for live progress).
    Raises ConfigError when `parallel` is below 1.
    """
    if parallel < 1:
        raise ConfigError(f"--parallel must be at least 1, not {parallel}")
    work = list(items)

    def guarded(item: T) -> Outcome[T, R]:
        try:
            outcome: Outcome[T, R] = Outcome(item, result=job(item))
        except SitsError as exc:
            outcome = Outcome(item, error=exc)
        if on_done:
            on_done(outcome)
        return outcome

    with ThreadPoolExecutor(max_workers=min(parallel, max(1, len(work))), thread_name_prefix="sits") as pool:
        futures: list[Future[Outcome[T, R]]] = [pool.submit(guarded, item) for item in work]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
        finally:
            # On a bug or Ctrl-C, jobs that have not started never start.
            pool.shutdown(wait=True, cancel_futures=True)
    for future in futures:
        error = None if future.cancelled() else future.exception()
        if error is not None:
            raise error  # a bug in a job, not a device failure
    return [future.result() for future in futures]
