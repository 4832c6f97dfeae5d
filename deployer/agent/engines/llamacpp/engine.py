"""The llama.cpp implementation of `Engine`: a GGUF artifact run by llama-cpp-python, on the CPU,
with the batched step interface (several sequences per llama_decode, see batch.py).

The GGUF is checked by our own reader (deployer.core.gguf_io) and against the artifact manifest
before llama.cpp sees it, so a corrupt or lying file is refused with its name, not a crash in C.
llama.cpp reads the weights (repacked for its CPU kernels) and runs prefill and decode; prompts are
formatted with the chat template stored in the GGUF (rendered by the same sandboxed jinja2 as the
torch engine), and text is streamed through `textstream` (whole characters, stop strings held back)
exactly as the torch engine does, so both engines answer the API the same way.

llama-cpp-python is an optional extra; without it the engine refuses to start and says how to
install it.

Every call that makes llama.cpp compute (load, prefill, decode, free) runs on one thread per process
(`_on_llama_thread`). llama.cpp parallelizes with OpenMP, whose worker team belongs to the calling
thread; when a second thread calls in while the first one's team is still waiting, the two teams
fight for the cores. The agent's requests arrive on a new thread each, after warm-up ran on another,
which halved decode speed at 2 threads on 2 cores (32 against 76 tokens/s in-process).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deployer.agent.chat import ChatTemplate, infill_prompt
from deployer.agent.engines.base import Embedding, Engine, in_pieces, token_budget, token_of
from deployer.agent.engines.llamacpp.batch import BatchContext
from deployer.agent.engines.logits import TokenProcessor, Vocabulary
from deployer.agent.engines.textstream import token_events
from deployer.agent.types import ChatMessage, EngineInfo, SamplingParams, TokenEvent, TokenLogprobs
from deployer.core.gguf_io import GGUF_FILE, GGUFHeader, read_gguf_header
from deployer.core.lora import ADAPTER_GGUF, LoraAdapter
from deployer.core.manifest import MANIFEST_NAME, read_manifest
from deployer.errors import AgentError, FormatError

__all__ = ["LlamaCppEngine", "require_llama_cpp"]

DEFAULT_MAX_CONTEXT = 2048
WARMUP_MESSAGES = (ChatMessage("user", "Hello"),)
WARMUP_TOKENS = 4
DEFAULT_SLOTS = 4  # agent.yaml's default max_concurrent
# The Llama object's own context only tokenizes (generation has a batched context of its own).
_TOKENIZER_CONTEXT = 32
INSTALL_HINT = (
    "pip install 'sits-deployer[llamacpp]' on a controller, 'sits-agent[llamacpp]' on a device"
    " (it compiles llama.cpp: several minutes, once)"
)
# Token types that can end generation (gguf TokenType CONTROL, USER_DEFINED): few, so the
# end-of-generation set is asked of llama.cpp once at load rather than per token.
_SPECIAL_TOKEN_TYPES = (3, 4)


_LLAMA_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llama.cpp")


def _on_llama_thread(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """func(*args, **kwargs), run on the process's one llama.cpp thread; its exceptions propagate."""
    return _LLAMA_THREAD.submit(func, *args, **kwargs).result()


