"""systemd integration without libsystemd: sd_notify over $NOTIFY_SOCKET, watchdog pings, and one
structured journal line per lifecycle event.

With `Type=notify`, systemd waits for READY=1 before it calls the service started, shows STATUS=
in `systemctl status`, restarts the service when WATCHDOG=1 pings stop for longer than WatchdogSec=,
and during `systemctl reload` expects RELOADING=1 and then READY=1 again. Outside systemd
($NOTIFY_SOCKET unset) every call is a no-op, so tests and `sits-agent serve` in a shell behave alike.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import ClassVar

from deployer.core.redact import RedactingFilter

__all__ = ["Notifier", "Watchdog", "configure_journal_logging", "lifecycle_event", "watchdog_interval_s"]

_log = logging.getLogger("sits.agent")


class Notifier:
    """Sends sd_notify datagrams to the socket systemd named in $NOTIFY_SOCKET (if any)."""

    def __init__(self, socket_path: str | None = None) -> None:
        path = socket_path if socket_path is not None else os.environ.get("NOTIFY_SOCKET", "")
        # A leading '@' names a socket in the abstract namespace, spelled with a NUL byte.
        self._address = "\0" + path[1:] if path.startswith("@") else path
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Whether a notify socket was given."""
        return bool(self._address)

    def send(self, **fields: str | int) -> bool:
        """Send KEY=value lines, e.g. send(READY=1, STATUS="serving 1.2.0"). False if nothing was sent."""
        if not self.enabled:
            return False
        payload = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        with self._lock, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            try:
                sock.sendto(payload, self._address)
            except OSError as exc:
                # Losing a status line must never take the server down; the journal says why.
                _log.warning("sd_notify to %s failed: %s", self._address, exc)
                return False
        return True

    def ready(self, status: str) -> bool:
        """The service is up (again, after a reload)."""
        return self.send(READY=1, STATUS=status)

    def reloading(self, status: str) -> bool:
        """A reload began; systemd expects READY=1 when it ends. MONOTONIC_USEC is required by
        systemd >= 253 for Type=notify-reload and harmless before it."""
        return self.send(
            RELOADING=1, STATUS=status, MONOTONIC_USEC=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        )

    def stopping(self, status: str) -> bool:
        """The service is shutting down."""
        return self.send(STOPPING=1, STATUS=status)

    def status(self, status: str) -> bool:
        """Update the one-line status shown by `systemctl status`."""
        return self.send(STATUS=status)


class Watchdog:
    """Pings WATCHDOG=1 at half of $WATCHDOG_USEC from a daemon thread, while `healthy()` holds.

    When `healthy()` turns false (the server loop is stuck), the pings stop and systemd restarts us.
    """

    def __init__(
        self,
        notifier: Notifier,
        healthy: Callable[[], bool] | None = None,
        interval_s: float | None = None,
    ) -> None:
        self._notifier = notifier
        self._healthy = healthy or (lambda: True)
        self.interval_s = interval_s if interval_s is not None else watchdog_interval_s()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pings = 0

    def start(self) -> bool:
        """Start pinging if systemd asked for a watchdog; False if it did not."""
        if self.interval_s is None or not self._notifier.enabled:
            return False
        self._thread = threading.Thread(target=self._run, name="sits-watchdog", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        """Stop pinging and wait for the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._healthy() and self._notifier.send(WATCHDOG=1):
                self.pings += 1


def watchdog_interval_s() -> float | None:
    """Half of $WATCHDOG_USEC in seconds, or None when systemd set no watchdog for this process."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2 / 1_000_000


def lifecycle_event(event: str, *, version: str | None, reason: str, **fields: object) -> dict:
    """Log one structured journal line (JSON after a fixed prefix) and return what was logged.

    journald stores stderr lines as MESSAGE; a fixed `sits-agent event` prefix lets
    `journalctl -u sits-agent | grep 'sits-agent event'` pick them out, and the JSON is parseable.
    """
    record = {"event": event, "version": version, "reason": reason, **fields}
    _log.info("sits-agent event %s", json.dumps(record, sort_keys=True, default=str))
    return record


def configure_journal_logging(level: int = logging.INFO) -> None:
    """Send the agent's log lines to stderr (journald captures them) with a syslog priority prefix."""
    handler = logging.StreamHandler()
    # "<6>" etc. are sd-daemon priority prefixes: journald turns them into the PRIORITY field.
    handler.setFormatter(_PriorityFormatter("%(message)s"))
    handler.addFilter(RedactingFilter())  # no Secret the agent holds reaches the journal
    _log.addHandler(handler)
    _log.setLevel(level)
    _log.propagate = False


class _PriorityFormatter(logging.Formatter):
    _PRIORITIES: ClassVar[dict[int, int]] = {
        logging.DEBUG: 7,
        logging.INFO: 6,
        logging.WARNING: 4,
        logging.ERROR: 3,
        logging.CRITICAL: 2,
    }

    def format(self, record: logging.LogRecord) -> str:
        return f"<{self._PRIORITIES.get(record.levelno, 6)}>{super().format(record)}"
