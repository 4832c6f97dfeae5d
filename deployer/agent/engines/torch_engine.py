"""The torch implementation of `Engine`: our Llama-family model on CPU or CUDA.

The KV cache holds `slots` sequences. `prefill` runs a prompt into one slot (skipping what the
slot already holds), `step` advances many slots by one token each with fixed shapes: on CUDA a
CUDA graph per batch bucket replays it, the decoder layer compiled by inductor; tokens are
sampled on the device. `stream` is one slot driven the same way; its text goes through
`textstream` (whole characters only, stop strings held back), and the run ends on an EOS token
or a stop string ("stop") or on max_tokens or a full context ("length").
"""

from __future__ import annotations

import gc
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from deployer.agent.chat import ChatTemplate, TextCodec, read_tokenizer_config
from deployer.agent.engines.base import (
    ChatMessage,
    Engine,
    EngineInfo,
    SamplingParams,
    TokenEvent,
    common_prefix,
    token_budget,
)
from deployer.agent.engines.llama import as_token_ids
from deployer.agent.engines.loader import LoadedModel, load_model, read_json
from deployer.agent.engines.qlinear import KERNEL_LINEAR
from deployer.agent.engines.sampling import Sampler, choose, new_generator
from deployer.agent.engines.textstream import token_events
from deployer.errors import AgentError

DEFAULT_MAX_CONTEXT = 2048
WARMUP_MESSAGES = (ChatMessage("user", "Hello"),)
WARMUP_TOKENS = 4
# Batch sizes a decode step is captured for on CUDA; a step runs the smallest bucket that holds
# its highest slot.
GRAPH_BUCKETS = (1, 2, 4, 8, 16)
DEFAULT_SLOTS = {"cuda": 16, "cpu": 4}
# Eager runs before a capture: the first compiles (when compiled), the others settle allocations.
CAPTURE_WARMUP_RUNS = 3


@dataclass
class _Slot:
    """What one cache slot holds: `held` ids are in the KV cache at positions 0..len-1; `last` is
    the newest token, not yet in the cache (None: the slot is not running)."""

    held: list[int] = field(default_factory=list)
    last: int | None = None
    sampler: Sampler | None = None


@dataclass
class _Decode:
    """How decode steps run, and why (shown by describe())."""

    compiled: bool = False
    compile_note: str = "off"
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = field(default_factory=dict)
    graph_note: str = "eager"