def require_llama_cpp() -> Any:
    """The `llama_cpp` module, or AgentError naming the extra to install."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise AgentError(
            "the llama.cpp engine needs llama-cpp-python, which is not installed", hint=INSTALL_HINT
        ) from exc
    return llama_cpp


@dataclass(frozen=True)
class _Loaded:
    """What load() produced: the llama.cpp model and what we read about it ourselves."""

    llm: Any
    batch: BatchContext
    header: GGUFHeader
    name: str
    version: str
    quantization: str
    template: ChatTemplate | None
    end_ids: frozenset[int]
    add_bos: bool
    vocab: Vocabulary


class LlamaCppEngine(Engine):
    """Runs a GGUF artifact with llama.cpp: `slots` sequences batched together (see batch.py)."""

    def __init__(
        self,
        *,
        max_context: int = DEFAULT_MAX_CONTEXT,
        threads: int | None = None,
        slots: int | None = None,
    ) -> None:
        """`max_context` caps each slot's KV cache; `threads` is llama.cpp's thread count (default:
        the CPUs this process may run on); `slots` how many sequences one step decodes together.
        Raises AgentError when llama-cpp-python is not installed."""
        self._llama_cpp = require_llama_cpp()
        self._max_context = max_context
        self._threads = threads or len(os.sched_getaffinity(0))
        self._slots = slots or DEFAULT_SLOTS
        self._loaded: _Loaded | None = None
        self._embedder: Any = None  # a llama.cpp context in embedding mode, made on first use
        self._busy = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------

    def load(self, artifact_dir: Path) -> None:
        """Check the artifact's GGUF and manifest, then let llama.cpp map it.

        Raises FormatError for a missing, corrupt or inconsistent GGUF, AgentError when llama.cpp
        refuses the file anyway.
        """
        path = artifact_dir / GGUF_FILE
        if not path.is_file():
            raise FormatError(
                f"{artifact_dir}: no {GGUF_FILE} (the llama.cpp engine runs GGUF artifacts)",
                hint="build with `agent.engine: llama.cpp` in deploy.yaml, or set `engine: torch`",
            )
        header = read_gguf_header(path)
        name, version, quantization = _facts(artifact_dir, header)
        arch = header.string("general.architecture") or "llama"  # its keys are named after it
        n_ctx = min(self._max_context, header.integer(f"{arch}.context_length") or self._max_context)
        try:
            # The Llama object holds the weights and tokenizes; its own context is left tiny, since
            # generation runs in the batched context below. The weights are read, not mapped: the
            # CPU backend repacks most 4-bit ones into a copy of its own for its faster kernels, and
            # mapped, their file pages stayed resident beside that copy (a Qwen2.5-1.5B Q4_K_M load
            # held 1.98 GB mapped, 1.36 GB read; bench/scale_load.py).
            llm = _on_llama_thread(
                self._llama_cpp.Llama,
                model_path=str(path),
                n_ctx=_TOKENIZER_CONTEXT,
                n_batch=_TOKENIZER_CONTEXT,
                n_threads=self._threads,
                n_threads_batch=self._threads,
                use_mmap=False,
                verbose=False,
            )
        except (ValueError, RuntimeError) as exc:  # llama-cpp-python's errors for a refused model
            raise AgentError(f"{path}: llama.cpp could not load the model: {exc}") from exc
        try:
            batch = _on_llama_thread(
                BatchContext,
                self._llama_cpp,
                llm.model,
                slots=self._slots,
                context_length=n_ctx,
                threads=self._threads,
            )
        except BaseException:
            _on_llama_thread(llm.close)
            raise
        template_source = header.string("tokenizer.chat_template")
        template = None
        if template_source:
            template = ChatTemplate(template_source, _special_tokens(header), path)
        end_ids = self._end_ids(llm, header)
        self._loaded = _Loaded(
            llm=llm,
            batch=batch,
            header=header,
            name=name,
            version=version,
            quantization=quantization,
            template=template,
            end_ids=end_ids,
            add_bos=bool(header.metadata.get("tokenizer.ggml.add_bos_token", False)),
            vocab=self._vocabulary(llm, end_ids),
        )

    def _end_ids(self, llm: Any, header: GGUFHeader) -> frozenset[int]:
        """Tokens that end generation as llama.cpp itself decides (eos, eot, <|im_end|>, ...)."""
        vocab = self._llama_cpp.llama_model_get_vocab(llm.model)
        types = _array(header, "tokenizer.ggml.token_type")
        candidates = {i for i, kind in enumerate(types) if kind in _SPECIAL_TOKEN_TYPES}
        candidates.add(llm.token_eos())
        return frozenset(t for t in candidates if self._llama_cpp.llama_vocab_is_eog(vocab, t))

    def _vocabulary(self, llm: Any, end_ids: frozenset[int]) -> Vocabulary:
        """The GGUF's vocabulary for llguidance, read through llama.cpp (built on first use)."""
        from llguidance.llamacpp import lltokenizer_from_vocab

        vocab = self._llama_cpp.llama_model_get_vocab(llm.model)
        n = llm.n_vocab()

        def build() -> Any:
            # llguidance reads each token through a llama.cpp call its bindings mark deprecated: one
            # warning per token (49,152 for SmolLM2) says nothing we can act on.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "llama_token_get_attr is deprecated", DeprecationWarning)
                return lltokenizer_from_vocab(vocab, n_vocab=n, eos_token=sorted(end_ids))

        return Vocabulary(build, n)

    def warmup(self) -> None:
        """A short greedy generation, so buffers and threads are ready for the first request; then
        the decode step's cost at each batch size is measured (see `step_group`)."""
        loaded = self._require()
        prompt = self.chat_prompt(WARMUP_MESSAGES) if loaded.template else self.encode("Hello")
        for _ in self.stream(prompt, SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0)):
            pass
        _on_llama_thread(loaded.batch.measure_steps)

    def unload(self) -> None:
        """Free the batched context and the model; the engine cannot be used afterwards.

        A stream() still running keeps its own reference and frees the model when it ends.
        """
        loaded, self._loaded = self._loaded, None
        embedder, self._embedder = self._embedder, None
        if embedder is not None:
            _on_llama_thread(embedder.close)
        if loaded is not None and not self._busy.locked():
            _on_llama_thread(_close, loaded)

    # -- text ------------------------------------------------------------------------------

    def chat_prompt(self, messages: Sequence[ChatMessage], tools: Sequence[dict] | None = None) -> list[int]:
        """Messages (and tools) formatted with the GGUF's chat template, then tokenized (special
        tokens parsed)."""
        loaded = self._require()
        if loaded.template is None:
            raise AgentError(
                "this model has no chat template", hint="use /v1/completions with a plain prompt"
            )
        text = loaded.template.render(messages, add_generation_prompt=True, tools=tools)
        return loaded.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def encode(self, text: str) -> list[int]:
        """Plain text to ids, with BOS when the GGUF says the tokenizer adds one."""
        loaded = self._require()
        return loaded.llm.tokenize(text.encode("utf-8"), add_bos=loaded.add_bos, special=False)

    def decode(self, ids: list[int]) -> str:
        """Ids to text, special tokens left out (an incomplete character decodes as U+FFFD)."""
        return self._require().llm.detokenize(ids).decode("utf-8", errors="replace")

    def infill_prompt(self, prefix: str, suffix: str) -> list[int]:
        """The fill-in-the-middle prompt, with the GGUF's FIM tokens (AgentError without)."""
        llm = self._require().llm

        def special_id(text: str) -> int | None:
            ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
            return ids[0] if len(ids) == 1 else None

        def plain(text: str) -> list[int]:
            return llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)

        return infill_prompt(special_id, plain, prefix, suffix)

    def embed_pieces(self, texts: Sequence[str]) -> Embedding:
        """Mean-pooled, L2-normalised embeddings by llama.cpp, in pieces; see Engine.embed_pieces.

        A second llama.cpp context in embedding mode (made on first use) maps the same GGUF, so
        the weights are shared and generation's cache is left alone. It takes inputs as long as
        a generation slot's context (a pooled sequence must fit in one of its batches)."""
        loaded = self._require()
        if any(not text for text in texts):
            raise AgentError("an input is empty; embeddings need at least one token", param="input")
        if self._embedder is None:
            n_ctx = loaded.batch.context_length
            self._embedder = _on_llama_thread(
                self._llama_cpp.Llama,
                model_path=str(loaded.header.path),
                embedding=True,
                pooling_type=self._llama_cpp.LLAMA_POOLING_TYPE_MEAN,
                n_ctx=n_ctx,
                n_batch=n_ctx,
                n_ubatch=n_ctx,
                n_threads=self._threads,
                n_threads_batch=self._threads,
                use_mmap=True,
                verbose=False,
            )
        embedder = self._embedder
        vectors: list[list[float]] = []
        count = 0

        def size(text: str) -> int:  # as Llama.embed will tokenize it (with BOS)
            return len(embedder.tokenize(text.encode("utf-8")))

        for i, piece in enumerate(in_pieces(texts, size)):
            if i:
                yield  # decode steps run here
            try:
                done, n = _on_llama_thread(
                    embedder.embed, piece, normalize=True, truncate=False, return_count=True
                )
            except ValueError as exc:  # an input longer than the context
                raise AgentError(f"cannot embed the input: {exc}", param="input") from exc
            vectors += [list(map(float, v)) for v in done]
            count += int(n)
        return vectors, count

    # -- LoRA adapters ---------------------------------------------------------------------

    serves_adapters = True

    def load_adapter(self, key: str, adapter: LoraAdapter, directory: Path) -> None:
        """See Engine.load_adapter: the artifact's LoRA GGUF (`adapter.gguf`, which the build writes
        for an adapter of a GGUF base), checked by our own reader, then loaded by llama.cpp on the
        model. Requests of different adapters are decoded in separate batches (see batch.py).
        Raises FormatError for a corrupt GGUF, AgentError for one that does not fit the model."""
        loaded = self._require()
        path = directory / ADAPTER_GGUF
        if not path.is_file():
            raise AgentError(
                f"adapter {adapter.name} {adapter.version}: {directory} has no {ADAPTER_GGUF} (the "
                "llama.cpp engine runs llama.cpp's LoRA GGUF)",
                hint="build the adapter for this agent's GGUF base artifact; the build then writes it",
            )
        _check_adapter_gguf(read_gguf_header(path), loaded.header)
        _on_llama_thread(loaded.batch.load_adapter, key, path)

    def unload_adapter(self, key: str) -> None:
        """See Engine.unload_adapter: llama_adapter_lora_free, the caches computed with it forgotten."""
        if self._loaded is not None:
            _on_llama_thread(self._loaded.batch.unload_adapter, key)

    # -- generation ------------------------------------------------------------------------

    @property
    def max_slots(self) -> int:
        """How many sequences one step decodes together (the context's n_seq_max)."""
        return self._slots

    @property
    def end_ids(self) -> frozenset[int]:
        """Tokens that end generation, as llama.cpp decides (eos, eot, <|im_end|>, ...)."""
        return self._require().end_ids

    def choose_slot(self, free: Sequence[int], prompt: Sequence[int]) -> int:
        """See Engine.choose_slot: the free slot holding the longest prefix of `prompt`."""
        return self._require().batch.choose_slot(free, prompt)

    def prefill(self, slot: int, prompt: Sequence[int], params: SamplingParams) -> int:
        """See Engine.prefill; computed on the llama.cpp thread."""
        return token_of(self.prefill_many([(slot, prompt, params)])[0])

    def prefill_many(
        self, items: Sequence[tuple[int, Sequence[int], SamplingParams]]
    ) -> list[int | Exception]:
        """See Engine.prefill_many: the prompts decoded together, in one llama_decode (two when
        some share a prefix with others: see BatchContext.prefill_many)."""
        loaded = self._require()
        results: dict[int, int | Exception] = {}
        batch = []
        for slot, prompt, params in items:
            try:
                batch.append((slot, list(prompt), params, self._processor(loaded, params)))
            except Exception as exc:  # this request's processing alone
                results[slot] = exc
        done = _on_llama_thread(loaded.batch.prefill_many, batch)
        results.update(zip((slot for slot, *_ in batch), done, strict=True))
        return [results[slot] for slot, *_ in items]

    def step_group(self, running: int) -> int:
        """See Engine.step_group: from the step costs measured at warm-up (a llama.cpp without our
        prefetch patch can make a small batch dearer than its sequences one by one; see
        batch.py)."""
        return self._require().batch.group_size(running)

    def step(self, slots: Sequence[int]) -> list[int | Exception]:
        """See Engine.step: one llama_decode for all `slots`, on the llama.cpp thread."""
        return _on_llama_thread(self._require().batch.step, list(slots))

    def logprobs(self, slot: int) -> TokenLogprobs | None:
        """See Engine.logprobs."""
        return self._require().batch.logprobs(slot)

    def release(self, slot: int) -> None:
        """See Engine.release; the slot's cache stays for prefix reuse."""
        _on_llama_thread(self._require().batch.release, slot)

    def stream(self, prompt: list[int], params: SamplingParams) -> Iterator[TokenEvent]:
        """Generate from `prompt` in slot 0; see Engine.stream. Raises AgentError for a prompt that
        does not fit the context, bad sampling parameters, or a call while another stream runs.
        Not for use beside a scheduler driving the same engine (both would use slot 0)."""
        loaded = self._require()
        budget = token_budget(prompt, params, loaded.batch.context_length)
        return self._generate(loaded, prompt, params, budget)

    def _generate(
        self, loaded: _Loaded, prompt: list[int], params: SamplingParams, budget: int
    ) -> Iterator[TokenEvent]:
        # Taken on the first next(), inside the generator, so an iterator that is never started
        # holds nothing; closing it mid-run (client gone) releases the slot (finally).
        if not self._busy.acquire(blocking=False):
            raise AgentError("the engine is already generating", hint="serialize calls to stream()")
        try:
            yield from token_events(
                self._tokens(loaded, prompt, params),
                self._decoder(loaded),
                stops=params.stop,
                end_ids=loaded.end_ids,
                budget=budget,
                logprobs=(lambda: loaded.batch.logprobs(0)) if params.logprobs is not None else None,
            )
        finally:
            _on_llama_thread(loaded.batch.release, 0)
            self._busy.release()
            if self._loaded is not loaded:  # unloaded while this generation ran: free it now
                _on_llama_thread(_close, loaded)

    def _tokens(self, loaded: _Loaded, prompt: list[int], params: SamplingParams) -> Iterator[int]:
        yield _on_llama_thread(loaded.batch.prefill, 0, prompt, params, self._processor(loaded, params))
        while True:
            yield token_of(_on_llama_thread(loaded.batch.step, [0])[0])

    @staticmethod
    def _processor(loaded: _Loaded, params: SamplingParams) -> TokenProcessor | None:
        """The request's logit processing (bias, penalties, grammar, logprobs), or None without.
        llama.cpp's own penalties stay off, so both engines count them the same way."""
        return TokenProcessor(params, loaded.vocab) if params.processed else None

    @staticmethod
    def _decoder(loaded: _Loaded) -> Any:
        return lambda ids: loaded.llm.detokenize(ids).decode("utf-8", errors="replace")

    # -- facts -----------------------------------------------------------------------------

    def describe(self) -> EngineInfo:
        """Model, GGUF quantization, the ggml kernels in use, and the context length."""
        loaded = self._require()
        return EngineInfo(
            engine="llama.cpp",
            model=loaded.name,
            version=loaded.version,
            quantization=loaded.quantization,
            kernel=f"ggml-cpu {loaded.quantization}",
            device="cpu",
            context_length=loaded.batch.context_length,
            extra={
                "device_choice": "cpu (the llama.cpp engine runs on the CPU)",
                "threads": str(self._threads),
                "slots": str(self._slots),
                "gguf": str(loaded.header.path),
                "mmap": "true",
                "llama_cpp_python": getattr(self._llama_cpp, "__version__", "unknown"),
                "architecture": loaded.header.string("general.architecture") or "unknown",
                "adapters": ", ".join(loaded.batch.adapters) or "-",
                "step_ms": " ".join(
                    f"{k}:{seconds * 1000:.1f}" for k, seconds in sorted(loaded.batch.step_costs.items())
                )
                or "not measured",
            },
        )

    def _require(self) -> _Loaded:
        if self._loaded is None:
            raise AgentError("no model is loaded in this engine", hint="call load() first")
        return self._loaded


