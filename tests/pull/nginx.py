"""nginx from Debian on a free port (loopback by default), with a generated config, serving one directory.

Used by the pull-mode tests and by bench/pull.py. The access log records each request's path,
status and body bytes, so callers can see exactly what a poll cost on the wire.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.ports import reserved_port

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
_CONF = """\
{user}
daemon off;
worker_processes 1;
pid {run}/nginx.pid;
error_log {run}/error.log warn;
events {{ worker_connections {connections}; }}
http {{
    log_format sits '$request_uri $status $body_bytes_sent $bytes_sent';
    access_log {run}/access.log sits;
    client_body_temp_path {run}/body;
    proxy_temp_path {run}/proxy;
    fastcgi_temp_path {run}/fastcgi;
    uwsgi_temp_path {run}/uwsgi;
    scgi_temp_path {run}/scgi;
    types {{ application/json json; }}
    default_type application/octet-stream;
    keepalive_requests 100000;
    server {{
        listen {host}:{port};
        root {root};
        location / {{ }}
    }}
}}
"""


@dataclass
class Nginx:
    """A running nginx; `url` serves `root`."""

    root: Path
    port: int
    log: Path
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def requests(self) -> list[tuple[str, int, int]]:
        """(path, status, body bytes) of every request served so far."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [(p, int(s), int(b)) for p, s, b, _ in (line.split() for line in lines)]

    def bytes_sent(self) -> int:
        """Bytes sent on the wire so far, headers included."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return sum(int(line.split()[3]) for line in lines)

    def clear_log(self) -> None:
        """Forget the requests so far (nginx keeps appending to the same open file)."""
        self.log.write_text("")


def start_nginx(
    root: Path, run: Path, *, connections: int = 512, host: str = "127.0.0.1"
) -> tuple[subprocess.Popen, Nginx]:
    """Start nginx serving `root` on a free port of `host` (loopback, or the lab hub's bridge address
    from inside the hub); wait until it accepts connections."""
    if not Path(NGINX).exists():
        raise FileNotFoundError("nginx is not installed (apt-get install -y nginx)")
    run.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    port = reserved_port(host)
    user = "user root;" if os.geteuid() == 0 else ""  # workers must read files under the tmp dirs
    conf = run / "nginx.conf"
    conf.write_text(
        _CONF.format(user=user, run=run, host=host, port=port, root=root, connections=connections)
    )
    proc = subprocess.Popen([NGINX, "-c", str(conf), "-p", str(run)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return proc, Nginx(root, port, run / "access.log", host)
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"nginx exited: {proc.stderr.read().decode() if proc.stderr else ''}"
                ) from None
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("nginx did not start listening within 10 s")


def stop_nginx(proc: subprocess.Popen) -> None:
    """Stop nginx (SIGTERM to the master we started; it ends its worker) and reap it."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
