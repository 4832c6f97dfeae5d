"""HTTP for pull mode: python-tuf's fetcher interface over `requests`, with a byte budget, a time
budget, a request count, and resumable downloads (HTTP Range) that survive dropped connections and
later polls.

Reads are bounded: a metadata fetch by the length ngclient passes, a target download by the length
its signed TUF entry declares, and every read by the poll's deadline. A server that sends slowly
(a byte just inside the idle timeout, for ever: slow retrieval) cannot hold a poll: the body is
read one socket receive at a time (`read1`), each bounded by the idle timeout, and the deadline is
checked between them, so a poll ends at most one idle timeout past it. A rate cap (pull.yaml's
`max_rate`, from deploy.yaml's bandwidth) paces the reads: a receiver that reads slowly makes TCP
slow the sender down, as `curl --limit-rate` does. Nothing here decides what to trust; the caller
verifies hashes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import requests
from tuf.api.exceptions import DownloadHTTPError
from tuf.ngclient.fetcher import FetcherInterface
from urllib3.exceptions import ProtocolError, ReadTimeoutError

from deployer import __version__
from deployer.core.ratelimit import Throttle
from deployer.errors import FormatError, TransportError

__all__ = ["ByteBudgetExceeded", "DeadlineExceeded", "PullFetcher"]

CHUNK = 64 * 1024
_RETRYABLE = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)


class ByteBudgetExceeded(TransportError):
    """This poll may not download more; what arrived is kept and the next poll resumes it."""


class DeadlineExceeded(TransportError):
    """This poll's time to download is spent; what arrived is kept and the next poll resumes it."""


class PullFetcher(FetcherInterface):
    """One poll's HTTP client: counts requests and bytes, and refuses to go past `budget` bytes or
    past `deadline_s` seconds from its creation; `throttle` caps its rate. `clock` is a seam for
    tests."""

    def __init__(
        self,
        *,
        timeout_s: float,
        budget: int,
        deadline_s: float = float("inf"),
        max_resumes: int = 5,
        throttle: Throttle | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.session = requests.Session()
        self.session.headers["User-Agent"] = f"sits-agent/{__version__}"
        # The signed lengths and hashes are of the files as stored: no gzip on the way.
        self.session.headers["Accept-Encoding"] = "identity"
        self.timeout_s = timeout_s
        self.budget = budget
        self.deadline_s = deadline_s
        self.max_resumes = max_resumes
        self.throttle = throttle
        self.requests = 0
        self.bytes = 0
        self._clock = clock
        self._deadline = clock() + deadline_s

    def close(self) -> None:
        """Close the pooled connections."""
        self.session.close()

    # -- ngclient's interface (metadata) -------------------------------------------------------

    def _fetch(self, url: str) -> Iterator[bytes]:
        """Stream `url`; raises DownloadHTTPError on any status but 200 (ngclient treats 404 as
        'no newer root'). ngclient bounds the length it reads."""
        response = self._get(url, {})
        if response.status_code != 200:
            response.close()
            raise DownloadHTTPError(f"{url}: HTTP {response.status_code}", response.status_code)
        return self._chunks(response, url)

    # -- targets -------------------------------------------------------------------------------

    def download(self, url: str, part: Path, length: int) -> Path:
        """Download `url` into `part` (resuming what a dropped connection or an earlier poll left)
        until it holds `length` bytes; return `part`. The caller checks the hash.

        Raises ByteBudgetExceeded, TransportError (HTTP error, too many drops), FormatError (the
        server sends more than `length`).
        """
        part.parent.mkdir(parents=True, exist_ok=True)
        have = part.stat().st_size if part.exists() else 0
        if have > length:
            part.unlink()
            have = 0
        drops = 0
        while have < length:
            try:
                have = self._append(url, part, have, length)
            except _RETRYABLE as exc:
                drops += 1
                have = part.stat().st_size
                if drops > self.max_resumes:
                    raise TransportError(
                        f"{url}: the connection dropped {drops} times ({have} of {length} bytes so far): "
                        f"{type(exc).__name__}",
                        hint="the download resumes where it stopped at the next poll",
                    ) from exc
        return part

    def _append(self, url: str, part: Path, have: int, length: int) -> int:
        headers = {"Range": f"bytes={have}-"} if have else {}
        with self._get(url, headers) as response:
            if response.status_code == 416 or (have and response.status_code == 200):
                part.unlink(missing_ok=True)  # the server cannot or will not resume: start over
                have = 0
                if response.status_code == 416:
                    return have
            elif response.status_code not in (200, 206):
                raise TransportError(
                    f"{url}: HTTP {response.status_code}",
                    hint="check that the channel was published completely (targets before timestamp)",
                )
            with part.open("ab") as out:
                for chunk in self._chunks(response, url):
                    if have + len(chunk) > length:
                        raise FormatError(f"{url}: the server sent more than the signed {length} bytes")
                    out.write(chunk)
                    have += len(chunk)
        return have

    # -- shared --------------------------------------------------------------------------------

    def _get(self, url: str, headers: dict[str, str]) -> requests.Response:
        # Every socket operation of this request waits at most the idle timeout, and never past
        # the deadline by more than that.
        timeout = min(self.timeout_s, max(self._left(url), 0.001))
        self.requests += 1
        try:
            return self.session.get(url, headers=headers, stream=True, timeout=timeout)
        except _RETRYABLE:
            raise
        except requests.RequestException as exc:
            raise TransportError(f"{url}: {type(exc).__name__}: {exc}") from exc

    def _left(self, url: str) -> float:
        """Seconds until the deadline. Raises DeadlineExceeded when none are left."""
        left = self._deadline - self._clock()
        if left <= 0:
            raise DeadlineExceeded(
                f"{url}: this poll's download time of {self.deadline_s:g} s is spent "
                f"({self.bytes} bytes so far): the server sends too slowly or never finishes",
                hint="what arrived is kept and the next poll resumes it; raise max_download_s in "
                "pull.yaml for a slow link",
            )
        return left

    def _chunks(self, response: requests.Response, url: str) -> Iterator[bytes]:
        with response:
            while True:
                self._left(url)
                try:
                    # One socket receive at most (read() would wait for a whole CHUNK).
                    chunk = response.raw.read1(CHUNK, decode_content=False)
                except (ProtocolError, ReadTimeoutError) as exc:  # what iter_content maps, mapped alike
                    raise requests.ConnectionError(f"{url}: {exc}") from exc
                if not chunk:
                    return
                if self.bytes + len(chunk) > self.budget:
                    raise ByteBudgetExceeded(
                        f"{url}: this poll's byte budget of {self.budget} bytes is spent",
                        hint="the download resumes where it stopped at the next poll; raise "
                        "max_bytes_per_poll in pull.yaml for faster updates",
                    )
                self.bytes += len(chunk)
                if self.throttle is not None:
                    self.throttle.take(len(chunk))
                yield chunk
