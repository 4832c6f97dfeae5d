"""How the torch engine's prefill and decode steps run fast: compiled by inductor and captured
in CUDA graphs, each where asked and possible, else eager with the reason kept (`Decode`, shown
by describe()).

On CUDA each decoder layer's decode is compiled (`_compile_layers`), then one decode step per
batch bucket and one prefill chunk per length are captured, so a step replays one graph; once
LoRA adapters are loaded, the same again with their low-rank path (`capture_adapters`), which
any mix of adapter and base rows replays. On a
CPU the whole decode step is compiled into one graph with a C++ wrapper (`_compile_step`),
in the agent on a thread of its own (`compile_in_background`) while eager steps serve.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from deployer.agent.engines.torch import exact_ops
from deployer.agent.engines.torch.loader import LoadedModel
from deployer.agent.engines.torch.lora import LoraBank
from deployer.agent.engines.torch.speculative import DecodeFn, Drafter

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

_log = logging.getLogger("sits.agent")

# Prompt chunk lengths a prefill is captured for on CUDA (those up to the cache length): a chunk
# runs in the smallest that holds it, padded; a longer prompt runs in chunks of the largest.
# Eager, a 32-token prefill launches about 1,200 kernels and took 18-29 ms on the H200's host.
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)
# Eager runs before a capture: the first compiles (when compiled), the others settle allocations.
CAPTURE_WARMUP_RUNS = 3
# What inductor's autotuner zeroes between timings of a generated kernel while the engine loads
# on CUDA, in place of a buffer the size of the L2 (60 MB on an H200; see _small_tuning_flush).
TUNING_FLUSH_BYTES = 1 << 20
# Compiled codes kept per decoder layer: one per batch bucket, for the base and for each adapter
# layout (dynamo's default of 8 would send the adapter steps' layers back to eager).
RECOMPILE_LIMIT = 64

Graph = tuple[torch.cuda.CUDAGraph, torch.Tensor]  # a captured graph and its logits


@dataclass
class Decode:
    """How prefill and decode steps run, and why (shown by describe()).

    `compiled` means the decoder layers are compiled (CUDA: fixed shapes, then captured);
    `step` is the whole decode step compiled as one graph (CPU), called with the keys in use.
    """

    compiled: bool = False
    compile_note: str = "off"
    step: DecodeFn | None = None
    graphs: dict[int, Graph] = field(default_factory=dict)  # decode, by batch bucket
    graph_note: str = "eager"
    prefills: dict[int, Graph] = field(default_factory=dict)  # prefill, by chunk length
    prefill_note: str = "eager"
    ops_note: str = "torch"  # what the exact ops run (exact_ops.fused_kernels)
    # The same with the adapters' low-rank path, for LoraBank.version `adapter_version`.
    adapter_graphs: dict[int, Graph] = field(default_factory=dict)
    adapter_prefills: dict[int, Graph] = field(default_factory=dict)
    adapter_version: int = 0
    adapter_note: str = "-"


def prepare_decode(
    loaded: LoadedModel,
    io: torch.Tensor,
    prefill_io: torch.Tensor,
    buckets: Sequence[int],
    want_compile: bool,
    want_graphs: bool,
) -> Decode:
    """Compile the decode layer (CUDA) or step (CPU), capture the decode step per batch bucket
    reading `io` and the prefill per chunk length reading `prefill_io`, where asked and
    possible; what cannot falls back to eager, with the reason kept for describe()."""
    with _small_tuning_flush(loaded.device):  # inductor tunes while it compiles
        decode = Decode()
        layers = loaded.model.model.layers
        # On CUDA the exact ops run fused Triton kernels: eager steps call them as compiled ones do.
        decode.ops_note = exact_ops.fused_kernels(loaded.device)  # built and checked before a capture
        loaded.model.use_exact_ops(loaded.device.type == "cuda")
        if want_compile and loaded.device.type == "cpu":
            decode.step, decode.compile_note = _compile_step(loaded, io)
        elif want_compile:
            decode.compiled, decode.compile_note = _compile_layers(loaded, io)
        if not decode.compiled:
            _uncompile(layers)  # an earlier engine on the same model may have compiled them
        if not want_graphs:
            note = (
                "eager (CUDA graphs are for CUDA devices)" if loaded.device.type != "cuda" else "eager (off)"
            )
            decode.graph_note = decode.prefill_note = note
            return decode
        pool = torch.cuda.graph_pool_handle()
        # One stream for every warm-up and capture: cuBLAS keeps a workspace per stream.
        stream = torch.cuda.Stream()
        try:
            for bucket in sorted(buckets, reverse=True):  # the largest first: the others fit in its pool
                decode.graphs[bucket] = _capture_decode(loaded, io, bucket, pool, stream)
            decode.graph_note = f"cuda-graph buckets {','.join(map(str, sorted(decode.graphs)))}"
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            # Out of memory (or a kernel that cannot be captured): eager steps still work.
            decode.graphs.clear()
            _settle()
            decode.graph_note = f"eager (capture failed: {_first_line(exc)})"
            error = _try_decode(loaded, io) if decode.compiled else None
            if error:
                _uncompile(layers)
                decode.compiled, decode.compile_note = False, f"off (failed after capture: {error})"
        try:
            for length in sorted(chunk_lengths(prefill_io.shape[1]), reverse=True):
                decode.prefills[length] = _capture_prefill(loaded, prefill_io, length, pool, stream)
            if decode.prefills:
                decode.prefill_note = f"cuda-graph chunks {','.join(map(str, sorted(decode.prefills)))}"
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            decode.prefills.clear()
            _settle()
            decode.prefill_note = f"eager (capture failed: {_first_line(exc)})"
        return decode


def capture_adapters(
    loaded: LoadedModel, decode: Decode, io: torch.Tensor, prefill_io: torch.Tensor, bank: LoraBank
) -> None:
    """Capture the decode step for each bucket `decode` has a graph of, and the prefill for each
    chunk length, with the low-rank path of `bank`'s current layout: each row's adapter index read
    from io[2] (a prefill's from prefill_io[2, 2]), so any mix of rows replays them, and the
    factors read from the bank's buffers, so adapters loaded into the layout need no new capture.
    What cannot be captured runs eager, the reason in `adapter_note`."""
    decode.adapter_graphs, decode.adapter_prefills = {}, {}  # the stale ones' memory goes back
    decode.adapter_version = bank.version
    if not decode.graphs:
        decode.adapter_note = decode.graph_note
        return
    _settle()
    with _small_tuning_flush(loaded.device), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        try:
            for bucket in sorted(decode.graphs, reverse=True):
                decode.adapter_graphs[bucket] = _capture_decode(loaded, io, bucket, pool, stream, bank)
            for length in sorted(decode.prefills, reverse=True):
                decode.adapter_prefills[length] = _capture_prefill(
                    loaded, prefill_io, length, pool, stream, bank
                )
            decode.adapter_note = f"cuda-graph buckets and chunks, layout {bank.version}"
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            decode.adapter_graphs, decode.adapter_prefills = {}, {}
            _settle()
            decode.adapter_note = f"eager (capture failed: {_first_line(exc)})"


@contextmanager
def _small_tuning_flush(device: torch.device) -> Iterator[None]:
    """While the engine compiles on CUDA, inductor's autotuner flushes with TUNING_FLUSH_BYTES.

    Inductor times the candidate configs of each kernel it generates after zeroing a buffer the
    size of the L2: 60 MB on an H200, beside the weights and the KV cache, more than the whole
    20% memory margin of a small model. The kernels it tunes here are the decode layer's norms,
    rope and cache writes, whose inputs the kernel before them has just written: in a decode step
    they run from the L2, so timing them warm is no loss. The benchmarker reads an `L2_cache_size`
    set on the instance before the device's (torch 2.11-2.13); one without it is left alone.
    """
    if device.type != "cuda":
        yield
        return
    from torch._inductor.runtime import benchmarking

    state = benchmarking.benchmarker.__dict__
    saved = state.get("L2_cache_size")
    state["L2_cache_size"] = TUNING_FLUSH_BYTES
    try:
        yield
    finally:
        if saved is None:
            state.pop("L2_cache_size", None)
        else:
            state["L2_cache_size"] = saved


def _settle() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _compile_layers(loaded: LoadedModel, io: torch.Tensor) -> tuple[bool, str]:
    """Compile each decoder layer's decode step (one compiled code, shared by every layer), with
    exact ops and inductor rounding as eager does (exact_ops), so it gives the eager tokens."""
    layers = loaded.model.model.layers
    loaded.model.use_exact_ops(True)  # as _prepare does for every CUDA model, eager or not
    for layer in layers:
        layer.compile(fullgraph=True, dynamic=False, options=exact_ops.EMULATE_CASTS)
    error = _try_decode(loaded, io)
    if error is None:
        return True, "on (decode layer, inductor)"
    _uncompile(layers)
    return False, f"off (compile failed: {error})"


def _compile_step(loaded: LoadedModel, io: torch.Tensor) -> tuple[DecodeFn | None, str]:
    """The whole decode step as one inductor graph with a C++ wrapper (CPU), or None and why not.

    Per layer, eager decode dispatches about 60 small ops from Python, and a compiled layer
    pays a Python wrapper per kernel; one graph with a C++ wrapper calls its fused kernels and
    the matmuls from C++ (SmolLM2 int4, 2 threads: 6.4 against 11.6 ms a step). The number of
    keys attended and the batch are symbolic, so growing sequences do not compile again; a
    batch of one and a batch of more are two graphs (torch specializes size 1), both built here.
    """
    step = torch.compile(loaded.model.decode, fullgraph=True, dynamic=True, options={"cpp_wrapper": True})
    batches = sorted({1, min(2, loaded.model.slots)})
    for batch in batches:
        error = _try_decode(loaded, io, step, batch)
        if error is not None:
            return None, f"off (compile failed: {error})"
    return step, "on (decode step, inductor C++ wrapper)"


def compile_in_background(
    loaded: LoadedModel, decode: Decode, io: torch.Tensor, drafter: Drafter | None
) -> threading.Event:
    """Compile the CPU decode step on a thread of its own (then `drafter`'s, when given);
    `decode` takes it when it runs. The event is set once the compile has ended, compiled or
    fallen back to eager.

    The trial decodes read `io` (not the engine's inputs, which serving steps use meanwhile)
    and write only the scratch position, which no step attends to. The engine thread reads
    `decode.step` at each step, so it switches between two steps. A model unloaded meanwhile
    stays in memory until its compile ends; its result is then dropped with it.
    """
    done = threading.Event()
    decode.compile_note = "compiling in the background (eager steps until it is ready)"
    if drafter is not None:
        drafter.note = "eager (compiling in the background)"
    started = time.monotonic()

    def work() -> None:
        try:
            step, note = _compile_step(loaded, io)
        except Exception as exc:  # anything unforeseen: keep serving eager, say why
            step, note = None, f"off (compile failed: {_first_line(exc)})"
        decode.step = step  # before the note: the note never claims a step not in use
        took = f", ready after {time.monotonic() - started:.0f} s" if step is not None else ""
        decode.compile_note = note + took
        _log.info("%s: decode step compile %s", loaded.facts.name, decode.compile_note)
        if drafter is not None:
            compile_drafter(drafter, io)
        done.set()

    threading.Thread(target=work, name="sits-compile", daemon=True).start()
    return done


def compile_drafter(drafter: Drafter, io: torch.Tensor) -> None:
    """Compile the draft model's decode step as the model's (`_compile_step`); where it fails
    the draft decodes eager, and its note says why."""
    try:
        step, note = _compile_step(drafter.loaded, io)
    except Exception as exc:  # anything unforeseen: the draft proposes from eager steps
        step, note = None, f"off (compile failed: {_first_line(exc)})"
    drafter.step = step  # before the note, as for the model's step
    reason = note.removeprefix("off (").removesuffix(")")
    drafter.note = "compiled" if step is not None else f"eager ({reason})"
    if step is None:
        _log.warning("%s: the draft model decodes eager: %s", drafter.loaded.facts.name, note)


def _uncompile(layers: nn.ModuleList) -> None:
    for layer in layers:
        layer._compiled_call_impl = None  # what nn.Module.compile set: back to eager


@torch.inference_mode()
def _try_decode(
    loaded: LoadedModel, io: torch.Tensor, step: DecodeFn | None = None, batch: int = 1
) -> str | None:
    """One decode of `batch` rows at the scratch position, through `step` (with the keys up to
    two positions: 0 and 1 would be specialized) or the model's fixed-shape decode: None when
    it ran, else why not."""
    io[0, :batch] = 0
    io[1, :batch] = loaded.model.scratch_position
    tokens, positions = io[0, :batch], io[1, :batch]
    try:
        if step is None:
            loaded.model.decode(tokens, positions)
        else:
            step(tokens, positions, 2)
    except Exception as exc:  # torch.compile raises many kinds (no compiler, backend bugs)
        return _first_line(exc)
    return None


def _capture_decode(
    loaded: LoadedModel,
    io: torch.Tensor,
    bucket: int,
    pool: _POOL_HANDLE,
    stream: torch.cuda.Stream,
    bank: LoraBank | None = None,
) -> Graph:
    """A CUDA graph of one decode step over rows 0..bucket-1 reading `io`, and its logits; with
    `bank`, each row's adapter index read from io[2]."""
    io[0, :bucket] = 0
    io[1, :bucket] = loaded.model.scratch_position  # warm-up and capture write only there
    io[2, :bucket] = 0
    return _capture(lambda: decode_step(loaded, io, bucket, bank), pool, stream)


def decode_step(loaded: LoadedModel, io: torch.Tensor, bucket: int, bank: LoraBank | None) -> torch.Tensor:
    """One decode step over rows 0..bucket-1 as `io` [3, slots] holds it (tokens, positions, adapter
    indices), at fixed shapes: the logits [bucket, V]. With no `bank` the base alone."""
    tokens, positions = io[0, :bucket], io[1, :bucket]
    if bank is None:
        return loaded.model.decode(tokens, positions)
    with bank.select(io[2, :bucket]):
        return loaded.model.decode(tokens, positions)


def _capture_prefill(
    loaded: LoadedModel,
    io: torch.Tensor,
    length: int,
    pool: _POOL_HANDLE,
    stream: torch.cuda.Stream,
    bank: LoraBank | None = None,
) -> Graph:
    """A CUDA graph of one prefill chunk of `length` tokens reading `io` (see the engine's
    _run_prompt); with `bank`, the adapter's index read from io[2, 2]."""
    io[0] = 0
    io[1] = loaded.model.scratch_position  # warm-up and capture write only there
    io[2] = 0
    return _capture(lambda: prefill_chunk(loaded, io, length, bank), pool, stream)


def prefill_chunk(
    loaded: LoadedModel, io: torch.Tensor, length: int, bank: LoraBank | None = None
) -> torch.Tensor:
    """One prefill chunk of `length` tokens as `io` [3, chunk] holds it (see the engine's
    _run_prompt): the logits [1, V] of its last token. With `bank`, through the adapter of index
    io[2, 2]."""
    tokens, positions, slot, last = io[0:1, :length], io[1, :length], io[2, :1], io[2, 1:2]
    if bank is None:
        return loaded.model.prefill_fixed(tokens, slot, positions, last)
    with bank.select(io[2, 2:3]):
        return loaded.model.prefill_fixed(tokens, slot, positions, last)


def chunk_lengths(width: int) -> list[int]:
    """The prefill chunk lengths (PREFILL_BUCKETS) that fit a chunk buffer of `width` tokens, the
    shortest first; `width` itself when none does."""
    return [b for b in PREFILL_BUCKETS if b <= width] or [width]


@torch.inference_mode()
def _capture(run: Callable[[], torch.Tensor], pool: _POOL_HANDLE, stream: torch.cuda.Stream) -> Graph:
    """Warm `run` up on `stream`, then capture it there; the graph and its output."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(CAPTURE_WARMUP_RUNS):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = run()
    return graph, out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]
