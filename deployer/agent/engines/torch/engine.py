"""The torch implementation of `Engine`: our Llama-family model on CPU or CUDA.

The KV cache holds `slots` sequences. `prefill` runs a prompt into one slot (skipping what the
slot already holds), `step` advances many slots by one token each with fixed shapes: on CUDA a
CUDA graph per batch bucket replays it, the decoder layer compiled by inductor; tokens are
sampled on the device. A step with rows on LoRA adapters replays graphs of its own, captured with
the adapters' low-rank path (engines/torch/lora.py). `stream` is one slot driven the same way;
its text goes through `textstream` (whole characters only, stop strings held back), and the run
ends on an EOS token or a stop string ("stop") or on max_tokens or a full context ("length").
"""

from __future__ import annotations

import gc
import logging
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from llguidance import LLTokenizer

from deployer.agent.chat import ChatTemplate, TextCodec, infill_prompt, read_tokenizer_config
from deployer.agent.engines.base import (
    Embedding,
    Engine,
    in_pieces,
    longest_prefix_slot,
    prefix_donor,
    token_budget,
    token_of,
)
from deployer.agent.engines.logits import TokenProcessor, Vocabulary
from deployer.agent.engines.textstream import token_events
from deployer.agent.engines.torch import native
from deployer.agent.engines.torch.compile import (
    Decode,
    capture_adapters,
    chunk_lengths,
    compile_drafter,
    compile_in_background,
    decode_step,
    prefill_chunk,
    prepare_decode,
)
from deployer.agent.engines.torch.loader import (
    LoadedModel,
    load_draft,
    load_model,
    read_json,
)
from deployer.agent.engines.torch.lora import LoraBank
from deployer.agent.engines.torch.model import KV_CACHE_TYPES, as_token_ids
from deployer.agent.engines.torch.qlinear import KERNEL_LINEAR
from deployer.agent.engines.torch.sampling import Sampler, choose, new_generator
from deployer.agent.engines.torch.speculative import DRAFT_TOKENS, Drafter, accepted_run
from deployer.agent.types import ChatMessage, EngineInfo, SamplingParams, TokenEvent, TokenLogprobs
from deployer.core.lora import LoraAdapter
from deployer.core.memory import release_freed_heap
from deployer.errors import AgentError

_log = logging.getLogger("sits.agent")

DEFAULT_MAX_CONTEXT = 2048
WARMUP_MESSAGES = (ChatMessage("user", "Hello"),)
WARMUP_TOKENS = 4
# Batch sizes a decode step is captured for on CUDA; a step runs the smallest bucket that holds
# its highest slot.
GRAPH_BUCKETS = (1, 2, 4, 8, 16)
DEFAULT_SLOTS = {"cuda": 16, "cpu": 4}


@dataclass
class _Slot:
    """What one cache slot holds: `held` ids are in the KV cache at positions 0..len-1; `last` is
    the newest token, not yet in the cache (None: the slot is not running). `ahead` are tokens a
    speculative round decided that the next steps return, oldest first, `last` among them: the
    cache already holds the ones before it."""

    held: list[int] = field(default_factory=list)
    last: int | None = None
    sampler: Sampler | None = None
    ahead: list[int] = field(default_factory=list)
    adapter: str | None = None  # the adapter `held` was computed with (its K and V depend on it)


