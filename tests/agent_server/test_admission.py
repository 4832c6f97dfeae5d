"""Admission control: bounded running slots, a bounded queue, rejection beyond it."""

import threading

import pytest

from deployer.agent.http.admission import Admission, Overloaded, QueueTimeout


def _hold(admission, entered, release):
    with admission.slot(timeout_s=30):
        entered.set()
        release.wait(30)


def test_queue_then_overload_then_drain():
    seen = []
    admission = Admission(1, 1, on_change=lambda running, waiting: seen.append((running, waiting)))
    entered, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold, args=(admission, entered, release))
    holder.start()
    assert entered.wait(30)
    queued = threading.Event()

    def queue_one():
        with admission.slot(timeout_s=30):
            queued.set()

    waiter = threading.Thread(target=queue_one)
    waiter.start()
    for _ in range(3000):  # until the second request is queued
        if admission.counts().waiting:
            break
        threading.Event().wait(0.01)
    with pytest.raises(Overloaded), admission.slot(timeout_s=30):
        pass
    release.set()
    holder.join(30)
    waiter.join(30)
    assert queued.is_set()
    assert (admission.counts().running, admission.counts().waiting) == (0, 0)
    assert (1, 1) in seen


def test_queue_timeout():
    admission = Admission(1, 4)
    entered, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold, args=(admission, entered, release))
    holder.start()
    assert entered.wait(30)
    with pytest.raises(QueueTimeout), admission.slot(timeout_s=0.05):
        pass
    assert admission.counts().waiting == 0
    release.set()
    holder.join(30)


def test_no_queue_rejects_at_once():
    admission = Admission(1, 0)
    with admission.slot(timeout_s=1), pytest.raises(Overloaded), admission.slot(timeout_s=1):
        pass
    with admission.slot(timeout_s=1):
        assert admission.counts().running == 1
