"""llama.cpp engine bench: our agent over HTTP vs llama-cpp-python in-process on the same GGUF, vs
our agent with the torch engine; decode tokens/s, time to first token and peak RSS at 1 and 2 threads.

Every configuration runs in its own process so its peak RSS (VmHWM) is its own:

* `in-process`: llama-cpp-python's `create_completion(stream=True)` on the GGUF, the baseline;
* `agent llama.cpp`: `AgentServer` with the llama.cpp engine on the GGUF artifact, driven over
  HTTP (SSE streaming) by this process, so the server's overhead is what the rows differ by;
* `agent torch`: the same server with the torch engine on the int8 safetensors artifact.

Same prompt (ChatML, as the chat template renders it), greedy, `--tokens` new tokens; each row is
the median of `--repeats` requests after one warm-up. Targets: the agent's llama.cpp tokens/s
within 10% of in-process, its peak RSS within 1.5x.

    python bench/llamacpp.py                 # SmolLM2-135M-Instruct, Q8_0 GGUF, 64 tokens, 3 repeats
    python bench/llamacpp.py --scheme int4   # Q4_1 GGUF (int4, group size 32)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from http.client import HTTPConnection
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MESSAGES = [{"role": "user", "content": "Tell me a long story about a robot who learns to paint."}]


@dataclass(frozen=True)
class Row:
    """One configuration's figures (medians over the repeats)."""

    name: str
    threads: int
    tokens_per_s: float
    ttft_ms: float
    peak_rss_mb: float
    tokens: int


# -- artifacts -----------------------------------------------------------------------------------


def artifacts(scheme: str) -> tuple[Path, Path]:
    """(GGUF artifact, torch safetensors artifact) of SmolLM2, built once into the cache's store."""
    from deployer.build.demo_model import cache_root, prepare_smollm2
    from deployer.build.pipeline import build_artifact
    from deployer.build.spec import BuildRequest, QuantSpec

    source, store = prepare_smollm2(), cache_root() / "bench-store"
    quant = QuantSpec(scheme, 32 if scheme == "int4" else 128)
    common = {"source_dir": source, "name": "smollm2-135m-instruct", "version": "1.0.0", "store_dir": store}
    gguf = build_artifact(BuildRequest(quant=quant, format="gguf", **common)).artifact_dir
    torch_dir = build_artifact(BuildRequest(quant=QuantSpec("int8"), **common)).artifact_dir
    return gguf, torch_dir


def prompt_text(gguf_dir: Path) -> str:
    """The chat prompt as the GGUF's own template renders it (what the agent sends llama.cpp)."""
    from deployer.agent.chat import ChatTemplate
    from deployer.agent.types import ChatMessage
    from deployer.core.gguf_io import GGUF_FILE, read_gguf_header

    header = read_gguf_header(gguf_dir / GGUF_FILE)
    template = ChatTemplate(header.string("tokenizer.chat_template"), {}, header.path)
    return template.render([ChatMessage(**m) for m in MESSAGES], add_generation_prompt=True)


