"""Children that a test stops with Ctrl-C (SIGINT) as a user would."""

from __future__ import annotations

import signal


def default_sigint() -> None:
    """`preexec_fn` for such a child: SIGINT back to its default. A shell that starts a command in
    the background (`nohup ... &`, a CI runner's job) leaves SIGINT ignored, the ignore is
    inherited, and Python then installs no KeyboardInterrupt handler: the Ctrl-C would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
