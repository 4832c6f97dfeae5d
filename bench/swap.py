"""Hot-swap bench: concurrent clients keep asking while the agent swaps its model again and again.

The agent runs as its own process (`run_server`, as systemd would start it) on a device root with two
versions; swaps go through POST /admin/reload, the path `sits-agent reload` and the updater take.
Clients use the official `openai` package with retries off, so any failed request is counted.

Phases, one run: a steady phase, then a swap phase with N swaps spread over its duration (back to
back when a swap takes longer than its share). Reported: failed requests (target 0), and p50/p99
latency of the requests that overlapped a swap against those that overlapped none (the baseline of
the same run; target p99 <= 2x).

    python bench/swap.py            # SmolLM2-135M-Instruct, 8 clients, 30 s steady + 60 s with 10 swaps
    python bench/swap.py --quick    # tiny seeded model, 8 clients, 8 s + 12 s with 3 swaps (CI)
    python bench/swap.py --artifact DIR   # any artifact or HF-layout directory (e.g. an int8 build)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from http.client import HTTPConnection
from pathlib import Path

import openai
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deployer.agent.ota.store import DeviceStore  # noqa: E402 - after the path set-up above
from deployer.demo.ports import PortReservation  # noqa: E402

SERVE = (
    "import sys; from pathlib import Path; from deployer.agent.settings import load_settings; "
    "from deployer.agent.http.server import run_server; run_server(load_settings(Path(sys.argv[1])))"
)
PROMPT = [{"role": "user", "content": "Name one advantage of running language models on edge devices."}]


@dataclass(frozen=True)
class Sample:
    """One request: when it ran and whether it succeeded."""

    start: float
    end: float
    ok: bool
    error: str = ""


@dataclass(frozen=True)
class Swap:
    """One reload: its window and outcome."""

    start: float
    end: float
    ok: bool
    version: str


def main() -> None:
    args = _parse_args()
    source = _source_dir(args)
    with tempfile.TemporaryDirectory(prefix="sits-swap-bench-") as tmp, PortReservation() as reserved:
        store = _device(Path(tmp), source)
        port = reserved.port
        config = _write_config(Path(tmp), store, port, args)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        server = subprocess.Popen(
            [sys.executable, "-c", SERVE, str(config)], env=env, stderr=subprocess.DEVNULL
        )
        try:
            _wait_ready(port, server)
            model = _get_json(port, "/v1/models")["data"][0]
            samples, swaps, phases = _run(port, args)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=120)
    _report(args, source, model, samples, swaps, phases)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny model and short phases (CI)")
    parser.add_argument("--artifact", type=Path, help="model directory to serve (default: SmolLM2)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--steady-s", type=float, help="baseline phase length (default 30, quick 8)")
    parser.add_argument("--swap-s", type=float, help="swap phase length (default 60, quick 12)")
    parser.add_argument("--swaps", type=int, help="swaps in the swap phase (default 10, quick 3)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in the agent")
    parser.add_argument("--policy", default="side-by-side", choices=["side-by-side", "unload-first", "auto"])
    args = parser.parse_args()
    args.steady_s = args.steady_s or (8.0 if args.quick else 30.0)
    args.swap_s = args.swap_s or (12.0 if args.quick else 60.0)
    args.swaps = args.swaps or (3 if args.quick else 10)
    return args


def _source_dir(args: argparse.Namespace) -> Path:
    from deployer.build.demo_model import cache_root, make_tiny_checkpoint, prepare_smollm2

    if args.artifact:
        return args.artifact
    if args.quick:
        return make_tiny_checkpoint(cache_root() / "bench-tiny", seed=0)
    return prepare_smollm2()


def _device(root: Path, source: Path) -> DeviceStore:
    """A device root with versions v1 and v2 (hard links of one model: the load work is the same)."""
    store = DeviceStore(root / "device")
    store.ensure_layout()
    for version in ("v1", "v2"):
        shutil.copytree(source, store.version_dir(version), copy_function=_link_or_copy)
    store.set_pointer("current", "v1")
    return store


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _write_config(tmp: Path, store: DeviceStore, port: int, args: argparse.Namespace) -> Path:
    config = tmp / "agent.yaml"
    config.write_text(
        f"port: {port}\nroot: {store.root}\nthreads: {args.threads}\nswap_policy: {args.policy}\n"
        "max_concurrent: 4\nqueue_length: 32\ncontext_length: 512\nmax_prompt_tokens: 256\n"
        "request_timeout_s: 300\nlatency_budget_ms: 30000\nreadiness_timeout_s: 300\n"
    )
    return config


def _run(
    port: int, args: argparse.Namespace
) -> tuple[list[Sample], list[Swap], dict[str, tuple[float, float]]]:
    samples: list[Sample] = []
    swaps: list[Swap] = []
    stop = threading.Event()
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300
    )

    model = client.models.list().data[0].id.partition("@")[0]  # the agent answers for its model only

    def ask() -> None:
        while not stop.is_set():
            start = time.monotonic()
            try:
                client.chat.completions.create(
                    model=model, messages=PROMPT, max_tokens=args.max_tokens, temperature=0
                )
                samples.append(Sample(start, time.monotonic(), True))
            except openai.OpenAIError as exc:
                samples.append(Sample(start, time.monotonic(), False, repr(exc)[:200]))

    workers = [threading.Thread(target=ask, daemon=True) for _ in range(args.clients)]
    for worker in workers:
        worker.start()
    steady_start = time.monotonic()
    time.sleep(args.steady_s)
    swap_start = time.monotonic()
    gap = args.swap_s / args.swaps
    for i in range(args.swaps):
        due = swap_start + i * gap
        time.sleep(max(0.0, due - time.monotonic()))
        version = "v2" if i % 2 == 0 else "v1"
        t0 = time.monotonic()
        status, body = _post_json(port, "/admin/reload", {"version": version, "reason": "update"})
        swaps.append(Swap(t0, time.monotonic(), status == 200 and body.get("ok", False), version))
    time.sleep(max(0.0, swap_start + args.swap_s - time.monotonic()))
    swap_end = time.monotonic()
    stop.set()
    for worker in workers:
        worker.join(timeout=300)
    return samples, swaps, {"steady": (steady_start, swap_start), "swaps": (swap_start, swap_end)}


def _report(
    args: argparse.Namespace,
    source: Path,
    model: dict,
    samples: list[Sample],
    swaps: list[Swap],
    phases: dict[str, tuple[float, float]],
) -> None:
    def overlaps(sample: Sample) -> bool:
        return any(sample.start < w.end and sample.end > w.start for w in swaps)

    steady = [s for s in samples if not overlaps(s)]
    overlapping = [s for s in samples if overlaps(s)]
    before = [s for s in samples if s.end <= phases["swaps"][0]]
    console = Console()
    console.print(
        f"[bold]hot-swap bench[/bold]: {source.name} ({model['quantization']}, kernel {model['kernel']}, "
        f"{model['device']}), {args.clients} clients, max_tokens {args.max_tokens}, policy {args.policy}, "
        f"agent threads {args.threads}; {os.cpu_count()} CPUs, {platform.machine()}, Python "
        f"{platform.python_version()}"
    )
    table = Table("requests", "count", "failed", "p50 ms", "p99 ms", "max ms")
    for name, group in (
        ("before the first swap", before),
        ("no swap running (baseline)", steady),
        ("overlapping a swap", overlapping),
    ):
        table.add_row(name, *_stats(group))
    console.print(table)
    durations = sorted(w.end - w.start for w in swaps)
    ok_swaps = sum(w.ok for w in swaps)
    failed = sum(not s.ok for s in samples)
    ratios = [
        _pct(overlapping, q) / _pct(steady, q) if steady and overlapping else float("nan") for q in (50, 99)
    ]
    console.print(
        f"swaps: {ok_swaps}/{len(swaps)} ok, duration median {durations[len(durations) // 2]:.2f} s, "
        f"max {durations[-1]:.2f} s"
    )
    console.print(f"failed requests: {failed} (target 0)")
    console.print(
        f"overlapping a swap vs baseline: p50 {ratios[0]:.2f}x, p99 {ratios[1]:.2f}x (target p99 <= 2x)"
    )
    for error in sorted({s.error for s in samples if not s.ok})[:5]:
        console.print(f"  error: {error}")


def _stats(group: list[Sample]) -> tuple[str, ...]:
    if not group:
        return ("0", "0", "-", "-", "-")
    ok = [s for s in group if s.ok]
    return (
        str(len(group)),
        str(len(group) - len(ok)),
        f"{_pct(group, 50):.0f}",
        f"{_pct(group, 99):.0f}",
        f"{max(s.end - s.start for s in group) * 1000:.0f}",
    )


def _pct(group: list[Sample], q: float) -> float:
    """The q-th percentile of latency in ms (nearest rank)."""
    values = sorted((s.end - s.start) * 1000 for s in group)
    rank = max(0, min(len(values) - 1, round(q / 100 * len(values) + 0.5) - 1))
    return values[rank]


def _wait_ready(port: int, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the agent exited with status {server.returncode} before it was ready")
        try:
            conn = HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/readyz")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("the agent was not ready within 300 s")


def _get_json(port: int, path: str) -> dict:
    conn = HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path)
    return json.loads(conn.getresponse().read())


def _post_json(port: int, path: str, body: dict) -> tuple[int, dict]:
    conn = HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


if __name__ == "__main__":
    main()
