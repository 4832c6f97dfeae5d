"""LoRA adapters bench (issue #41): aggregate tok/s of clients on different adapters against the
same clients on the base alone, measured in the same run on the same agent.

The agent (its own process, max_concurrent 16) serves SmolLM2-135M-Instruct with 4 real PEFT
adapters of it loaded (rank 8 on q_proj and v_proj, as the issue's figures), installed in its device
store before it starts: on the torch engine the fp32 HF-layout checkpoint, on the llama.cpp engine
(`--engine llama.cpp`) its Q8_0 GGUF artifact with each adapter built for it (llama.cpp's LoRA
GGUF). For each client count (1, 4, 16):
every client sends `--requests` chat completions of `--tokens` tokens one after the other
(greedy, streamed with a usage chunk); in the `base` mode every client names the base model, in
`1 adapter` every client the first adapter, in `4 adapters` client i names adapter i % 4, so 4
and 16 clients mix 4 adapters in every decode step. A run's aggregate is all streamed tokens over
its wall time; each mode runs `--repeats` times, alternated with the others, and the table shows
the medians; the ratio is 4 adapters over base. Target (torch engine, 2 CPU cores, and on the
GPU): >= 0.85 at 4 clients.
llama.cpp applies an adapter to a whole context, so there requests of different adapters are
decoded in separate batches (docs/openai-api.md): the ratio shows what that costs.

    PYTHONPATH=. python bench/adapters.py                  # CPU, 1 engine thread, eager
    PYTHONPATH=. python bench/adapters.py --compile on     # CPU, the base's decode step compiled
    PYTHONPATH=. python bench/adapters.py --device cuda    # the GPU (random weights, SmolLM2's shape)
    PYTHONPATH=. python bench/adapters.py --engine llama.cpp   # Q8_0 GGUF, 1 llama.cpp thread
    PYTHONPATH=. python bench/adapters.py --tokens 16 --requests 1 --clients 1 4   # a smoke run
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

CONTEXT = 512
ADAPTERS = ("summarise", "extract", "classify", "translate")
MESSAGES = [{"role": "user", "content": "Tell me a long story about a robot who learns to paint."}]


@dataclass(frozen=True)
class Row:
    """One mode at one client count."""

    mode: str  # base | 1 adapter | 4 adapters
    clients: int
    requests: int
    tokens: int
    aggregate_tok_s: float


def adapter_artifact(engine: str, model: Path, source: Path, name: str, seed: int, root: Path) -> Path:
    """A real PEFT adapter of `source` (SmolLM2's checkpoint) as an artifact the engine serves: for
    llama.cpp built for the GGUF artifact `model` (so with its LoRA GGUF), else its factors alone."""
    from deployer.build.adapter import AdapterBuildRequest, build_adapter
    from deployer.core.hashing import sha256_file
    from deployer.core.lora import from_peft, write_adapter
    from tests.agent.lora_helpers import make_peft_adapter

    peft = make_peft_adapter(source, root / f"peft-{name}", seed=seed, rank=8, alpha=16, b_std=0.02)
    if engine != "llama.cpp":
        write_adapter(from_peft(peft, name, "1", "smollm2"), root / f"artifact-{name}")
        return root / f"artifact-{name}"
    request = AdapterBuildRequest(
        name=name,
        version="1",
        peft_dir=peft,
        scale=1.0,
        base_artifact_dir=model,
        base_artifact_id=sha256_file(model / "sits-manifest.json"),
        base_source_dir=source,
        store_dir=root / "store",
    )
    return build_adapter(request).artifact_dir


def child_agent(engine: str, device: str, threads: int, compile_: str, model: Path) -> None:
    """An agent serving SmolLM2 with the bench's adapters installed; prints its port, serves until
    stdin closes."""
    from deployer.agent.engines import make_engine
    from deployer.agent.ota.adapters import AdapterStore
    from deployer.agent.ota.store import DeviceStore
    from deployer.agent.settings import AgentSettings
    from deployer.build.demo_model import prepare_smollm2

    root = Path(tempfile.mkdtemp(prefix="sits-bench-adapters-"))
    store = AdapterStore(DeviceStore(root).base)
    source = prepare_smollm2() if engine == "llama.cpp" else model
    for seed, name in enumerate(ADAPTERS, start=1):
        artifact = adapter_artifact(engine, model, source, name, seed, root)
        store.install(name, artifact, f"{name}-1", "1", 1)
    settings = AgentSettings(
        port=0,
        root=root,
        engine=engine,
        device=device,
        threads=threads,
        max_concurrent=16,
        queue_length=64,
        context_length=CONTEXT,
        max_prompt_tokens=CONTEXT // 2,
        latency_budget_ms=120_000,
    )

    from bench.serve import serve_for_parent

    serve_for_parent(
        settings,
        lambda: make_engine(
            engine, context_length=CONTEXT, device=device, threads=threads, slots=16, compile=compile_
        ),
        model,
        compile_,
    )


def bench_model(args: argparse.Namespace) -> Path:
    """SmolLM2-135M-Instruct (fp32) on a CPU, or its Q8_0 GGUF artifact for llama.cpp; on the GPU
    random bf16 weights in its shape with its tokenizer (bench/serve.py's random_model: no stream
    ends early), which a GPU machine without the model's GGUF can make."""
    from deployer.build.demo_model import prepare_smollm2

    if args.engine == "llama.cpp":
        sys.path.insert(0, str(REPO / "bench"))
        from llamacpp import artifacts  # bench/llamacpp.py: serve.py's artifacts

        return artifacts("int8")[0]
    if args.device == "cpu":
        return prepare_smollm2()
    sys.path.insert(0, str(REPO / "bench"))
    from serve import random_model  # bench/serve.py

    tokenizer = args.tokenizer or prepare_smollm2()
    return random_model("SmolLM2-135M", tokenizer, Path(tempfile.mkdtemp(prefix="sits-bench-model-")))


def start_agent(
    engine: str, device: str, threads: int, compile_: str, model: Path
) -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen(
        [sys.executable, __file__, "--child-agent", engine, device, str(threads), compile_, str(model)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    for line in process.stdout:
        if line.strip().isdigit():
            threading.Thread(target=process.stdout.read, daemon=True).start()
            return process, int(line)
    raise SystemExit(f"the agent exited before listening (rc {process.wait()})")


def models(port: int) -> list[dict]:
    conn = HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/v1/models")
        return json.loads(conn.getresponse().read())["data"]
    finally:
        conn.close()


def stream_once(port: int, model: str, tokens: int) -> int:
    """One streamed chat completion; the completion tokens its usage chunk counts."""
    body = {"model": model, "messages": MESSAGES, "max_tokens": tokens, "temperature": 0}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    conn = HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        counted = None
        for line in response:
            if line.startswith(b"data: {") and (usage := json.loads(line[6:]).get("usage")):
                counted = usage["completion_tokens"]
    finally:
        conn.close()
    if counted is None:
        raise RuntimeError("the stream ended without a usage chunk")
    return counted


def measure(port: int, names: list[str], requests: int, tokens: int, mode: str) -> Row:
    """One client per entry of `names` (the model it asks for), each sending `requests` in turn."""
    counts: list[int] = []
    lock = threading.Lock()

    def client(name: str) -> None:
        for _ in range(requests):
            n = stream_once(port, name, tokens)
            with lock:
                counts.append(n)

    threads = [threading.Thread(target=client, args=(name,)) for name in names]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return Row(mode, len(names), len(counts), sum(counts), sum(counts) / wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["torch", "llama.cpp"], default="torch")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="engine threads (CPU)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2, help="per client, one after the other")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=3, help="base and adapters alternated; medians")
    parser.add_argument(
        "--compile",
        choices=["off", "on", "auto"],
        help="the engine's compile: off (the CPU's default) runs both modes eager; on compiles the "
        "decode step first (the base's steps use it, steps with adapter rows run eager); auto (the "
        "GPU's default) captures CUDA graphs, for the base and with the adapters' low-rank path",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="cuda: the tokenizer of the random SmolLM2-shaped model (default: the cached SmolLM2's)",
    )
    parser.add_argument("--child-agent", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine == "llama.cpp" and args.device != "cpu":
        parser.error("the llama.cpp engine runs on the CPU")
    args.compile = args.compile or ("off" if args.device == "cpu" else "auto")
    if args.child_agent:
        engine, device, threads, compile_, model = args.child_agent
        child_agent(engine, device, int(threads), compile_, Path(model))
        return
    process, port = start_agent(args.engine, args.device, args.threads, args.compile, bench_model(args))
    try:
        listed = models(port)
        base = next(m["id"] for m in listed if m.get("kind") != "lora")
        loaded = sorted(m["id"] for m in listed if m.get("kind") == "lora" and m["loaded"])
        if loaded != sorted(ADAPTERS):
            raise SystemExit(f"the agent loaded {loaded}, not {sorted(ADAPTERS)}")
        for name in (base, *ADAPTERS):
            stream_once(port, name, 8)  # warm-up: every path once
        rows = []
        for clients in args.clients:
            modes = {
                "base": [base] * clients,
                "1 adapter": [ADAPTERS[0]] * clients,
                "4 adapters": [ADAPTERS[i % len(ADAPTERS)] for i in range(clients)],
            }
            # Alternated, so that a change in the machine's load hits every mode alike.
            for _ in range(args.repeats):
                rows += [measure(port, names, args.requests, args.tokens, m) for m, names in modes.items()]
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(120)
    if args.engine == "llama.cpp":
        how = f"Q8_0 GGUF, CPU, {args.threads} thread(s)"
    else:
        how = f"fp32, CPU, compile {args.compile}" if args.device == "cpu" else "random bf16, CUDA"
    table = Table(title=f"LoRA adapters, SmolLM2-135M ({how}), {args.engine} engine")
    for column in ("clients", "base tok/s", "1 adapter tok/s", "4 adapters tok/s", "ratio", "target"):
        table.add_column(column, justify="right")
    for clients in args.clients:
        b, one, a = (
            statistics.median(r.aggregate_tok_s for r in rows if r.clients == clients and r.mode == m)
            for m in ("base", "1 adapter", "4 adapters")
        )
        target = ">= 0.85" if clients == 4 and args.engine == "torch" else ""
        table.add_row(str(clients), f"{b:.1f}", f"{one:.1f}", f"{a:.1f}", f"{a / b:.2f}", target)
    Console().print(table)
    load = os.getloadavg()[0]
    print(f"ratio: 4 adapters / base; medians of {args.repeats} alternated runs; load average {load:.1f}")


if __name__ == "__main__":
    main()