class TorchEngine(Engine):
    """Runs an artifact with the torch model of `llama.py`: `slots` sequences, batched decode."""

    def __init__(
        self,
        *,
        device: str = "cpu",
        dtype: str = "auto",
        max_context: int = DEFAULT_MAX_CONTEXT,
        threads: int | None = None,
        slots: int | None = None,
        compile: str = "auto",
        cuda_graphs: bool = True,
        graph_buckets: Sequence[int] = GRAPH_BUCKETS,
    ) -> None:
        """`dtype` is "auto", "fp32", "bf16" or "fp16"; `max_context` caps the KV cache of each of
        `slots` sequences (default 16 on CUDA, 4 on CPU); `threads` sets torch's (process-wide)
        intra-op thread count when given.

        `compile` is "auto", "on" or "off": auto compiles the decode layer on CUDA only, because on
        a CPU inductor's build takes about 40 s at every start for 12-24% faster decode and needs a
        C++ compiler on the device. `cuda_graphs` captures the decode step per batch bucket.
        """
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise AgentError("device cuda was asked for but torch sees no CUDA device")
        if compile not in ("auto", "on", "off"):
            raise AgentError(f"compile must be auto, on or off, not {compile!r}")
        kind = "cuda" if device.startswith("cuda") else "cpu"
        self._device, self._dtype, self._max_context = device, dtype, max_context
        self._threads = threads
        self._slots = slots or DEFAULT_SLOTS[kind]
        if self._slots < 1:
            raise AgentError(f"slots must be at least 1, got {self._slots}")
        self._want_compile = compile == "on" or (compile == "auto" and kind == "cuda")
        self._want_graphs = cuda_graphs and kind == "cuda"
        self._buckets = tuple(sorted({b for b in graph_buckets if 0 < b < self._slots} | {self._slots}))
        self._loaded: LoadedModel | None = None
        self._codec: TextCodec | None = None
        self._template: ChatTemplate | None = None
        self._eos: frozenset[int] = frozenset()
        self._busy = threading.Lock()
        self._state: list[_Slot] = []
        self._decode = _Decode()
        self._io: torch.Tensor | None = None  # [2, slots] tokens and positions the step reads
        self._io_host: torch.Tensor | None = None
        self._reused = 0

    # -- lifecycle ---------------------------------------------------------------------------

    def load(self, artifact_dir: Path) -> None:
        """Load weights (memory-mapped), tokenizer and chat template from `artifact_dir`, then
        prepare the decode step (compile, CUDA graphs)."""
        if self._threads:
            torch.set_num_threads(self._threads)
        loaded = load_model(
            artifact_dir,
            device=self._device,
            dtype=self._dtype,
            max_context=self._max_context,
            slots=self._slots,
        )
        codec = TextCodec.from_dir(artifact_dir)
        tok_config = read_tokenizer_config(artifact_dir)
        self._template = ChatTemplate.from_dir(artifact_dir)
        self._eos = frozenset(
            set(loaded.args.eos_token_ids) | _generation_eos(artifact_dir) | codec.eos_ids(tok_config)
        )
        self._codec = codec
        self.attach(loaded)

    def attach(self, loaded: LoadedModel) -> None:
        """Serve a model built elsewhere (benchmarks on random weights: ids in, ids out, no text).

        Its cache must have been set up for this engine's slots.
        """
        if loaded.model.slots != self._slots:
            raise AgentError(
                f"the model's cache holds {loaded.model.slots} slots, the engine wants {self._slots}"
            )
        self._loaded = loaded
        self._state = [_Slot() for _ in range(self._slots)]
        self._io = torch.zeros((2, self._slots), dtype=torch.long, device=loaded.device)
        pin = loaded.device.type == "cuda"
        self._io_host = torch.zeros((2, self._slots), dtype=torch.long, pin_memory=pin)
        self._decode = _prepare_decode(loaded, self._io, self._buckets, self._want_compile, self._want_graphs)

    def warmup(self) -> None:
        """A short greedy generation, so kernels and allocations are ready for the first request."""
        prompt = self.chat_prompt(WARMUP_MESSAGES) if self._template else self.encode("Hello")
        for _ in self.stream(prompt, SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0)):
            pass

    def unload(self) -> None:
        """Drop the model, its caches and graphs; the engine cannot be used afterwards.

        A generation still running keeps its own reference and frees the model when it ends.
        """
        self._loaded = self._codec = self._template = None
        self._decode, self._io, self._io_host, self._state = _Decode(), None, None, []
        gc.collect()
        if self._device.startswith("cuda"):
            torch.cuda.empty_cache()

    # -- text ------------------------------------------------------------------------------

    def chat_prompt(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Messages formatted with the model's chat template, then tokenized."""
        self._require_text()
        if self._template is None:
            raise AgentError(
                "this model has no chat template", hint="use /v1/completions with a plain prompt"
            )
        text = self._template.render(messages, add_generation_prompt=True)
        return self._codec.encode(text, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        """Plain text to ids, with the tokenizer's own special tokens (e.g. BOS) if it adds any."""
        return self._require_text().encode(text, add_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        """Ids to text, special tokens left out."""
        return self._require_text().decode(ids)

    @property
    def end_ids(self) -> frozenset[int]:
        """EOS and end-of-turn ids (config.json, generation_config.json, tokenizer config)."""
        return self._eos

    # -- batched steps ---------------------------------------------------------------------

    @property
    def max_slots(self) -> int:
        """How many sequences the KV cache holds."""
        return self._slots

    @torch.inference_mode()
    def prefill(self, slot: int, prompt: Sequence[int], params: SamplingParams) -> int:
        """Start `slot` on `prompt`; see Engine.prefill. The part of the prompt that the slot's
        cache already holds (a shared system prompt, the earlier turns of a chat) is not run again."""
        loaded = self._require()
        state = self._slot(slot)
        token_budget(prompt, params, loaded.model.max_len)
        prompt = list(prompt)
        # At least the last prompt token runs: its logits give the first new token.
        start = min(common_prefix(state.held, prompt), len(prompt) - 1)
        ids = torch.tensor([prompt[start:]], dtype=torch.long, device=loaded.device)
        logits = loaded.model.prefill(ids, slot, start)[0]
        sampler = Sampler(params, new_generator(params.seed, loaded.device))
        token = choose(logits, [sampler])[0]
        self._reused += start
        state.held, state.last, state.sampler = prompt, token, sampler
        return token

    @torch.inference_mode()
    def step(self, slots: Sequence[int]) -> list[int]:
        """One decode step for each running slot in `slots`; see Engine.step.

        The step runs cache rows 0..max(slots) together (a captured graph on CUDA), so a scheduler
        that fills the lowest free slots first runs the smallest batches.
        """
        loaded = self._require()
        states = [self._slot(s) for s in slots]
        if not slots or len(set(slots)) != len(slots):
            raise AgentError(f"step needs distinct slots, got {list(slots)}")
        for s, state in zip(slots, states, strict=True):
            if state.last is None:
                raise AgentError(f"slot {s} is not running", hint="prefill it first")
            if len(state.held) >= loaded.model.max_len:
                raise AgentError(
                    f"slot {s} has filled its {loaded.model.max_len} cache positions",
                    hint="stop at the token budget (token_budget) or release the slot",
                )
        rows = max(slots) + 1
        bucket = next((b for b in self._buckets if b >= rows), rows) if self._decode.graphs else rows
        host = self._io_host
        host[0, :bucket] = 0
        host[1, :bucket] = loaded.model.scratch_position
        for s, state in zip(slots, states, strict=True):
            host[0, s], host[1, s] = state.last, len(state.held)
        self._io[:, :bucket].copy_(host[:, :bucket], non_blocking=True)
        graph = self._decode.graphs.get(bucket)
        if graph is not None:
            graph[0].replay()
            logits = graph[1]
        else:
            # Eager layers attend only the positions in use; compiled ones keep the fixed shapes,
            # or every new length would compile again.
            kv_len = None if self._decode.compiled else max(len(state.held) for state in states) + 1
            logits = loaded.model.decode(self._io[0, :bucket], self._io[1, :bucket], kv_len)
        tokens = choose(logits[: max(slots) + 1], _samplers_for(states, slots))
        out = []
        for s, state in zip(slots, states, strict=True):
            state.held.append(state.last)
            state.last = tokens[s]
            out.append(tokens[s])
        return out

    def release(self, slot: int) -> None:
        """End the sequence in `slot`; its cached prefix stays for the next prefill to reuse."""
        state = self._slot(slot)
        state.last = state.sampler = None

    def _slot(self, slot: int) -> _Slot:
        self._require()
        if not isinstance(slot, int) or not 0 <= slot < self._slots:
            raise AgentError(f"slot {slot!r} does not exist: this engine has slots 0..{self._slots - 1}")
        return self._state[slot]

    # -- generation ------------------------------------------------------------------------

    def stream(self, prompt: list[int], params: SamplingParams) -> Iterator[TokenEvent]:
        """Generate from `prompt` in slot 0; see Engine.stream. Raises AgentError for a prompt that
        does not fit the context, bad sampling parameters, or a call while another generation runs."""
        loaded = self._require()
        return self._generate(prompt, params, token_budget(prompt, params, loaded.model.max_len))

    def _generate(self, prompt: list[int], params: SamplingParams, budget: int) -> Iterator[TokenEvent]:
        # Taken on the first next(), inside the generator, so an iterator that is never started
        # holds nothing; closing or dropping it mid-run releases it (finally).
        if not self._busy.acquire(blocking=False):
            raise AgentError("the engine is already generating", hint="serialize calls to stream()")
        try:
            yield from token_events(
                self._tokens(prompt, params),
                self._require_text().decode,
                stops=params.stop,
                end_ids=self._eos,
                budget=budget,
            )
        finally:
            if self._loaded is not None:
                self.release(0)
            self._busy.release()

    def _tokens(self, prompt: list[int], params: SamplingParams) -> Iterator[int]:
        yield self.prefill(0, prompt, params)
        while True:
            yield self.step([0])[0]

    @torch.inference_mode()
    def logits(self, tokens: list[int]) -> torch.Tensor:
        """fp32 logits [T, V] of every position of `tokens`, run in slot 0 (tests, quality checks)."""
        loaded = self._require()
        with self._busy:
            ids = torch.tensor([tokens], dtype=torch.long, device=loaded.device)
            out = loaded.model.prefill(ids, 0, 0, all_logits=True)[0].float().cpu()
            self._state[0] = _Slot(held=list(tokens))
            return out

    # -- facts -----------------------------------------------------------------------------

    @property
    def layer_kernels(self) -> dict[str, str]:
        """The kernel each linear layer runs, by module name."""
        return dict(self._require().kernels)

    def describe(self) -> EngineInfo:
        """Model, quantization, the matmul kernel in use, device, context, and how decode runs."""
        loaded = self._require()
        counts = Counter(k for name, k in loaded.kernels.items() if name != "lm_head")
        kernel = "+".join(sorted(counts)) if counts else KERNEL_LINEAR
        return EngineInfo(
            engine="torch",
            model=loaded.facts.name,
            version=loaded.facts.version,
            quantization=loaded.facts.quantization,
            kernel=kernel,
            device=loaded.device.type,
            context_length=loaded.model.max_len,
            extra={
                "dtype": str(loaded.dtype).removeprefix("torch."),
                "threads": str(torch.get_num_threads()),
                "kernels": ", ".join(f"{k}={n}" for k, n in sorted(counts.items())),
                "architecture": loaded.args.architecture,
                "slots": str(self._slots),
                "decode": self._decode.graph_note,
                "compile": self._decode.compile_note,
                "prefix_tokens_reused": str(self._reused),
            },
        )

    def _require(self) -> LoadedModel:
        if self._loaded is None:
            raise AgentError("no model is loaded in this engine", hint="call load() first")
        return self._loaded

    def _require_text(self) -> TextCodec:
        self._require()
        if self._codec is None:
            raise AgentError("this engine was given a model without a tokenizer", hint="use load()")
        return self._codec


_GREEDY = Sampler(SamplingParams(temperature=0), torch.Generator())


def _samplers_for(states: Sequence[_Slot], slots: Sequence[int]) -> list[Sampler]:
    """A sampler per cache row 0..max(slots); rows outside the step take the (free) argmax."""
    rows = [_GREEDY] * (max(slots) + 1)
    for s, state in zip(slots, states, strict=True):
        rows[s] = state.sampler
    return rows


def _prepare_decode(
    loaded: LoadedModel, io: torch.Tensor, buckets: Sequence[int], want_compile: bool, want_graphs: bool
) -> _Decode:
    """Compile the decode layer and capture the step per bucket where asked and possible; each
    step that cannot falls back to eager, with the reason kept for describe()."""
    decode = _Decode()
    layers = loaded.model.model.layers
    if want_compile:
        decode.compiled, decode.compile_note = _compile_layers(loaded, io)
    if not want_graphs:
        decode.graph_note = (
            "eager (CUDA graphs are for CUDA devices)" if loaded.device.type != "cuda" else "eager (off)"
        )
        return decode
    pool = torch.cuda.graph_pool_handle()
    scratch = loaded.model.scratch_position
    try:
        for bucket in sorted(buckets, reverse=True):  # the largest first: the others fit in its pool
            decode.graphs[bucket] = _capture(loaded, io, bucket, scratch, pool)
        decode.graph_note = f"cuda-graph buckets {','.join(map(str, sorted(decode.graphs)))}"
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
        # Out of memory (or a kernel that cannot be captured): eager steps still work.
        decode.graphs.clear()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        decode.graph_note = f"eager (capture failed: {_first_line(exc)})"
        error = _try_decode(loaded, io) if decode.compiled else None
        if error:
            _uncompile(layers)
            decode.compiled, decode.compile_note = False, f"off (failed after capture: {error})"
    return decode


def _compile_layers(loaded: LoadedModel, io: torch.Tensor) -> tuple[bool, str]:
    """Compile each decoder layer's decode step (one compiled code, shared by every layer)."""
    layers = loaded.model.model.layers
    for layer in layers:
        layer.compile(fullgraph=True, dynamic=False)
    error = _try_decode(loaded, io)
    if error is None:
        return True, "on (decode layer, inductor)"
    _uncompile(layers)
    return False, f"off (compile failed: {error})"


def _uncompile(layers: nn.ModuleList) -> None:
    for layer in layers:
        layer._compiled_call_impl = None  # what nn.Module.compile set: back to eager


@torch.inference_mode()
def _try_decode(loaded: LoadedModel, io: torch.Tensor) -> str | None:
    """One batch-1 decode at the scratch position: None when it ran, else why not."""
    io[0, :1] = 0
    io[1, :1] = loaded.model.scratch_position
    try:
        loaded.model.decode(io[0, :1], io[1, :1])
    except Exception as exc:  # torch.compile raises many kinds (no compiler, backend bugs)
        return _first_line(exc)
    return None


@torch.inference_mode()
def _capture(
    loaded: LoadedModel, io: torch.Tensor, bucket: int, scratch: int, pool: object
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph of one decode step over rows 0..bucket-1 reading `io`, and its logits."""
    io[0, :bucket] = 0
    io[1, :bucket] = scratch  # warm-up and capture write only the scratch position
    tokens, positions = io[0, :bucket], io[1, :bucket]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(CAPTURE_WARMUP_RUNS):
            loaded.model.decode(tokens, positions)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        logits = loaded.model.decode(tokens, positions)
    return graph, logits


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def _generation_eos(directory: Path) -> set[int]:
    path = directory / "generation_config.json"
    if not path.is_file():
        return set()
    return set(as_token_ids(read_json(path).get("eos_token_id")))
