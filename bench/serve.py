"""Serving bench: concurrent streaming clients against the HTTP agent (llama.cpp and torch engines)
and, in the same run, llama.cpp's own C++ server; aggregate tokens/s and p50 time to first token.

Every server runs in its own process; this process is the client (raw HTTP/1.1 and SSE parsing, so
the client costs little of the two cores). For each server and each client count (1, 4, 16), every
client streams `--requests` chat completions of `--tokens` tokens one after the other (greedy, the
same prompt); a row's aggregate is all streamed tokens over the row's wall time, its TTFT the median
over all its requests.

* `agent llama.cpp`: `AgentServer` on the Q8_0 GGUF artifact, max_concurrent 16 (the batch);
* `agent torch`: the same server with the torch engine on the int8 safetensors artifact;
* `llama-server -np 4`: built by scripts/llamacpp.sh from the same patched llama.cpp sources and
  CMake flags as our llama-cpp-python, cached under ~/.cache/sits-deployer/llama-cpp; flash
  attention off, as ours.

Targets (2 CPU cores, 1 engine thread): llama.cpp agent at 4 clients >= 2x its single-client
aggregate and >= llama-server at 4 clients; its p50 TTFT at 4 clients <= 2x single.

`--soak N` instead sends N short requests to the llama.cpp agent and prints its RSS after 100 and
after N, and the slope (the growth per 1,000 requests, and extrapolated to 72 hours at that rate).

`--draft` instead serves the fp32 SmolLM2 checkpoint through the torch agent twice, 2 threads,
decode compiled (the agent is measured once its background compile is done): without a draft and
with agent.yaml's `draft: int4` (docs/torch-engine.md), so the table shows what speculation gives
one client and what it costs the batched steps of 4 and 16 (none speculate).

`--kv-cache` instead serves SmolLM2 (the int8 artifact) and the Qwen2.5-1.5B shape (random
weights, int4-g128: bench/scale_load.py's artifact) through the torch agent, 2 threads, once per
KV cache storage (agent.kv_cache_type fp32, fp16, int8), so the table shows what a narrower cache
costs decode and the first token against fp32, in the same run.

`--device cuda` serves random weights instead, in each shape of `--shapes` (SmolLM2-135M and a
Qwen2.5-1.5B-like shape by default; bench/engine_gpu.py's builder, bf16), through the same agent
with the torch engine on the GPU: CUDA graphs, 16 slots. The checkpoint gets SmolLM2's tokenizer
and chat template (`--tokenizer`, default the cached SmolLM2), grown with placeholder tokens to
the shape's vocabulary; the embedding rows of the end tokens are zero, so greedy decoding never
ends a stream early. Target (an H200): aggregate at 16 clients >= 8x single. `--device cpu
--shapes tiny` is a smoke run of that path. Tokens are counted from each stream's usage chunk.

    python bench/serve.py                        # the table
    python bench/serve.py --soak 10000           # the memory soak
    PYTHONPATH=. python bench/serve.py --device cuda                     # GPU, random weights
    PYTHONPATH=. python bench/serve.py --device cpu --shapes tiny --requests 1   # its smoke run
    PYTHONPATH=. python bench/serve.py --draft                           # fp32, with and without a draft
    PYTHONPATH=. python bench/serve.py --kv-cache --tokens 64 --requests 1   # KV cache storage
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from http.client import HTTPConnection
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from llamacpp import MESSAGES, artifacts  # noqa: E402 (bench/llamacpp.py: the same artifacts)

from deployer.core.gguf_io import GGUF_FILE  # noqa: E402

CLIENTS = (1, 4, 16)
CONTEXT = 512  # per sequence: the prompt (~30 tokens) and 128 answer tokens fit


@dataclass(frozen=True)
class Row:
    """One server at one client count."""

    server: str
    clients: int
    requests: int
    tokens: int
    aggregate_tok_s: float
    ttft_p50_ms: float
    errors: int  # requests refused (429, or 503 after request_timeout_s in the queue)


# -- servers -------------------------------------------------------------------------------------


def child_agent(
    engine: str,
    artifact_dir: Path,
    threads: int,
    device: str,
    compile_: str = "auto",
    draft: str = "off",
    kv_cache_type: str = "auto",
) -> None:
    """An agent on 127.0.0.1 serving the artifact; prints its port (once a background compile
    is done), serves until stdin closes."""
    from deployer.agent.engines import make_engine
    from deployer.agent.settings import AgentSettings

    settings = AgentSettings(
        port=0,
        root=Path(tempfile.mkdtemp(prefix="sits-bench-")),  # its own admin socket and key file
        engine=engine,
        device=device,
        threads=threads,
        max_concurrent=16,
        queue_length=64,
        context_length=CONTEXT,
        max_prompt_tokens=CONTEXT // 2,
        latency_budget_ms=120_000,  # a busy machine must not turn the bench into a load failure
        readiness_timeout_s=1200.0,  # a 1.5B shape loads in minutes on a busy machine
    )

    serve_for_parent(
        settings,
        lambda: make_engine(
            engine,
            context_length=CONTEXT,
            device=device,
            threads=threads,
            slots=settings.max_concurrent,
            compile=compile_,
            draft=draft,
            kv_cache_type=kv_cache_type,
        ),
        artifact_dir,
        compile_,
    )


def serve_for_parent(settings, make_one, model_dir: Path, compile_: str) -> None:
    """Serve `model_dir` as v1 with engines from `make_one()`; print the port (once a background
    compile is done) for the parent process, and serve until its stdin closes."""
    from deployer.agent.http.server import AgentServer

    made = []

    def factory():
        made.append(make_one())
        return made[-1]

    server = AgentServer(settings, factory)
    server.start()
    result = server.reload(model_dir, "v1")
    if not result.ok:
        raise SystemExit(f"load failed: {result.reason}")
    if compile_ == "on" and not made[-1].wait_compiled(1800):
        raise SystemExit("the background compile took more than 30 minutes")
    print(server.port, flush=True)
    sys.stdin.read()
    server.stop()


class Server:
    """A server process and the port it listens on."""

    def __init__(self, name: str, args: list[str], port_from: str) -> None:
        self.name = name
        self.process = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.port = self._read_port(port_from)
        # Keep reading its output: a full pipe would block the server on its next log line.
        threading.Thread(target=self.process.stdout.read, daemon=True).start()
        self._await_health()
        self.model = self.first_model()["id"]

    def _read_port(self, port_from: str) -> int:
        for line in self.process.stdout:
            if port_from == "first line":
                if line.strip().isdigit():
                    return int(line)
                print(f"{self.name}: {line}", end="", file=sys.stderr)  # a warning before the port
            elif "listening on http://127.0.0.1:" in line:  # llama-server's own log line
                return int(line.split("127.0.0.1:")[1].split()[0].rstrip("/"))
        raise SystemExit(f"{self.name} exited before listening (rc {self.process.wait()})")

    def _await_health(self) -> None:
        """llama-server listens before its model is loaded: wait for GET /health to answer 200."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            conn = HTTPConnection("127.0.0.1", self.port, timeout=10)
            try:
                conn.request("GET", "/healthz" if self.name.startswith("agent") else "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            finally:
                conn.close()
            time.sleep(0.2)
        raise SystemExit(f"{self.name} never became healthy")

    def first_model(self) -> dict:
        """The first model /v1/models lists: its id is the name requests must give (the agent
        refuses others), its `extra` how our agent's engine runs it."""
        conn = HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request("GET", "/v1/models")
            return json.loads(conn.getresponse().read())["data"][0]
        finally:
            conn.close()

    def rss_mb(self) -> float:
        """VmRSS of the server process, in MB."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        """Close stdin (our agents stop) and terminate (llama-server)."""
        self.process.stdin.close()
        self.process.terminate()
        self.process.wait(60)


def start_agent(
    engine: str,
    artifact_dir: Path,
    device: str = "cpu",
    name: str | None = None,
    threads: int = 1,
    compile_: str = "auto",
    draft: str = "off",
    kv_cache_type: str = "auto",
) -> Server:
    args = [sys.executable, __file__, "--child-agent", engine, str(artifact_dir), str(threads), device]
    args += [compile_, draft, kv_cache_type]
    return Server(name or f"agent {engine}", args, "first line")


def llama_server_binary() -> Path:
    """llama-server built from the same patched llama.cpp sources and CMake flags as our engine's
    llama-cpp-python (scripts/llamacpp.sh: cached, compiled on first use, about 5 minutes)."""
    done = subprocess.run(
        [str(REPO / "scripts" / "llamacpp.sh"), "server"],
        stdout=subprocess.PIPE,
        text=True,
        check=False,
        env={**os.environ, "SITS_VENV": sys.prefix},  # its pip: this virtual environment's
    )
    if done.returncode != 0:
        raise SystemExit("scripts/llamacpp.sh server failed (its messages are above)")
    return Path(done.stdout.strip())


def start_llama_server(binary: Path, gguf: Path, slots: int) -> Server:
    args = [str(binary), "-m", str(gguf), "-np", str(slots), "-c", str(CONTEXT * slots), "-t", "1"]
    args += ["-tb", "1", "-fa", "off", "--host", "127.0.0.1", "--port", "0", "--no-webui"]
    return Server(f"llama-server -np {slots}", args, "log")


def random_model(shape: str, tokenizer_dir: Path, dest: Path) -> Path:
    """A bf16 checkpoint in HF layout under `dest`: random weights in `shape` (bench/engine_gpu.py's
    builder, on the GPU when there is one), the tokenizer and chat template of `tokenizer_dir`.

    The vocabulary is the larger of the shape's and the tokenizer's; the tokenizer grows with
    placeholder tokens to it, so every id the model can choose has text. The end tokens'
    embedding rows (the tied head's rows) are zero: their logit is 0, below the best of thousands
    of random ones, so no stream ends before its token budget.
    """
    import torch
    from engine_gpu import SHAPES, random_checkpoint  # bench/engine_gpu.py
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tok_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config = SHAPES[shape] | {"torch_dtype": "bfloat16"}
    config["vocab_size"] = max(config["vocab_size"], tokenizer.get_vocab_size())
    have = tokenizer.get_vocab_size()
    tokenizer.add_tokens([f"<r{i}>" for i in range(have, config["vocab_size"])])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tensors, _ = random_checkpoint(config, "bf16", device)
    embed = tensors["model.embed_tokens.weight"]
    for end in {config["eos_token_id"], tokenizer.token_to_id(tok_config["eos_token"])} - {None}:
        embed[end] = 0
    dest.mkdir(parents=True, exist_ok=True)
    save_file({name: t.cpu().contiguous() for name, t in tensors.items()}, str(dest / "model.safetensors"))
    tokenizer.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (dest / "config.json").write_text(json.dumps(config))
    return dest


# -- clients -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stream:
    """One streamed completion: when it was sent, when each chunk with text came, and how many
    tokens the usage chunk counted."""

    start: float
    stamps: list[float]
    tokens: int


def stream_once(server: Server, tokens: int) -> Stream:
    """One streamed chat completion, with the usage chunk asked for."""
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": tokens, "temperature": 0}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    conn = HTTPConnection("127.0.0.1", server.port, timeout=600)
    start, stamps, counted = time.perf_counter(), [], None
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    for line in response:
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                counted = chunk["usage"]["completion_tokens"]
    conn.close()
    if counted is None:
        raise RuntimeError("the stream ended without a usage chunk")
    return Stream(start, stamps, counted)


def measure(server: Server, clients: int, requests: int, tokens: int) -> Row:
    """`clients` threads, each streaming `requests` completions in turn."""
    runs: list[Stream] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client() -> None:
        for _ in range(requests):
            try:
                run = stream_once(server, tokens)
            except (RuntimeError, OSError) as exc:
                with lock:
                    errors.append(str(exc))
                continue
            with lock:
                runs.append(run)

    stream_once(server, 8)  # warm-up
    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    total = sum(run.tokens for run in runs)
    ttft = statistics.median((run.stamps[0] - run.start) * 1000 for run in runs if run.stamps)
    return Row(server.name, clients, len(runs), total, total / wall, ttft, len(errors))


# -- output --------------------------------------------------------------------------------------


PEER = "llama-server -np 4"


def table(rows: list[Row], title: str) -> Table:
    """One row per server and client count, with the ratios to its own single client and to
    llama-server at the same client count."""
    out = Table(title=title)
    columns = ("server", "clients", "requests", "refused", "tokens", "aggregate tok/s")
    for column in (*columns, "vs 1 client", "vs llama-server", "p50 TTFT ms"):
        out.add_column(column, justify="left" if column == "server" else "right")
    single = {r.server: r for r in rows if r.clients == 1}
    peer = {r.clients: r for r in rows if r.server == PEER}
    for r in rows:
        base, other = single.get(r.server), peer.get(r.clients)
        out.add_row(
            r.server,
            str(r.clients),
            str(r.requests),
            str(r.errors),
            str(r.tokens),
            f"{r.aggregate_tok_s:.1f}",
            f"{r.aggregate_tok_s / base.aggregate_tok_s:.2f}x" if base else "-",
            f"{r.aggregate_tok_s / other.aggregate_tok_s:.2f}x" if other else "-",
            f"{r.ttft_p50_ms:.0f}",
        )
    return out


def verdict(rows: list[Row]) -> list[str]:
    """The targets of the llama.cpp agent, each with its figures."""
    get = {(r.server, r.clients): r for r in rows}
    ours1, ours4 = get.get(("agent llama.cpp", 1)), get.get(("agent llama.cpp", 4))
    peer1, peer4 = get.get((PEER, 1)), get.get((PEER, 4))
    lines = []
    if ours1 and ours4:
        scale = ours4.aggregate_tok_s / ours1.aggregate_tok_s
        lines.append(f"aggregate at 4 clients / single: {scale:.2f}x (target >= 2x)")
        ttft = ours4.ttft_p50_ms / ours1.ttft_p50_ms
        # The peer's own ratio in the same run: how far this machine lets a first token scale.
        peer = f"; llama-server's {peer4.ttft_p50_ms / peer1.ttft_p50_ms:.2f}x" if peer1 and peer4 else ""
        lines.append(f"p50 TTFT at 4 clients / single: {ttft:.2f}x (target <= 2x{peer})")
    if ours4 and peer4:
        ratio = ours4.aggregate_tok_s / peer4.aggregate_tok_s
        lines.append(f"aggregate at 4 clients vs llama-server -np 4: {ratio:.2f}x (target >= 1x)")
    return lines


def random_verdict(rows: list[Row]) -> list[str]:
    """The GPU target of each random-weight server, with its figures."""
    get = {(r.server, r.clients): r for r in rows}
    lines = []
    for server in dict.fromkeys(r.server for r in rows):
        one, many = get.get((server, 1)), get.get((server, CLIENTS[-1]))
        if one and many:
            scale = many.aggregate_tok_s / one.aggregate_tok_s
            lines.append(
                f"{server}: aggregate at {many.clients} clients / single: {scale:.2f}x (target >= 8x)"
            )
    return lines


def serve_random(shapes: list[str], device: str, tokenizer_dir: Path, requests: int, tokens: int) -> None:
    """The agent with the torch engine on `device`, serving random weights in each shape; one table."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="sits-bench-random-") as tmp:
        for shape in shapes:
            model = random_model(shape, tokenizer_dir, Path(tmp) / shape)
            server = start_agent("torch", model, device, f"agent torch {shape}")
            try:
                for clients in CLIENTS:
                    rows.append(measure(server, clients, requests, tokens))
                    print(rows[-1], flush=True)
            finally:
                server.stop()
    import torch

    where = torch.cuda.get_device_name() if device == "cuda" else f"{os.cpu_count()} CPUs"
    title = f"Random weights, bf16, torch engine on {where}, 16 slots, {tokens} tokens per stream, greedy"
    console = Console(width=150)
    console.print(table(rows, title))
    for line in random_verdict(rows):
        console.print(line)


def serve_draft(requests: int, tokens: int) -> None:
    """The fp32 checkpoint through the torch agent, compiled, without and with an int4 draft."""
    from deployer.build.demo_model import prepare_smollm2

    source, rows = prepare_smollm2(), []
    for name, draft in (("agent torch fp32", "off"), ("agent torch fp32 + int4 draft", "int4")):
        server = start_agent("torch", source, "cpu", name, threads=2, compile_="on", draft=draft)
        try:
            for clients in CLIENTS:
                rows.append(measure(server, clients, requests, tokens))
            print(f"{name}: {server.first_model().get('extra', {}).get('draft', '-')}", flush=True)
        finally:
            server.stop()
    load = os.getloadavg()
    title = (
        f"SmolLM2-135M-Instruct fp32, {tokens} tokens per stream, greedy, 2 engine threads, decode "
        f"compiled, {os.cpu_count()} CPUs, load average {load[0]:.1f} at the end"
    )
    Console(width=150).print(table(rows, title))
    single = {r.server: r.aggregate_tok_s for r in rows if r.clients == 1}
    if len(single) == 2:
        plain, drafted = single.values()
        print(f"one client: the draft gives {drafted / plain:.2f}x the tokens/s of plain steps")


def serve_kv_cache(requests: int, tokens: int) -> None:
    """SmolLM2 int8 and the Qwen2.5-1.5B shape int4-g128 through the torch agent, once per KV
    cache storage; each row against fp32 at the same client count."""
    from bench.scale_load import artifact  # the shape's int4-g128 artifact

    models = {
        "SmolLM2-135M int8": artifacts("int8")[1],
        "Qwen2.5-1.5B shape int4-g128": artifact("qwen2.5-1.5b"),
    }
    out = Table(title=f"torch agent, KV cache storage; {tokens} tokens per stream, greedy, 2 engine threads")
    for column in ("model", "kv cache", "clients", "tokens", "tok/s", "vs fp32", "p50 TTFT ms", "vs fp32"):
        out.add_column(column, justify="left" if column == "model" else "right")
    for model, directory in models.items():
        rows: dict[tuple[str, int], Row] = {}
        for kv in ("fp32", "fp16", "int8"):
            name = f"agent torch {model} {kv}"  # "agent": its health is /healthz
            server = start_agent("torch", directory, "cpu", name, threads=2, kv_cache_type=kv)
            try:
                extra = server.first_model().get("extra", {})
                print(f"{model}: kv_cache {extra.get('kv_cache')}", flush=True)
                for clients in CLIENTS:
                    rows[kv, clients] = row = measure(server, clients, requests, tokens)
                    print(row, flush=True)
            finally:
                server.stop()
        for (kv, clients), row in rows.items():
            base = rows["fp32", clients]
            out.add_row(
                model,
                kv,
                str(clients),
                str(row.tokens),
                f"{row.aggregate_tok_s:.1f}",
                f"{row.aggregate_tok_s / base.aggregate_tok_s:.2f}x",
                f"{row.ttft_p50_ms:.0f}",
                f"{row.ttft_p50_ms / base.ttft_p50_ms:.2f}x",
            )
    load = os.getloadavg()
    Console(width=150).print(out)
    print(f"{os.cpu_count()} CPUs, load average {load[0]:.1f} at the end")


def soak(gguf: Path, requests: int) -> None:
    """RSS of the llama.cpp agent after 100 and after `requests` short requests; the slope."""
    server = start_agent("llama.cpp", gguf)
    try:
        marks: list[tuple[int, float]] = []
        done = 0
        lock = threading.Lock()
        started = time.perf_counter()

        def client() -> None:
            nonlocal done
            while True:
                with lock:
                    if done >= requests:
                        return
                    done += 1
                    n = done
                stream_once(server, 4)
                if n in (100, requests) or n % 1000 == 0:
                    with lock:
                        marks.append((n, server.rss_mb()))
                        print(f"{n:8d} requests  RSS {marks[-1][1]:7.1f} MB", flush=True)

        threads = [threading.Thread(target=client) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
    finally:
        server.stop()
    marks.sort()
    first, last = marks[0], marks[-1]
    slope = (last[1] - first[1]) / max(1, last[0] - first[0]) * 1000
    rate = requests / wall
    growth = (last[1] - first[1]) / first[1] * 100
    print(f"RSS after {last[0]} vs after {first[0]}: {growth:+.2f}% (target within 5%)")
    print(
        f"slope: {slope:+.3f} MB per 1,000 requests; at {rate:.1f} requests/s that is "
        f"{slope * rate * 3600 * 72 / 1000:+.1f} MB over 72 hours"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=2, help="per client, one after the other")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch engine rows")
    parser.add_argument("--no-llama-server", action="store_true", help="skip the llama-server rows")
    parser.add_argument("--soak", type=int, metavar="N", help="run N short requests and report RSS")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="serve random weights (torch engine)")
    parser.add_argument(
        "--shapes",
        nargs="*",
        default=["SmolLM2-135M", "Qwen2.5-1.5B"],
        help="with --device (tiny: a smoke run)",
    )
    parser.add_argument(
        "--tokenizer", type=Path, help="with --device: tokenizer.json and tokenizer_config.json"
    )
    parser.add_argument("--draft", action="store_true", help="fp32 through the torch agent, with and without")
    parser.add_argument("--kv-cache", action="store_true", help="the torch agent per KV cache storage")
    parser.add_argument("--child-agent", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_agent:
        engine, directory, threads, device, compile_, draft, kv = args.child_agent
        child_agent(engine, Path(directory), int(threads), device, compile_, draft, kv)
        return
    if args.kv_cache:
        serve_kv_cache(args.requests, args.tokens)
        return
    if args.draft:
        serve_draft(args.requests, args.tokens)
        return
    if args.device:
        from deployer.build.demo_model import prepare_smollm2

        tokenizer_dir = args.tokenizer or prepare_smollm2()
        serve_random(args.shapes, args.device, tokenizer_dir, args.requests, args.tokens)
        return
    gguf, torch_dir = artifacts("int8")
    if args.soak:
        soak(gguf, args.soak)
        return
    starters = [("agent llama.cpp", lambda: start_agent("llama.cpp", gguf))]
    if not args.no_llama_server:
        binary = llama_server_binary()
        starters.append(("llama-server", lambda: start_llama_server(binary, gguf / GGUF_FILE, 4)))
    if not args.no_torch:
        starters.append(("agent torch", lambda: start_agent("torch", torch_dir)))
    rows = []
    for _, start in starters:
        server = start()
        try:
            for clients in CLIENTS:
                rows.append(measure(server, clients, args.requests, args.tokens))
        finally:
            server.stop()
    load = os.getloadavg()
    title = (
        f"SmolLM2-135M-Instruct Q8_0 / int8, {args.tokens} tokens per stream, greedy, 1 engine thread, "
        f"{os.cpu_count()} CPUs, load average {load[0]:.1f} at the end"
    )
    console = Console(width=150)  # the whole table on one screen, also when piped
    console.print(table(rows, title))
    for line in verdict(rows):
        console.print(line)


if __name__ == "__main__":
    main()