@dataclass(frozen=True)
class _Inputs:
    """What the captured graphs read, and the pinned host buffers they are filled from: `step`
    [3, slots] tokens, positions and adapter indices (LoraBank.index); `prefill` [3, chunk]
    tokens, positions, then the slot, the index of the chunk's last token and the adapter index."""

    step: torch.Tensor
    step_host: torch.Tensor
    prefill: torch.Tensor
    prefill_host: torch.Tensor

    @classmethod
    def allocate(cls, slots: int, chunk: int, device: torch.device) -> _Inputs:
        """Zeroed buffers on `device`, the host ones pinned when it is a GPU."""
        pin = device.type == "cuda"

        def pair(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
            shape = (rows, cols)
            return torch.zeros(shape, dtype=torch.long, device=device), torch.zeros(
                shape, dtype=torch.long, pin_memory=pin
            )

        return cls(*pair(3, slots), *pair(3, chunk))


@dataclass(frozen=True)
class _Text:
    """What load() read for text: the tokenizer, the chat template (None: the model has none),
    the vocabulary for logit processing, and the ids that end generation."""

    codec: TextCodec
    template: ChatTemplate | None
    vocab: Vocabulary
    end_ids: frozenset[int]


@dataclass(frozen=True)
class _Attached:
    """One model as attach() set it up, dropped whole by unload(): an unloaded engine has none.

    `text` and `drafter` come from load(); a model attached alone (built elsewhere) has neither,
    and `draft_off` says why there is no drafter (describe)."""

    loaded: LoadedModel
    slots: list[_Slot]
    io: _Inputs
    decode: Decode
    lora: LoraBank
    text: _Text | None = None
    drafter: Drafter | None = None
    draft_off: str = "off"
    # torch's intra-op threads on the engine thread, where every step runs: describe() may be
    # called from any thread, and torch keeps the setting per thread.
    threads: int = 1


def choose_device(device: str) -> tuple[str, str]:
    """(the torch device to run on, why): "auto" is CUDA when torch sees a CUDA device, else the
    CPU; any other name is taken as asked.

    Raises AgentError when CUDA is asked for and torch sees none: an explicit choice must not fall
    back to a CPU that may be many times slower without anyone noticing.
    """
    if device == "auto":
        if torch.cuda.is_available():
            return "cuda", f"cuda (auto: torch sees {torch.cuda.get_device_name()})"
        # A CPU-only torch build (a pip wheel on a Jetson, say) and a missing driver look alike
        # to is_available(); which one it is decides what the operator should fix.
        built = torch.version.cuda is not None or torch.version.hip is not None
        why = "torch sees no CUDA device" if built else "this torch is built without CUDA"
        return "cpu", f"cpu (auto: {why})"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise AgentError(
            "device cuda was asked for but torch sees no CUDA device",
            hint="set device: auto (the GPU where torch sees one, else the CPU) or device: cpu; "
            "or check the GPU driver and that this torch is built with CUDA",
        )
    return device, f"{device} (asked for)"


class TorchEngine(Engine):
    """Runs an artifact with the torch model of `model.py`: `slots` sequences, batched decode."""

    serves_adapters = True

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
        quantize_head: bool | None = None,
        background_compile: bool = False,
        draft: str = "off",
        kv_cache_type: str = "auto",
    ) -> None:
        """`device` is "cpu", "cuda" (or "cuda:N") or "auto": CUDA when torch sees a CUDA device,
        else the CPU (`choose_device`; `extra["device_choice"]` in `describe()` says which and why).
        `dtype` is "auto", "fp32", "bf16" or "fp16"; `max_context` caps the KV cache of each of
        `slots` sequences (default 16 on CUDA, 4 on CPU); `threads` sets torch's (process-wide)
        intra-op thread count when given.

        `compile` is "auto", "on" or "off": auto compiles the decode layer on CUDA only. On a CPU
        "on" compiles the whole decode step into one C++ graph (compile.py), which decoded
        SmolLM2 int4 1.8x faster than eager, but its first build takes about a minute on two cores
        (seconds once inductor's on-disk cache holds it) and needs a C++ compiler on the device,
        so auto leaves it off there. `cuda_graphs` captures the decode step per batch bucket.
        `quantize_head` runs the output head on int8 weights derived at load; None (auto) does so
        on a CPU for integer-quantized models (see loader.build_model). `background_compile`
        (the agent's choice) compiles that CPU step on a thread of its own after load: the engine
        serves eager steps meanwhile and switches between two steps once the compiled one runs,
        so a first compile of minutes never holds up readiness (`wait_compiled`).

        `draft` "int4" decodes a lone greedy sequence speculatively (engines/torch/speculative.py): an
        int4 copy of the model made at load proposes up to DRAFT_TOKENS tokens, and one pass of the
        model checks them all. CPU only; "off" (the default) decodes one token a step.

        `kv_cache_type` stores the KV cache as "fp32", "fp16", "bf16" or "int8" (per position and
        head, CPU only: on CUDA, where device auto may land, the cache is then the model's dtype
        and describe() says why); "auto" is fp32 on a CPU, the model's dtype on CUDA. On a CPU
        attention runs in fp32 whatever the storage (see model.KVCache).
        """
        device, self._device_choice = choose_device(device)
        if compile not in ("auto", "on", "off"):
            raise AgentError(f"compile must be auto, on or off, not {compile!r}")
        kind = "cuda" if device.startswith("cuda") else "cpu"
        self._device, self._dtype, self._max_context = device, dtype, max_context
        self._threads = threads
        self._quantize_head = quantize_head
        self._slots = slots or DEFAULT_SLOTS[kind]
        if self._slots < 1:
            raise AgentError(f"slots must be at least 1, got {self._slots}")
        if draft not in ("off", "int4"):
            raise AgentError(f"draft must be off or int4, not {draft!r}")
        self._draft_scheme = draft
        self._draft_off = "off"  # why there is no drafter (describe)
        if draft != "off" and kind == "cuda":
            # device auto may land here: the model serves, only without a draft.
            self._draft_scheme = "off"
            why = f"{draft} asked for: the draft is for CPU devices, this model runs on {device}"
            self._draft_off = f"off ({why})"
        if kv_cache_type not in ("auto", *KV_CACHE_TYPES):
            raise AgentError(
                f"kv_cache_type must be auto or one of {', '.join(KV_CACHE_TYPES)}, not {kv_cache_type!r}"
            )
        self._kv_cache_type, self._kv_note = kv_cache_type, ""
        if kv_cache_type == "int8" and kind == "cuda":
            self._kv_cache_type = "auto"
            why = f"int8 asked for: an int8 cache is for CPU devices, this model runs on {device}"
            self._kv_note = f" ({why})"
        self._want_compile = compile == "on" or (compile == "auto" and kind == "cuda")
        self._want_graphs = cuda_graphs and kind == "cuda"
        self._background = background_compile and kind == "cpu" and self._want_compile
        self._compiled = threading.Event()  # set once no compile is in progress
        self._compiled.set()
        self._buckets = tuple(sorted({b for b in graph_buckets if 0 < b < self._slots} | {self._slots}))
        self._attached: _Attached | None = None  # set by load() or attach(), dropped by unload()
        self._busy = threading.Lock()
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
            quantize_head=self._quantize_head,
            kv_cache_type=self._kv_cache_type,
        )
        codec = TextCodec.from_dir(artifact_dir)
        tok_config = read_tokenizer_config(artifact_dir)
        end_ids = frozenset(
            set(loaded.args.eos_token_ids) | _generation_eos(artifact_dir) | codec.eos_ids(tok_config)
        )
        text = _Text(
            codec,
            ChatTemplate.from_dir(artifact_dir),
            _vocabulary(codec, loaded.args.vocab_size, end_ids),
            end_ids,
        )
        # Before attaching, which compiles the draft's step with the model's (in the background too).
        drafter, draft_off = (
            self._load_draft(artifact_dir) if self._draft_scheme != "off" else (None, self._draft_off)
        )
        self._attach(loaded, text, drafter, draft_off)

    def attach(self, loaded: LoadedModel) -> None:
        """Serve a model built elsewhere (benchmarks on random weights: ids in, ids out, no text).

        Its cache must have been set up for this engine's slots.
        """
        self._attach(loaded, None, None, self._draft_off)

    def _attach(
        self, loaded: LoadedModel, text: _Text | None, drafter: Drafter | None, draft_off: str
    ) -> None:
        """Prepare the decode step of `loaded` (compile, CUDA graphs), then serve it."""
        if loaded.model.slots != self._slots:
            raise AgentError(
                f"the model's cache holds {loaded.model.slots} slots, the engine wants {self._slots}"
            )
        io = _Inputs.allocate(self._slots, chunk_lengths(loaded.model.max_len)[-1], loaded.device)
        decode = prepare_decode(
            loaded,
            io.step,
            io.prefill,
            self._buckets,
            self._want_compile and not self._background,
            self._want_graphs,
        )
        if self._background:
            self._compiled = compile_in_background(loaded, decode, torch.zeros_like(io.step), drafter)
        elif self._want_compile and drafter is not None:
            compile_drafter(drafter, torch.zeros_like(io.step))
        if loaded.device.type == "cuda":
            torch.cuda.empty_cache()  # hand back what compiling and tuning left in the cache
        slots = [_Slot() for _ in range(self._slots)]
        threads = torch.get_num_threads()
        lora = LoraBank(loaded.model, loaded.device, loaded.dtype)
        self._attached = _Attached(loaded, slots, io, decode, lora, text, drafter, draft_off, threads)

    def _load_draft(self, artifact_dir: Path) -> tuple[Drafter | None, str]:
        """(the draft model of speculative decoding, None where the model cannot have one: it is
        stored in int4; why there is none, "" when there is one) for describe() and the journal."""
        try:
            draft = load_draft(
                artifact_dir,
                device=self._device,
                max_context=self._max_context,
                kv_cache_type=self._kv_cache_type,
            )
        except AgentError as exc:
            _log.warning("%s: no draft model: %s", artifact_dir.name, exc.message)
            return None, f"off ({exc.message})"
        return Drafter(draft), ""

    def load_adapter(self, key: str, adapter: LoraAdapter, directory: Path) -> None:
        """See Engine.load_adapter: its low-rank path beside the base layers (engines/torch/lora.py).

        An adapter that fits the stacked buffers' layout is written into them in place, which the
        captured adapter graphs read; one that grows the layout has them captured again here
        (between steps, on the engine thread), so no step runs eager for want of a graph."""
        attached = self._require()
        attached.lora.add(key, adapter)
        _forget_prefixes(attached, key)  # a key loaded again: its slots hold the old one's keys
        decode = attached.decode
        if attached.lora.version != decode.adapter_version and self._want_graphs:
            io = attached.io
            capture_adapters(attached.loaded, decode, io.step, io.prefill, attached.lora)

    def unload_adapter(self, key: str) -> None:
        """See Engine.unload_adapter. Slots whose cached prefix was computed with it forget it."""
        attached = self._require()
        _forget_prefixes(attached, key)
        attached.lora.remove(key)

    def wait_compiled(self, timeout_s: float | None = None) -> bool:
        """Wait for a compile running in the background (see `background_compile`; the draft
        model's too) to end, compiled or fallen back to eager; True when none is running (any
        longer)."""
        return self._compiled.wait(timeout_s)

    def warmup(self) -> None:
        """A short greedy generation, so kernels and allocations are ready for the first request."""
        prompt = self.chat_prompt(WARMUP_MESSAGES) if self._require_text().template else self.encode("Hello")
        for _ in self.stream(prompt, SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0)):
            pass

    def unload(self) -> None:
        """Drop the model, its caches and graphs; the engine cannot be used afterwards.

        A generation still running keeps its own reference and frees the model when it ends.
        """
        self._attached = None
        gc.collect()
        release_freed_heap()  # an unload-first swap loads the next model into the memory freed
        if self._device.startswith("cuda"):
            torch.cuda.empty_cache()

    # -- text ------------------------------------------------------------------------------

    def chat_prompt(self, messages: Sequence[ChatMessage], tools: Sequence[dict] | None = None) -> list[int]:
        """Messages (and tools) formatted with the model's chat template, then tokenized."""
        text = self._require_text()
        if text.template is None:
            raise AgentError(
                "this model has no chat template", hint="use /v1/completions with a plain prompt"
            )
        rendered = text.template.render(messages, add_generation_prompt=True, tools=tools)
        return text.codec.encode(rendered, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        """Plain text to ids, with the tokenizer's own special tokens (e.g. BOS) if it adds any."""
        return self._require_text().codec.encode(text, add_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        """Ids to text, special tokens left out."""
        return self._require_text().codec.decode(ids)

    def infill_prompt(self, prefix: str, suffix: str) -> list[int]:
        """The fill-in-the-middle prompt, with the tokenizer's FIM tokens (AgentError without)."""
        codec = self._require_text().codec
        return infill_prompt(
            codec.token_id, lambda text: codec.encode(text, add_special_tokens=False), prefix, suffix
        )

    def embed_pieces(self, texts: Sequence[str]) -> Embedding:
        """Mean of the last hidden states over each text's tokens, L2-normalised, in pieces; see
        Engine.embed_pieces. Runs outside the KV cache: no slot is needed or disturbed."""
        loaded, codec = self._require().loaded, self._require_text().codec
        vectors: list[list[float]] = []
        count = 0
        inputs = (codec.encode(text, add_special_tokens=True) for text in texts)
        for i, piece in enumerate(in_pieces(inputs, len)):
            if i:
                yield  # decode steps run here
            for ids in piece:
                if not ids or len(ids) > loaded.model.max_len:
                    raise AgentError(
                        f"an input has {len(ids)} tokens; embeddings take 1..{loaded.model.max_len}",
                        param="input",
                    )
                vectors.append(self._embed_one(loaded, ids))
                count += len(ids)
        return vectors, count

    @torch.inference_mode()
    def _embed_one(self, loaded: LoadedModel, ids: list[int]) -> list[float]:
        tokens = torch.tensor([ids], dtype=torch.long, device=loaded.device)
        mean = loaded.model.hidden_states(tokens)[0].float().mean(dim=0)
        return (mean / mean.norm().clamp_min(1e-12)).cpu().tolist()

    @property
    def end_ids(self) -> frozenset[int]:
        """EOS and end-of-turn ids (config.json, generation_config.json, tokenizer config); none
        without a loaded tokenizer."""
        attached = self._attached
        return attached.text.end_ids if attached is not None and attached.text is not None else frozenset()

    # -- batched steps ---------------------------------------------------------------------

    @property
    def max_slots(self) -> int:
        """How many sequences the KV cache holds."""
        return self._slots

    def choose_slot(self, free: Sequence[int], prompt: Sequence[int]) -> int:
        """See Engine.choose_slot: the free slot holding the longest prefix of `prompt`."""
        return longest_prefix_slot(free, prompt, [state.held for state in self._require().slots])

    def prefill(self, slot: int, prompt: Sequence[int], params: SamplingParams) -> int:
        """Start `slot` on `prompt`; see Engine.prefill and prefill_many."""
        return token_of(self.prefill_many([(slot, prompt, params)])[0])

    @torch.inference_mode()
    def prefill_many(
        self, items: Sequence[tuple[int, Sequence[int], SamplingParams]]
    ) -> list[int | Exception]:
        """Start several (slot, prompt, params); see Engine.prefill_many. The part of a prompt that
        its slot's cache holds (a shared system prompt, the earlier turns of a chat) is not run
        again; when another slot holds a longer part (SHARE_FROM tokens more), its cache rows are
        copied over, a prompt run earlier in this call included (clients of one app sending the
        same prompt). A prompt with more than its last token left runs as a prefill; those with only
        the last token left run together in one decode step, as a batch runs (so four cached
        prompts cost about one step, not four prefills), and the same way when alone."""
        attached = self._require()
        slots = [slot for slot, _, _ in items]
        if len(set(slots)) != len(slots):
            raise AgentError(f"slots {slots} name a slot twice")
        results: dict[int, int | Exception] = {}
        last_only: list[tuple[int, _Slot]] = []
        for slot, prompt, params in items:
            try:
                state, ids, start = self._prepare_prompt(attached, slot, prompt, params)
                generator = new_generator(params.seed, attached.loaded.device)
                sampler = Sampler(params, generator, _processor(attached.text, params))
                if start < len(ids) - 1:
                    logits = self._run_prompt(attached, slot, ids, start)
                    state.held, state.last = ids, token_of(choose(logits, [sampler])[0])
                    state.sampler = sampler
                    results[slot] = state.last
                else:
                    state.held, state.last, state.sampler = ids[:-1], ids[-1], sampler
                    last_only.append((slot, state))
            except Exception as exc:  # this request alone
                results[slot] = exc
        if last_only:
            results.update(self._advance(attached, last_only))
        return [results[slot] for slot in slots]

    def _prepare_prompt(
        self, attached: _Attached, slot: int, prompt: Sequence[int], params: SamplingParams
    ) -> tuple[_Slot, list[int], int]:
        """Check `prompt` for `slot` and give the slot's cache the longest prefix of it that any
        slot holds; (the slot's state, the prompt, how many leading tokens its cache holds now)."""
        loaded, state = attached.loaded, self._slot(slot)
        token_budget(prompt, params, loaded.model.max_len)
        ids = list(prompt)
        vocabulary = loaded.model.args.vocab_size
        if bad := next((t for t in ids if not 0 <= t < vocabulary), None):
            # Checked here: in a batched step one bad id would fail the other requests too.
            raise AgentError(f"token id {bad} is not in the vocabulary of {vocabulary} tokens")
        if params.adapter is not None:
            attached.lora.index(params.adapter)  # loaded, or this request fails alone
        if state.adapter != params.adapter:
            state.held = []  # its cache holds keys and values of another adapter
        state.adapter = params.adapter
        # Only a slot computed with the same adapter can lend its prefix.
        held = [s.held if s.adapter == params.adapter else [] for s in attached.slots]
        donor, start = prefix_donor(slot, ids, held)
        if donor is not None:
            loaded.model.copy_prefix(donor, slot, start)
        # What the slot held past `start` is overwritten from here on.
        state.held, state.ahead = ids[:start], []
        self._reused += start
        return state, ids, start

    def _run_prompt(self, attached: _Attached, slot: int, prompt: list[int], start: int) -> torch.Tensor:
        """Write prompt[start:] into `slot`'s cache; the logits [1, V] of its last token.

        On CUDA in chunks of the captured lengths, replayed, or run eager with the very same
        shapes when there are no graphs (the same kernels, so the same tokens); on a CPU in one go.
        """
        loaded, lora, decode = attached.loaded, attached.lora, attached.decode
        adapter = attached.slots[slot].adapter
        if loaded.device.type != "cuda":
            ids = torch.tensor([prompt[start:]], dtype=torch.long, device=loaded.device)
            with lora.rows([adapter]):
                return loaded.model.prefill(ids, slot, start)[0]
        bank = None if adapter is None else lora
        graphs = decode.prefills if bank is None else decode.adapter_prefills
        io, pinned = attached.io.prefill, attached.io.prefill_host
        host, largest = pinned.numpy(), io.shape[1]
        while True:
            n = min(largest, len(prompt) - start)
            host[0, :] = 0
            host[0, :n] = prompt[start : start + n]
            host[1, :] = loaded.model.scratch_position
            host[1, :n] = np.arange(start, start + n)
            host[2, :3] = slot, n - 1, lora.index(adapter)
            io.copy_(pinned, non_blocking=True)
            length = next(b for b in chunk_lengths(largest) if b >= n)
            if graphs:
                graph, logits = graphs[length]
                graph.replay()
            else:
                logits = prefill_chunk(loaded, io, length, bank)
            start += n
            if start == len(prompt):
                return logits
            torch.cuda.current_stream().synchronize()  # the copy is done before the next writes

    @torch.inference_mode()
    def step(self, slots: Sequence[int]) -> list[int | Exception]:
        """One decode step for each running slot in `slots`; see Engine.step. A slot whose cache
        is full or whose logit processing fails has its error in its place and stops running.

        The step runs cache rows 0..max(slots) together (a captured graph on CUDA), so a scheduler
        that fills the lowest free slots first runs the smallest batches.
        """
        attached = self._require()
        loaded = attached.loaded
        states = [self._slot(s) for s in slots]
        if not slots or len(set(slots)) != len(slots):
            raise AgentError(f"step needs distinct slots, got {list(slots)}")
        results: dict[int, int | Exception] = {}
        for s, state in zip(slots, states, strict=True):
            if state.last is None:
                raise AgentError(f"slot {s} is not running", hint="prefill it first")
            if state.ahead:
                results[s] = state.ahead.pop(0)  # decided by a speculative round
            elif len(state.held) >= loaded.model.max_len:
                results[s] = AgentError(
                    f"slot {s} has filled its {loaded.model.max_len} cache positions",
                    hint="stop at the token budget (token_budget) or release the slot",
                )
        live = [(s, state) for s, state in zip(slots, states, strict=True) if s not in results]
        if len(live) == 1 and _speculates(attached, live[0][1]):
            results.update(self._speculate(attached, *live[0]))
        elif live:
            results.update(self._advance(attached, live))
        for s, state in zip(slots, states, strict=True):
            if isinstance(results[s], Exception):
                state.last = state.sampler = None  # the sequence has ended
        return [results[s] for s in slots]

    def _speculate(self, attached: _Attached, slot: int, state: _Slot) -> dict[int, int | Exception]:
        """One speculative round of `slot`: the draft proposes, one prefill pass of the model over
        `last` and the proposals writes them into the cache and picks after each; the agreed run
        and the model's next pick are the round's tokens. The first is returned, the others wait
        in `ahead`; cache rows past the agreed run are overwritten by later rounds and hidden by
        position meanwhile."""
        drafter, loaded = attached.drafter, attached.loaded
        assert drafter is not None and state.last is not None
        start = len(state.held)
        count = min(DRAFT_TOKENS, loaded.model.max_len - start - 1)
        proposed = drafter.propose(state.held, state.last, count)
        if not proposed:  # the draft was unsure of its first token: a plain step
            return self._advance(attached, [(slot, state)])
        ids = torch.tensor([[state.last, *proposed]], dtype=torch.long, device=loaded.device)
        checked = loaded.model.prefill(ids, slot, start, all_logits=True)[0].argmax(dim=-1).tolist()
        run = accepted_run(proposed, checked)
        stats = drafter.stats
        stats.rounds += 1
        stats.proposed += len(proposed)
        stats.accepted += len(run) - 1
        state.held += [state.last, *run[:-1]]
        state.last, state.ahead = run[-1], run[1:]
        return {slot: run[0]}

    def _advance(self, attached: _Attached, live: list[tuple[int, _Slot]]) -> dict[int, int | Exception]:
        """One decode step of the `live` slots: each one's `last` goes into its cache and its next
        token becomes `last`; a slot whose step failed (its logit processing) stops running."""
        results = self._decode_step(attached, live)
        for s, state in live:
            result = results[s]
            if isinstance(result, Exception):
                state.last = state.sampler = None
            else:
                assert state.last is not None
                state.held.append(state.last)
                state.last = result
        return results

    def _decode_step(self, attached: _Attached, live: list[tuple[int, _Slot]]) -> dict[int, int | Exception]:
        """Run one decode step of the `live` (slot, state) pairs; each slot's token or error."""
        loaded, decode, inputs = attached.loaded, attached.decode, attached.io
        slots = [s for s, _ in live]
        states = [state for _, state in live]
        rows = max(slots) + 1
        # On CUDA eager steps take the captured shapes too (the same kernels: the same tokens).
        cuda = loaded.device.type == "cuda"
        bucket = next((b for b in self._buckets if b >= rows), rows) if cuda else rows
        # Written through numpy (a torch element write costs microseconds of dispatch) into pinned
        # memory, then one copy: the previous step's copy is done, its tokens were read back.
        host = inputs.step_host.numpy()
        host[0, :bucket] = 0
        host[1, :bucket] = loaded.model.scratch_position
        host[2, :bucket] = 0
        lora = attached.lora
        for s, state in live:
            host[0, s], host[1, s], host[2, s] = state.last, len(state.held), lora.index(state.adapter)
        io = inputs.step
        io.copy_(inputs.step_host, non_blocking=True)
        adapted = any(state.adapter is not None for state in states)
        graph = (decode.adapter_graphs if adapted else decode.graphs).get(bucket)
        if graph is not None:
            graph[0].replay()
            logits = graph[1]
        elif adapted and cuda:
            logits = decode_step(loaded, io, bucket, lora)  # the graphs' shapes and kernels
        elif adapted:
            # The CPU's compiled step runs the base alone (compiling the low-rank path too would
            # hold the engine thread for a minute): eager layers, each row's low-rank product.
            in_use = max(len(state.held) for state in states) + 1
            with lora.select(io[2, :bucket]):
                logits = loaded.model.decode(io[0, :bucket], io[1, :bucket], in_use)
        else:
            # Eager CPU layers attend only the positions in use; CUDA and compiled layers keep the
            # fixed shapes (the graphs' kernels; else every new length would compile again). The
            # CPU's compiled step has symbolic lengths.
            in_use = max(len(state.held) for state in states) + 1
            step = decode.step or loaded.model.decode
            logits = step(io[0, :bucket], io[1, :bucket], None if decode.compiled or cuda else in_use)
        tokens = choose(logits[:rows], _samplers_for(states, slots))
        return {s: tokens[s] for s in slots}

    def release(self, slot: int) -> None:
        """End the sequence in `slot`; its cached prefix stays for the next prefill to reuse."""
        state = self._slot(slot)
        state.last = state.sampler = None
        state.ahead = []

    def logprobs(self, slot: int) -> TokenLogprobs | None:
        """See Engine.logprobs."""
        sampler = self._slot(slot).sampler
        return None if sampler is None else sampler.logprobs

    def _slot(self, slot: int) -> _Slot:
        slots = self._require().slots
        if not isinstance(slot, int) or not 0 <= slot < self._slots:
            raise AgentError(f"slot {slot!r} does not exist: this engine has slots 0..{self._slots - 1}")
        return slots[slot]

    # -- generation ------------------------------------------------------------------------

    def stream(self, prompt: list[int], params: SamplingParams) -> Iterator[TokenEvent]:
        """Generate from `prompt` in slot 0; see Engine.stream. Raises AgentError for a prompt that
        does not fit the context, bad sampling parameters, or a call while another generation runs."""
        attached = self._require()
        return self._generate(prompt, params, token_budget(prompt, params, attached.loaded.model.max_len))

    def _generate(self, prompt: list[int], params: SamplingParams, budget: int) -> Iterator[TokenEvent]:
        # Taken on the first next(), inside the generator, so an iterator that is never started
        # holds nothing; closing or dropping it mid-run releases it (finally).
        if not self._busy.acquire(blocking=False):
            raise AgentError("the engine is already generating", hint="serialize calls to stream()")
        try:
            text = self._require_text()
            yield from token_events(
                self._tokens(prompt, params),
                text.codec.decode,
                stops=params.stop,
                end_ids=text.end_ids,
                budget=budget,
                logprobs=(lambda: self.logprobs(0)) if params.logprobs is not None else None,
            )
        finally:
            if self._attached is not None:
                self.release(0)
            self._busy.release()

    def _tokens(self, prompt: list[int], params: SamplingParams) -> Iterator[int]:
        yield self.prefill(0, prompt, params)
        while True:
            yield token_of(self.step([0])[0])

    @torch.inference_mode()
    def logits(self, tokens: list[int]) -> torch.Tensor:
        """fp32 logits [T, V] of every position of `tokens`, run in slot 0 (tests, quality checks)."""
        attached = self._require()
        loaded = attached.loaded
        with self._busy:
            ids = torch.tensor([tokens], dtype=torch.long, device=loaded.device)
            out = loaded.model.prefill(ids, 0, 0, all_logits=True)[0].float().cpu()
            attached.slots[0] = _Slot(held=list(tokens))
            return out

    # -- facts -----------------------------------------------------------------------------

    @property
    def layer_kernels(self) -> dict[str, str]:
        """The kernel each linear layer runs, by module name."""
        return dict(self._require().loaded.kernels)

    def describe(self) -> EngineInfo:
        """Model, quantization, the matmul kernel in use, device, context, and how decode runs."""
        attached = self._require()
        loaded, decode = attached.loaded, attached.decode
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
                "device_choice": self._device_choice,
                "dtype": str(loaded.dtype).removeprefix("torch."),
                "threads": str(attached.threads),
                "kernels": ", ".join(f"{k}={n}" for k, n in sorted(counts.items())),
                "head": loaded.kernels["lm_head"],
                "kernel_choice": loaded.kernel_note,
                # Why our CPU kernels are not used here (x86-only code on an Arm board), or "ours".
                "cpu_kernels": (native.cpu_kernels()[1] or "ours") if loaded.device.type == "cpu" else "-",
                "kv_cache": loaded.model.kv_storage + self._kv_note,
                "architecture": loaded.args.architecture,
                "slots": str(self._slots),
                "decode": decode.graph_note,
                "prefill": decode.prefill_note,
                "compile": decode.compile_note,
                "fused_ops": decode.ops_note,
                "prefix_tokens_reused": str(self._reused),
                "draft": _draft_note(attached),
                "adapters": ", ".join(attached.lora.keys) or "-",
                "adapter_steps": decode.adapter_note,
            },
        )

    def _require(self) -> _Attached:
        attached = self._attached
        if attached is None:
            raise AgentError("no model is loaded in this engine", hint="call load() first")
        return attached

    def _require_text(self) -> _Text:
        text = self._require().text
        if text is None:
            raise AgentError("this engine was given a model without a tokenizer", hint="use load()")
        return text


