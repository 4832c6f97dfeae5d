"""A published channel served to the device's own fetcher without a socket: a `requests` transport
adapter answers GETs under ORIGIN from the files under a directory, and is mounted on each
PullFetcher a poll makes.

Only nginx and the socket are replaced: the device's TUF client, Channel and PullFetcher (its
status handling, byte budget and deadline) run as they do against a real server. The adapter
answers 200 with the whole file or 404, as a static server that ignores Range may (HTTP allows it),
so tests of HTTP itself (resumes, dropped connections, slow or hostile servers) keep a real socket:
nginx (tests/pull/nginx.py) or tests/attacks/test_pull_slow_retrieval.py's server.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

import urllib3
from requests import PreparedRequest, Response
from requests.adapters import HTTPAdapter

from deployer.agent.ota.fetch import PullFetcher

# A loopback port nothing listens on: a poll that bypassed the adapter would fail at once, on this
# machine, instead of reaching some other server.
ORIGIN = "http://127.0.0.1:1"


@dataclass
class DirectMirror:
    """Serves `root` at ORIGIN to the fetchers `fetcher` makes, logging each request as
    (path, status, body bytes), like the access log of tests/pull/nginx.py."""

    root: Path
    log: list[tuple[str, int, int]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return ORIGIN

    def requests(self) -> list[tuple[str, int, int]]:
        """(path, status, body bytes) of every request served so far."""
        return list(self.log)

    def clear_log(self) -> None:
        """Forget the requests so far."""
        self.log.clear()

    def fetcher(self, **settings: object) -> PullFetcher:
        """A PullFetcher (built from `settings` as the poller builds it) whose requests to ORIGIN
        this mirror answers."""
        fetcher = PullFetcher(**settings)  # type: ignore[arg-type]
        fetcher.session.mount(f"{ORIGIN}/", _DirectoryAdapter(self))
        return fetcher


class _DirectoryAdapter(HTTPAdapter):
    """requests' adapter interface over a directory: no connection, the same Response objects."""

    def __init__(self, mirror: DirectMirror) -> None:
        super().__init__()
        self.mirror = mirror

    def send(self, request: PreparedRequest, *args: object, **kwargs: object) -> Response:
        path = unquote(urlsplit(request.url).path)
        file = (self.mirror.root / path.lstrip("/")).resolve()
        if request.method == "GET" and self.mirror.root.resolve() in file.parents and file.is_file():
            status, body = 200, file.read_bytes()
        else:
            status, body = 404, b""
        self.mirror.log.append((path, status, len(body)))
        raw = urllib3.HTTPResponse(
            body=io.BytesIO(body),
            headers={"Content-Length": str(len(body))},
            status=status,
            preload_content=False,
            decode_content=False,
            request_url=request.url,
        )
        return self.build_response(request, raw)
