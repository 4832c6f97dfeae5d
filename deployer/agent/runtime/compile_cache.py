"""Where torch keeps what it compiles: under the agent's store, so that a restart reuses it.

inductor's on-disk cache defaults to /tmp/torchinductor_$USER and Triton's to ~/.triton. The
agent's unit runs with PrivateTmp=yes (a fresh /tmp each start, removed at stop), ProtectHome=yes
and only /var/lib/sits writable (templates/_sandbox.conf.j2): a CPU device with `compile: on`
would build its decode step from scratch (minutes) on every restart, and on a GPU device Triton
could write only while the service user's home happens to be the store (bootstrap's `useradd`
makes it so; a user made otherwise may have one under /home, which ProtectHome hides). Our own
int4 CPU kernel (engines/torch/native.py) is built once per machine the same way. So the agent points
all three at `<root>/var/lib/sits/cache/{inductor,triton,kernels}` before an engine loads.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from deployer.core.kernel_cache import KERNEL_CACHE_VARIABLE

__all__ = ["CACHE_VARIABLES", "use_store_caches"]

# The environment variable of each cache and its directory under <store>/cache.
CACHE_VARIABLES = {
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    KERNEL_CACHE_VARIABLE: "kernels",  # our own CPU kernels (engines/torch/native.py)
}
_log = logging.getLogger("sits.agent")


def use_store_caches(state_dir: Path) -> dict[str, str]:
    """Point inductor's and Triton's caches at `<state_dir>/cache/<name>` unless their variable is
    set already (an operator's value wins); return each variable's value now.

    The directories are made like the store's own, with its mode minus write for group and others:
    they hold code the agent loads and runs. One that cannot be made is logged and its variable
    left unset: torch then uses its default, which costs time, not service.
    """
    for variable, name in CACHE_VARIABLES.items():
        if variable in os.environ:
            continue
        try:
            os.environ[variable] = str(_make_cache_dir(state_dir, name))
        except OSError as exc:
            _log.warning(
                "cannot make the %s cache under %s (%s); torch's default applies", name, state_dir, exc
            )
    return {variable: os.environ[variable] for variable in CACHE_VARIABLES if variable in os.environ}


def _make_cache_dir(state_dir: Path, name: str) -> Path:
    state_dir.mkdir(parents=True, exist_ok=True)
    mode = stat.S_IMODE(state_dir.stat().st_mode) & 0o755  # no write for group and others
    path = state_dir / "cache" / name
    for directory in (path.parent, path):
        directory.mkdir(mode=mode, exist_ok=True)  # the umask (0027 in the unit) still applies
    return path