_GREEDY = Sampler(SamplingParams(temperature=0), torch.Generator())


def _samplers_for(states: Sequence[_Slot], slots: Sequence[int]) -> list[Sampler]:
    """A sampler per cache row 0..max(slots); rows outside the step take the (free) argmax."""
    rows = [_GREEDY] * (max(slots) + 1)
    for s, state in zip(slots, states, strict=True):
        rows[s] = state.sampler or _GREEDY
    return rows


def _forget_prefixes(attached: _Attached, key: str) -> None:
    """Slots whose cached prefix was computed with the adapter under `key` forget it."""
    for state in attached.slots:
        if state.adapter == key:
            state.held, state.adapter = [], None


def _speculates(attached: _Attached, state: _Slot) -> bool:
    """Whether the lone running `state` steps speculatively: a draft is loaded, the sequence is
    greedy with nothing processing its logits, and its cache has room for a round."""
    sampler = state.sampler
    return (
        attached.drafter is not None
        and state.adapter is None  # the draft proposes for the base alone
        and sampler is not None
        and sampler.greedy
        and sampler.processor is None
        and len(state.held) + 1 < attached.loaded.model.max_len
    )


def _processor(text: _Text | None, params: SamplingParams) -> TokenProcessor | None:
    """What processes the logits of a request with `params` (None: nothing does)."""
    if not params.processed:
        return None
    if text is None:
        raise AgentError(
            "logit processing (bias, penalties, grammars, logprobs) needs the model's tokenizer",
            hint="load the model with load()",
        )
    return TokenProcessor(params, text.vocab)


def _draft_note(attached: _Attached) -> str:
    """The draft model as describe() tells it: how it decodes and how speculation went."""
    drafter = attached.drafter
    if drafter is None:
        return attached.draft_off
    return (
        f"{drafter.loaded.facts.quantization}, up to {DRAFT_TOKENS} proposals a round, "
        f"{drafter.note}, "
        f"for a lone greedy sequence: {drafter.stats.describe()}"
    )


def _vocabulary(codec: TextCodec, n_logits: int, end_ids: frozenset[int]) -> Vocabulary:
    """The model's vocabulary for llguidance, from tokenizer.json (built on first use)."""
    size = max(n_logits, codec.tokenizer.get_vocab_size(with_added_tokens=True))
    return Vocabulary(lambda: LLTokenizer(codec.to_json(), n_vocab=size, eos_token=sorted(end_ids)), n_logits)


def _generation_eos(directory: Path) -> set[int]:
    path = directory / "generation_config.json"
    if not path.is_file():
        return set()
    return set(as_token_ids(read_json(path).get("eos_token_id")))