def _close(loaded: _Loaded) -> None:
    """Free the batched context, then the model it was made from (llama.cpp thread)."""
    loaded.batch.close()
    loaded.llm.close()


def _facts(artifact_dir: Path, header: GGUFHeader) -> tuple[str, str, str]:
    """(name, version, quantization label), from the manifest when there is one, checked against the
    GGUF's tensor table (a manifest that describes another file is refused)."""
    linear = Counter(t.dtype for t in header.tensors if len(t.shape) == 2 and t.name.startswith("blk."))
    quantization = "+".join(sorted(linear)) or "unknown"
    if not (artifact_dir / MANIFEST_NAME).is_file():
        return header.string("general.name") or artifact_dir.name, "unversioned", quantization
    manifest = read_manifest(artifact_dir)
    stored = {t.name: t.dtype for t in header.tensors}
    listed = {name: t.dtype for name, t in manifest.tensors.items() if t.file == GGUF_FILE}
    if stored != listed:
        raise FormatError(
            f"{header.path}: the tensor table does not match {artifact_dir / MANIFEST_NAME}",
            hint="the artifact is corrupt or mixed from two builds; reinstall it",
        )
    return manifest.model.name, manifest.model.version, quantization


def _check_adapter_gguf(adapter: GGUFHeader, base: GGUFHeader) -> None:
    """FormatError unless `adapter` is a LoRA GGUF whose factors fit `base`'s tensors: each
    ``W.lora_a`` [in, rank] and ``W.lora_b`` [rank, out] (ggml order) of a 2-D tensor W of the base
    with rows of `in` and `out` rows, so llama.cpp is never handed another model's adapter."""
    path = adapter.path
    if (adapter.string("general.type"), adapter.string("adapter.type")) != ("adapter", "lora"):
        raise FormatError(f"{path}: not a LoRA adapter GGUF", hint="rebuild the adapter")
    arch, base_arch = adapter.string("general.architecture"), base.string("general.architecture")
    if arch != base_arch:
        raise FormatError(
            f"{path}: an adapter of a {arch} model; the model served is {base_arch}",
            hint="install the adapter built for this base model",
        )
    weights = base.by_name()
    factors = adapter.by_name()
    for name, a in factors.items():
        if not name.endswith(".lora_a"):
            continue
        target = name.removesuffix(".lora_a")
        weight, b = weights.get(target), factors.get(f"{target}.lora_b")
        fits = (
            weight is not None
            and b is not None
            and len(weight.shape) == len(a.shape) == len(b.shape) == 2
            and a.shape[0] == weight.shape[0]
            and b.shape[1] == weight.shape[1]
            and a.shape[1] == b.shape[0]
        )
        if not fits:
            raise FormatError(
                f"{path}: {name} does not fit the model served ({target} is "
                f"{weight.shape if weight else 'absent'} there)",
                hint="the adapter was built for another base; install the one built for this base",
            )
    if not factors:
        raise FormatError(f"{path}: the adapter has no tensors", hint="rebuild the adapter")


def _special_tokens(header: GGUFHeader) -> dict[str, str]:
    """bos_token/eos_token/... for the chat template, from the GGUF's token list."""
    tokens = _array(header, "tokenizer.ggml.tokens")
    found = {}
    for key in ("bos", "eos", "unknown", "padding"):
        token_id = header.integer(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            name = {"unknown": "unk", "padding": "pad"}.get(key, key)
            found[f"{name}_token"] = str(tokens[token_id])
    return found


def _array(header: GGUFHeader, key: str) -> list[object]:
    """An array metadata value, or [] when absent or not an array."""
    value = header.metadata.get(key)
    return value if isinstance(value, list) else []