def peak_rss_mb(pid: str = "self") -> float:
    """VmHWM of a process, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# -- children ------------------------------------------------------------------------------------


def child_in_process(gguf_dir: Path, threads: int, tokens: int, repeats: int) -> None:
    """Baseline: llama-cpp-python on the same GGUF, streamed in-process. Prints one JSON line."""
    from llama_cpp import Llama

    from deployer.core.gguf_io import GGUF_FILE

    llm = Llama(
        model_path=str(gguf_dir / GGUF_FILE),
        n_ctx=2048,
        n_threads=threads,
        n_threads_batch=threads,
        use_mmap=True,
        verbose=False,
    )
    prompt = prompt_text(gguf_dir)
    runs = []
    for _ in range(repeats + 1):
        start, stamps = time.perf_counter(), []
        for chunk in llm.create_completion(prompt, max_tokens=tokens, temperature=0.0, stream=True):
            if chunk["choices"][0]["text"]:  # the closing chunk carries no text
                stamps.append(time.perf_counter())
        runs.append((start, stamps))
    print(json.dumps({"runs": runs[1:], "peak_rss_mb": peak_rss_mb()}), flush=True)


def child_server(engine: str, artifact_dir: Path, threads: int) -> None:
    """An agent on 127.0.0.1 serving the artifact; prints its port, serves until stdin closes."""
    from deployer.agent.engines import make_engine
    from deployer.agent.http.server import AgentServer
    from deployer.agent.settings import AgentSettings

    # A generous smoke budget: a busy CI machine must not turn the bench into a load failure.
    settings = AgentSettings(
        port=0, engine=engine, threads=threads, max_concurrent=1, latency_budget_ms=120_000
    )
    server = AgentServer(
        settings, lambda: make_engine(engine, context_length=settings.context_length, threads=threads)
    )
    server.start()
    result = server.reload(artifact_dir, "v1")
    if not result.ok:
        raise SystemExit(f"load failed: {result.reason}")
    print(server.port, flush=True)
    sys.stdin.read()
    server.stop()


# -- the parent's measurements -------------------------------------------------------------------


def stream_once(port: int, tokens: int) -> tuple[float, list[float]]:
    """One streamed chat completion; (start, the arrival time of each chunk with text)."""
    conn = HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("GET", "/v1/models")
    model = json.loads(conn.getresponse().read())["data"][0]["id"]  # the agent answers for its model only
    body = {"model": model, "messages": MESSAGES, "max_tokens": tokens, "temperature": 0, "stream": True}
    start, stamps = time.perf_counter(), []
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    for line in response:
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
    conn.close()
    return start, stamps


def figures(name: str, threads: int, runs: list, rss: float) -> Row:
    """Median TTFT and decode tokens/s (after the first token) over the runs."""
    ttft = statistics.median((stamps[0] - start) * 1000 for start, stamps in runs)
    rates = [(len(s) - 1) / (s[-1] - s[0]) for _, s in runs if len(s) > 1]
    return Row(name, threads, statistics.median(rates), ttft, rss, len(runs[0][1]))


def run_in_process(gguf_dir: Path, threads: int, tokens: int, repeats: int) -> Row:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child-in-process",
            str(gguf_dir),
            str(threads),
            str(tokens),
            str(repeats),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return figures("llama-cpp-python, in-process", threads, data["runs"], data["peak_rss_mb"])


def run_agent(engine: str, artifact_dir: Path, threads: int, tokens: int, repeats: int) -> Row:
    args = [sys.executable, __file__, "--child-server", engine, str(artifact_dir), str(threads)]
    child = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        runs = [stream_once(port, tokens) for _ in range(repeats + 1)][1:]
        rss = peak_rss_mb(str(child.pid))
    finally:
        child.stdin.close()
        child.wait(60)
    return figures(f"agent + {engine}, HTTP", threads, runs, rss)


def table(rows: list[Row], scheme: str) -> Table:
    out = Table(title=f"SmolLM2-135M-Instruct, {scheme}, greedy, batch 1, {platform.processor() or 'cpu'}")
    for column in ("engine", "threads", "tokens", "decode tok/s", "TTFT ms", "peak RSS MB", "vs in-process"):
        out.add_column(column, justify="left" if column == "engine" else "right")
    baseline = {r.threads: r for r in rows if r.name.startswith("llama-cpp-python")}
    for r in rows:
        base = baseline[r.threads]
        ratio = (
            f"{r.tokens_per_s / base.tokens_per_s:.2f}x tok/s, {r.peak_rss_mb / base.peak_rss_mb:.2f}x RSS"
        )
        out.add_row(
            r.name,
            str(r.threads),
            str(r.tokens),
            f"{r.tokens_per_s:.1f}",
            f"{r.ttft_ms:.0f}",
            f"{r.peak_rss_mb:.0f}",
            ratio,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", choices=("int8", "int4"), default="int8")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--no-torch", action="store_true", help="skip the torch engine rows")
    parser.add_argument("--child-in-process", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--child-server", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_in_process:
        directory, threads, tokens, repeats = args.child_in_process
        return child_in_process(Path(directory), int(threads), int(tokens), int(repeats))
    if args.child_server:
        engine, directory, threads = args.child_server
        return child_server(engine, Path(directory), int(threads))
    console = Console(width=150)
    console.print("preparing artifacts (built once, then cached) ...")
    gguf_dir, torch_dir = artifacts(args.scheme)
    rows = []
    for threads in args.threads:
        rows.append(run_in_process(gguf_dir, threads, args.tokens, args.repeats))
        rows.append(run_agent("llama.cpp", gguf_dir, threads, args.tokens, args.repeats))
        if not args.no_torch:
            rows.append(run_agent("torch", torch_dir, threads, args.tokens, args.repeats))
    console.print(table(rows, args.scheme))


if __name__ == "__main__":
    main()
