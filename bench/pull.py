"""Pull mode at fleet scale on loopback: many lightweight pollers (our Channel + PullFetcher, the code
`sits-agent poll` runs, without installing) against nginx serving a published channel.

Phases, each bounded in count or time:
  cold       every poller's first refresh (root check, timestamp, snapshot, targets)
  unchanged  pollers poll round-robin for --duration seconds; nothing changed on the channel
  baseline   plain GETs of timestamp.json for the same time: the server's ceiling with no TUF client
  update     v2 is published; every poller refreshes and downloads its patch (release + delta)
  full       a few pollers download the full artifact instead: what a patch saves

The model is the seeded tiny checkpoint (2 layers, int8, ~165 kB artifact): the bytes of metadata
and the request counts carry over to any model; patch and artifact bytes scale with the model
(see docs/pull-mode.md for the 100,000-device capacity model).

    PYTHONPATH=. .venv/bin/python bench/pull.py            # 1,000 pollers, 20 s unchanged phase
    PYTHONPATH=. .venv/bin/python bench/pull.py --quick    # 200 pollers, 5 s
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import requests
import torch
from rich.console import Console
from rich.table import Table

from deployer.agent.ota.fetch import PullFetcher
from deployer.agent.ota.poll import Channel
from deployer.build.demo_model import make_tiny_checkpoint
from tests.pull.nginx import Nginx, start_nginx, stop_nginx
from tests.pull.project import make_project


@dataclass
class Poller:
    """One simulated device: its trusted metadata, downloads dir and keep-alive HTTP client."""

    index: int
    base: Path
    fetcher: PullFetcher

    def channel(self, url: str) -> Channel:
        return Channel(url, self.base / "metadata", self.base / "downloads", self.fetcher)


@dataclass
class Phase:
    name: str
    polls: int
    requests: int
    bytes: int
    seconds: float
    note: str = ""


def main() -> None:
    args = _arguments()
    torch.set_num_threads(1)
    console = Console(width=130)
    with tempfile.TemporaryDirectory(prefix="sits-bench-pull-") as tmp:
        work = Path(tmp)
        sources = {
            "1.0.0": make_tiny_checkpoint(work / "src-1", seed=0),
            "2.0.0": make_tiny_checkpoint(work / "src-2", seed=1),
        }
        project = make_project(work / "project", sources)
        published = work / "published"
        first = project.publish(published, "1.0.0")
        proc, server = start_nginx(published, work / "nginx", connections=args.pollers * 2 + 64)
        try:
            phases = _run(args, project, server, work, first.artifact_sha256)
        finally:
            stop_nginx(proc)
    _print(console, args, phases)


def _run(args: argparse.Namespace, project, server: Nginx, work: Path, v1_sha: str) -> list[Phase]:
    url = f"{server.url}/stable/"
    anchor = project.root_metadata("stable")
    pollers = [
        Poller(i, work / "pollers" / str(i), PullFetcher(timeout_s=30, budget=1 << 40))
        for i in range(args.pollers)
    ]
    phases = []
    with ThreadPoolExecutor(args.threads) as pool:

        def cold(p: Poller) -> None:
            p.channel(url).refresh(anchor)

        phases.append(_measure("cold (first refresh)", pool, pollers, cold, server))

        def unchanged(p: Poller) -> None:
            channel = p.channel(url)
            channel.refresh(anchor)
            if channel.latest().custom["artifact_sha256"] != v1_sha:
                raise RuntimeError("the channel changed during the unchanged phase")

        phases.append(_measure("unchanged poll", pool, pollers, unchanged, server, duration=args.duration))
        phases.append(_baseline(pool, args, f"{url}metadata/timestamp.json", server))

        project.publish(server.root, "2.0.0")

        def update(p: Poller) -> None:
            channel = p.channel(url)
            channel.refresh(anchor)
            patch = channel.patch_from(v1_sha)
            if patch is None:
                raise RuntimeError("no patch from 1.0.0 was published")
            for info in patch:
                channel.download(info)

        phases.append(_measure("update via patch", pool, pollers, update, server))

        def full(p: Poller) -> None:
            channel = Channel(url, p.base / "full-metadata", p.base / "full-downloads", p.fetcher)
            channel.refresh(anchor)
            channel.download_artifact(channel.download(channel.latest()))

        phases.append(_measure("update via full artifact", pool, pollers[: args.full], full, server))
    for p in pollers:
        p.fetcher.close()
    return phases


def _measure(
    name: str,
    pool: ThreadPoolExecutor,
    pollers: list[Poller],
    work: Callable[[Poller], None],
    server: Nginx,
    *,
    duration: float | None = None,
) -> Phase:
    """Run `work` once per poller, or round-robin until `duration` seconds pass; count from nginx."""
    server.clear_log()
    stop = threading.Event()
    polls = [0] * len(pollers)
    locks = [threading.Lock() for _ in pollers]  # one poll at a time per device, as on a device

    def loop(p: Poller) -> None:
        while True:
            with locks[p.index]:
                work(p)
            polls[p.index] += 1
            if duration is None or stop.is_set():
                return

    started = time.perf_counter()
    futures = [pool.submit(loop, p) for p in pollers]
    if duration is not None:
        time.sleep(duration)
        stop.set()
    for future in futures:
        future.result()
    seconds = time.perf_counter() - started
    return Phase(name, sum(polls), len(server.requests()), server.bytes_sent(), seconds)


def _baseline(pool: ThreadPoolExecutor, args: argparse.Namespace, url: str, server: Nginx) -> Phase:
    """Plain GETs of the timestamp, no verification: what nginx and loopback allow at most."""
    server.clear_log()
    stop = threading.Event()

    def loop() -> int:
        count = 0
        with requests.Session() as session:
            while not stop.is_set():
                session.get(url, timeout=30).raise_for_status()
                count += 1
        return count

    started = time.perf_counter()
    futures = [pool.submit(loop) for _ in range(args.threads)]
    time.sleep(args.duration)
    stop.set()
    total = sum(f.result() for f in futures)
    seconds = time.perf_counter() - started
    return Phase("baseline: GET timestamp.json", total, len(server.requests()), server.bytes_sent(), seconds)


def _print(console: Console, args: argparse.Namespace, phases: list[Phase]) -> None:
    table = Table(title=f"pull mode on loopback: {args.pollers} pollers, {args.threads} client threads")
    for column in ("phase", "polls", "requests", "req/s served", "requests/poll", "bytes/poll (wire)"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for p in phases:
        table.add_row(
            p.name,
            str(p.polls),
            str(p.requests),
            f"{p.requests / p.seconds:,.0f}",
            f"{p.requests / max(p.polls, 1):.2f}",
            f"{p.bytes / max(p.polls, 1):,.0f}",
        )
    console.print(table)
    patch, full = phases[3], phases[4]
    saving = 1 - (patch.bytes / patch.polls) / (full.bytes / full.polls)
    console.print(
        f"patch vs full artifact per device: {saving:.0%} fewer bytes (tiny model; v1 and v2 are "
        "independent random weights, so the patch is nearly the whole model: a real fine-tune saves more)"
    )
    console.print(
        f"setup: {platform.machine()}, {os.cpu_count()} CPUs shared with the client, nginx 1 worker, "
        f"python {platform.python_version()}, HTTP/1.1 keep-alive over 127.0.0.1"
    )


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pollers", type=int, default=1000)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of the timed phases")
    parser.add_argument("--threads", type=int, default=16, help="client threads driving the pollers")
    parser.add_argument("--full", type=int, default=10, help="pollers that download the full artifact")
    parser.add_argument("--quick", action="store_true", help="200 pollers, 5 s phases")
    args = parser.parse_args()
    if args.quick:
        args.pollers, args.duration = min(args.pollers, 200), min(args.duration, 5.0)
    return args


if __name__ == "__main__":
    main()
