"""The engine lock is granted in arrival order, and a stream closed before its first token frees it."""

import threading
import time

from deployer.agent.engines.base import TokenEvent
from deployer.agent.slot import FairLock, LockedStream


def _wait_until(predicate):
    for _ in range(3000):
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError("condition never held")


def test_waiters_get_the_lock_in_arrival_order():
    lock = FairLock()
    order = []
    lock.acquire()

    def take(i):
        with lock:
            order.append(i)

    threads = []
    for i in range(6):
        thread = threading.Thread(target=take, args=(i,))
        thread.start()
        threads.append(thread)
        _wait_until(lambda n=i + 1: lock.waiting == n)  # thread i is queued before i+1 starts
    lock.release()
    for thread in threads:
        thread.join(30)
    assert order == list(range(6))


def test_a_waiter_that_gives_up_leaves_the_line():
    lock = FairLock()
    lock.acquire()
    assert not lock.acquire(timeout=0.01)
    assert lock.waiting == 0
    got = []
    thread = threading.Thread(target=lambda: got.append(lock.acquire(timeout=30)))
    thread.start()
    _wait_until(lambda: lock.waiting == 1)
    lock.release()
    thread.join(30)
    assert got == [True]


def test_closing_an_unstarted_stream_releases_the_lock():
    lock = FairLock()
    lock.acquire()
    stream = LockedStream((TokenEvent(i, "a") for i in range(3)), lock)
    stream.close()
    stream.close()  # idempotent: released once
    assert lock.acquire(timeout=0)
    lock.release()


def test_an_exhausted_stream_releases_the_lock_once():
    lock = FairLock()
    lock.acquire()
    stream = LockedStream(iter([TokenEvent(1, "a", "stop")]), lock)
    assert [e.text for e in stream] == ["a"]
    stream.close()
    assert lock.acquire(timeout=0)
    assert not lock.acquire(timeout=0)
