"""The torch implementation of `Engine`: our Llama-family model on CPU or CUDA.

Generation is a prefill over the prompt then one decode step per token on the static KV cache.
Text is streamed through `textstream` (whole characters only, stop strings held back), and the
run ends on an EOS token or a stop string ("stop") or on max_tokens or a full context ("length").
"""

from __future__ import annotations

import gc
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from deployer.agent.chat import ChatTemplate, TextCodec, read_tokenizer_config
from deployer.agent.engines.base import (
    ChatMessage,
    Engine,
    EngineInfo,
    SamplingParams,
    TokenEvent,
    token_budget,
)
from deployer.agent.engines.llama import as_token_ids
from deployer.agent.engines.loader import LoadedModel, load_model, read_json
from deployer.agent.engines.qlinear import KERNEL_LINEAR
from deployer.agent.engines.sampling import new_generator, pick_token
from deployer.agent.engines.textstream import token_events
from deployer.errors import AgentError

DEFAULT_MAX_CONTEXT = 2048
WARMUP_MESSAGES = (ChatMessage("user", "Hello"),)
WARMUP_TOKENS = 4


class TorchEngine(Engine):
    """Runs an artifact with the torch model of `llama.py`, one sequence at a time."""

    def __init__(
        self,
        *,
        device: str = "cpu",
        dtype: str = "auto",
        max_context: int = DEFAULT_MAX_CONTEXT,
        threads: int | None = None,
    ) -> None:
        """`dtype` is "auto", "fp32", "bf16" or "fp16"; `max_context` caps the KV cache;
        `threads` sets torch's (process-wide) intra-op thread count when given."""
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise AgentError("device cuda was asked for but torch sees no CUDA device")
        self._device, self._dtype, self._max_context = device, dtype, max_context
        self._threads = threads
        self._loaded: LoadedModel | None = None
        self._codec: TextCodec | None = None
        self._template: ChatTemplate | None = None
        self._eos: frozenset[int] = frozenset()
        self._busy = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------

    def load(self, artifact_dir: Path) -> None:
        """Load weights (memory-mapped), tokenizer and chat template from `artifact_dir`."""
        if self._threads:
            torch.set_num_threads(self._threads)
        loaded = load_model(
            artifact_dir, device=self._device, dtype=self._dtype, max_context=self._max_context
        )
        codec = TextCodec.from_dir(artifact_dir)
        tok_config = read_tokenizer_config(artifact_dir)
        self._template = ChatTemplate.from_dir(artifact_dir)
        self._eos = frozenset(
            set(loaded.args.eos_token_ids) | _generation_eos(artifact_dir) | codec.eos_ids(tok_config)
        )
        self._loaded, self._codec = loaded, codec

    def warmup(self) -> None:
        """A short greedy generation, so kernels and allocations are ready for the first request."""
        prompt = self.chat_prompt(WARMUP_MESSAGES) if self._template else self.encode("Hello")
        for _ in self.stream(prompt, SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0)):
            pass

    def unload(self) -> None:
        """Drop the model and its caches; the engine cannot be used afterwards.

        A generation still running keeps its own reference and frees the model when it ends.
        """
        self._loaded = self._codec = self._template = None
        gc.collect()
        if self._device.startswith("cuda"):
            torch.cuda.empty_cache()

    # -- text ------------------------------------------------------------------------------

    def chat_prompt(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Messages formatted with the model's chat template, then tokenized."""
        self._require()
        if self._template is None:
            raise AgentError(
                "this model has no chat template", hint="use /v1/completions with a plain prompt"
            )
        text = self._template.render(messages, add_generation_prompt=True)
        return self._codec.encode(text, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        """Plain text to ids, with the tokenizer's own special tokens (e.g. BOS) if it adds any."""
        self._require()
        return self._codec.encode(text, add_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        """Ids to text, special tokens left out."""
        self._require()
        return self._codec.decode(ids)

    # -- generation ------------------------------------------------------------------------

    def stream(self, prompt: list[int], params: SamplingParams) -> Iterator[TokenEvent]:
        """Generate from `prompt`; see Engine.stream. Raises AgentError for a prompt that does not
        fit the context, bad sampling parameters, or a call while another generation runs."""
        loaded = self._require()
        return self._generate(loaded, prompt, params, token_budget(prompt, params, loaded.model.max_len))

    def _generate(
        self, loaded: LoadedModel, prompt: list[int], params: SamplingParams, budget: int
    ) -> Iterator[TokenEvent]:
        # Taken on the first next(), inside the generator, so an iterator that is never started
        # holds nothing; closing or dropping it mid-run releases it (finally).
        if not self._busy.acquire(blocking=False):
            raise AgentError("the engine is already generating", hint="serialize calls to stream()")
        try:
            yield from token_events(
                self._sample(loaded, prompt, params),
                self._codec.decode,
                stops=params.stop,
                end_ids=self._eos,
                budget=budget,
            )
        finally:
            self._busy.release()

    def _sample(self, loaded: LoadedModel, prompt: list[int], params: SamplingParams) -> Iterator[int]:
        """Token ids, one forward pass each: prefill, then decode steps on the KV cache."""
        generator = new_generator(params.seed)
        logits = self._forward(loaded, prompt, 0)
        position = len(prompt)
        while True:
            token = pick_token(logits, params, generator)
            yield token
            logits = self._forward(loaded, [token], position)
            position += 1

    @torch.inference_mode()
    def _forward(self, loaded: LoadedModel, tokens: list[int], start: int) -> torch.Tensor:
        """Prefill (many tokens) or decode (one) at `start`; the last position's logits [V]."""
        ids = torch.tensor([tokens], dtype=torch.long, device=loaded.device)
        return loaded.model(ids, start)[0, -1]

    @torch.inference_mode()
    def logits(self, tokens: list[int]) -> torch.Tensor:
        """fp32 logits [T, V] of every position of `tokens` (for tests and quality checks)."""
        loaded = self._require()
        with self._busy:
            ids = torch.tensor([tokens], dtype=torch.long, device=loaded.device)
            return loaded.model(ids, 0, all_logits=True)[0].float().cpu()

    # -- facts -----------------------------------------------------------------------------

    @property
    def layer_kernels(self) -> dict[str, str]:
        """The kernel each linear layer runs, by module name."""
        return dict(self._require().kernels)

    def describe(self) -> EngineInfo:
        """Model, quantization, the matmul kernel in use, device and context length."""
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
            },
        )

    def _require(self) -> LoadedModel:
        if self._loaded is None:
            raise AgentError("no model is loaded in this engine", hint="call load() first")
        return self._loaded


def _generation_eos(directory: Path) -> set[int]:
    path = directory / "generation_config.json"
    if not path.is_file():
        return set()
    return set(as_token_ids(read_json(path).get("eos_token_id")))
