"""Several sequences decoded together in one llama.cpp context, through llama-cpp-python's low-level API.

What llama.cpp's own server does with parallel slots: the context has `n_seq_max = slots`, and each
slot is one sequence id. A step puts the last token of every running slot into one `llama_batch`
(its own position and sequence id each) and decodes them in a single `llama_decode`; every slot
samples from its own row of logits with its own sampler chain (greedy, or top-k, temperature, top-p
and a seeded distribution), so one request's seed or settings never touch another's.

The KV cache is not unified (`kv_unified = false`): each sequence has a stream of its own, laid out
the same whether it runs alone or beside others, so a greedy answer does not depend on its company.
A slot remembers the tokens its cache holds; a new prompt that starts with them decodes only the
rest (`llama_memory_seq_rm` cuts the cache where the two part). When another slot, running or not,
holds a longer prefix of the prompt (the system prompt every client of an app sends), its cache is
copied over first (`llama_memory_seq_cp`: a memory copy of the stream, against about 3 ms a token to
decode the prefix again for SmolLM2 on one core).

On x86 ggml multiplies a single token by its vec_dot kernels and two or more by llamafile's
tinyBLAS, whose Q8_0 kernel reads four weight rows at once. For a model as narrow as SmolLM2 (rows
of 576 values) those rows are too short for the hardware prefetcher and the kernel stalled on
memory: a 4-sequence step cost 2 single ones. scripts/llamacpp.sh builds llama-cpp-python with a
patch that prefetches the next rows (scripts/llama-cpp-sgemm-prefetch.patch): measured here, a
step of 2 sequences costs 0.85 single ones, 4 sequences 1.3, 8 2.4, 16 4.8 (2 AVX-512 cores
running the AVX2 build, 1 thread). An unpatched build or another CPU may still make a small batch
dearer than its sequences one by one, so `measure_steps` times a step of each batch size once (at
warm-up) and `group_size` then says how many sequences the next step should take so that a round
of steps costs least.

LoRA adapters (llama.cpp's LoRA GGUF, `load_adapter`) apply to the whole context, not to a sequence
(`llama_set_adapters_lora`), so sequences of different adapters cannot share a `llama_decode`: a
step or a prefill decodes its slots in one batch per adapter, the adapter set on the context
already first, as llama.cpp's server splits its batches by adapter. Each switch makes llama.cpp
reserve its compute graphs again before the next decode. A slot's cache holds keys and values
computed with its adapter, so a prefix is reused only from a cache of the same adapter.

Not thread-safe: the engine calls everything here on its one llama.cpp thread.
"""

from __future__ import annotations

import ctypes
import math
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from deployer.agent.engines.base import SHARE_FROM, common_prefix, longest_prefix_slot, prefix_donor, token_of
from deployer.agent.engines.logits import TokenProcessor
from deployer.agent.types import GREEDY_BELOW, SamplingParams, TokenLogprobs, check_params
from deployer.errors import AgentError

__all__ = ["BatchContext", "PrefillItem", "cheapest_group", "measured_sizes"]

# (slot, prompt, sampling, logit processing) of one sequence to start
PrefillItem = tuple[int, Sequence[int], SamplingParams, "TokenProcessor | None"]

T = TypeVar("T")
_MEASURED_UP_TO = 64  # bigger batches cost about proportionally more on a CPU: extrapolated


@dataclass
class _Slot:
    cached: list[int] = field(default_factory=list)  # the tokens this sequence's KV cache holds
    last: int = -1  # the token sampled last, not yet in the cache
    sampler: Any = None  # llama_sampler_p while a request runs
    processor: TokenProcessor | None = None  # the request's logit processing, if it asked for any
    logprobs: TokenLogprobs | None = None  # of `last`, when the processor computes them
    adapter: str | None = None  # the adapter key `cached` was computed with (None: the base)


class BatchContext:
    """A llama.cpp context for `slots` sequences of up to `context_length` tokens each."""

    def __init__(
        self, lib: Any, model: Any, *, slots: int, context_length: int, threads: int, n_batch: int = 512
    ) -> None:
        """Raises AgentError when llama.cpp cannot create the context (memory, too many sequences)."""
        if not 1 <= slots <= lib.llama_max_parallel_sequences():
            raise AgentError(
                f"{slots} slots asked of llama.cpp, which runs 1 to {lib.llama_max_parallel_sequences()}",
                hint="lower max_concurrent in agent.yaml",
            )
        self._lib = lib
        params = lib.llama_context_default_params()
        params.n_ctx = context_length * slots
        params.n_seq_max = slots
        params.kv_unified = False
        params.n_batch = params.n_ubatch = max(n_batch, slots)
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        # As llama-cpp-python's Llama runs it (its answers are what the tests compare against).
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        ctx = lib.llama_init_from_model(model, params)
        if not ctx:
            raise AgentError(
                f"llama.cpp could not create a context of {slots} x {context_length} tokens",
                hint="lower max_concurrent or context_length in agent.yaml",
            )
        self._ctx = ctx
        self._model = model
        self._adapters: dict[str, Any] = {}  # key -> llama_adapter_lora_p
        self._active: str | None = None  # the adapter set on the context (None: the base alone)
        self._memory = lib.llama_get_memory(ctx)
        self._n_batch = params.n_batch
        self._batch = lib.llama_batch_init(self._n_batch, 0, 1)
        self._slots = [_Slot() for _ in range(slots)]
        self._n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        self._threads = threads
        self.context_length = lib.llama_n_ctx_seq(ctx)
        self.step_costs: dict[int, float] = {}  # seconds per step of k sequences, once measured

    @property
    def slots(self) -> int:
        """How many sequences this context runs together."""
        return len(self._slots)

    def choose_slot(self, free: Sequence[int], prompt: Sequence[int]) -> int:
        """See base.longest_prefix_slot."""
        return longest_prefix_slot(free, prompt, [state.cached for state in self._slots])

    def prefill(
        self,
        slot: int,
        prompt: Sequence[int],
        params: SamplingParams,
        processor: TokenProcessor | None = None,
    ) -> int:
        """Start `slot` on `prompt` (reusing the cached prefix); the first sampled token. `processor`
        edits each of the slot's logit rows before its sampler picks from it (bias, penalties,
        grammar) and keeps the picked token's logprobs."""
        return token_of(self.prefill_many([(slot, prompt, params, processor)])[0])

    def prefill_many(self, items: Sequence[PrefillItem]) -> list[int | Exception]:
        """Start several slots, each as `prefill` does, their prompts decoded together: the first
        token of each, or its error in its place (a bad prompt, its processor, a failed decode).

        A prompt that shares a prefix with an earlier one of `items` (clients of one app, the same
        system prompt) waits for that one's decode and copies its cache, so the prefix is decoded
        once; the others are decoded in one batch first."""
        if len({slot for slot, *_ in items}) != len(items):
            raise AgentError(f"slots {[slot for slot, *_ in items]} name a slot twice")
        results: dict[int, int | Exception] = {}
        first: list[tuple[int, list[int]]] = []
        later: list[tuple[int, list[int]]] = []
        for slot, prompt, params, processor in items:
            try:
                self._check_prompt(slot, prompt, params)
            except AgentError as exc:
                results[slot] = exc
                continue
            state = self._slot(slot)
            self._free_sampler(state)
            if state.adapter != params.adapter:
                self._forget(slot)  # its cache holds keys and values of another adapter
                state.adapter = params.adapter
            state.sampler = self._new_sampler(params)
            state.processor, state.logprobs = processor, None
            # Beside the caches that exist, a prompt decoded in this call may be a better donor.
            _, known = self._donor(slot, prompt)
            ahead = max(
                (common_prefix(p, prompt) for s, p in first if self._slots[s].adapter == state.adapter),
                default=0,
            )
            (later if min(ahead, len(prompt) - 1) - known >= SHARE_FROM else first).append(
                (slot, list(prompt))
            )
        for group in (first, later):
            for slot, prompt in group:
                self._reuse(slot, prompt)
            for adapter, entries in self._by_adapter(group, lambda entry: entry[0]):
                self._use(adapter)
                results.update(self._decode_prompts(entries))
        return [results[slot] for slot, *_ in items]

    def step(self, slots: Sequence[int]) -> list[int | Exception]:
        """Decode the last token of each slot in one batch; the next token of each, in order.

        A slot that is full, or whose processor fails (its grammar allows no token), has its error
        in its place and stops running; the others are decoded and sampled as without it."""
        states = [self._slot(s) for s in slots]
        if len(set(slots)) != len(slots):
            raise AgentError(f"slots {list(slots)} name a slot twice")
        results: dict[int, int | Exception] = {}
        for s, state in zip(slots, states, strict=True):
            if state.sampler is None:
                raise AgentError(f"slot {s} has no running sequence", hint="prefill it first")
            if len(state.cached) + 1 >= self.context_length:
                results[s] = AgentError(f"slot {s} is full ({self.context_length} tokens)")
        live = [(s, state) for s, state in zip(slots, states, strict=True) if s not in results]
        for adapter, group in self._by_adapter(live, lambda entry: entry[0]):
            self._use(adapter)
            self._fill([(state.last, len(state.cached), s, True) for s, state in group])
            self._decode()
            for row, (s, state) in enumerate(group):
                state.cached.append(state.last)
                results[s] = self._next_token(state, row)
        for s, state in zip(slots, states, strict=True):
            if isinstance(results[s], Exception):
                self._free_sampler(state)  # the sequence has ended
        return [results[s] for s in slots]

    def measure_steps(self, repeats: int = 3) -> dict[int, float]:
        """Time one decode step of k sequences for each k of `measured_sizes` (the least of `repeats`
        after a warm-up), keep the figures in `step_costs` and return them. Call it while no slot runs
        (at warm-up): it decodes a placeholder token in the slots and clears their caches after."""
        if any(state.sampler is not None for state in self._slots):
            raise AgentError("step costs are measured while no slot runs", hint="measure at warm-up")
        sizes = measured_sizes(len(self._slots))
        if (repeats + 1) * len(sizes) >= self.context_length:
            return self.step_costs  # a context this short has no room to measure in: batch all
        # CPU time of this thread when it computes alone (other processes' load does not count),
        # wall time when llama.cpp's OpenMP team computes on other threads as well.
        clock = time.thread_time if self._threads == 1 else time.perf_counter
        self._use(None)
        self._clear(sizes[-1])
        costs = dict.fromkeys(sizes, math.inf)
        positions = [0] * sizes[-1]
        for round_ in range(repeats + 1):
            for k in sizes:
                self._fill([(0, positions[s], s, True) for s in range(k)])
                started = clock()
                self._decode()
                if round_:
                    costs[k] = min(costs[k], clock() - started)
                positions[:k] = [p + 1 for p in positions[:k]]
        self._clear(sizes[-1])
        self.step_costs = costs
        return costs

    def group_size(self, running: int) -> int:
        """How many of `running` sequences the next step should decode (the others wait for the
        following steps): the first group of the cheapest split by `step_costs`; all before they
        are measured."""
        return cheapest_group(self.step_costs, running)

    def logprobs(self, slot: int) -> TokenLogprobs | None:
        """The log-probabilities of the slot's last sampled token (None unless its request asked)."""
        return self._slot(slot).logprobs

    def release(self, slot: int) -> None:
        """End the slot's sequence; its cache stays for a prompt that shares its prefix."""
        self._free_sampler(self._slot(slot))

    def load_adapter(self, key: str, path: Path) -> None:
        """Load the LoRA GGUF at `path` on the model under `key` (`SamplingParams.adapter` names
        it). AgentError when the key is taken or llama.cpp refuses the file (nothing loaded)."""
        if key in self._adapters:
            raise AgentError(f"an adapter is already loaded under {key!r}", hint="unload it first")
        adapter = self._lib.llama_adapter_lora_init(self._model, str(path).encode())
        if not adapter:
            raise AgentError(
                f"{path}: llama.cpp refused the LoRA adapter (its tensors do not fit this model)",
                hint="build the adapter for the base served; the journal has llama.cpp's reason",
            )
        self._adapters[key] = adapter

    def unload_adapter(self, key: str) -> None:
        """Free the adapter loaded under `key` (no running sequence may use it); the caches
        computed with it are forgotten. Nothing when none is loaded under `key`."""
        adapter = self._adapters.pop(key, None)
        if adapter is None:
            return
        if self._active == key:
            self._use(None)  # the context must not hold a freed adapter
        for slot, state in enumerate(self._slots):
            if state.adapter == key:
                self._forget(slot)
                state.adapter = None
        self._lib.llama_adapter_lora_free(adapter)

    @property
    def adapters(self) -> list[str]:
        """The keys of the adapters loaded, sorted."""
        return sorted(self._adapters)

    def close(self) -> None:
        """Free the samplers, the batch, the context and the adapters; the object cannot be used
        afterwards."""
        for state in self._slots:
            self._free_sampler(state)
        if self._ctx:
            self._lib.llama_batch_free(self._batch)
            self._lib.llama_free(self._ctx)
            self._ctx = None
        for adapter in self._adapters.values():
            self._lib.llama_adapter_lora_free(adapter)
        self._adapters.clear()

    # -- internals -----------------------------------------------------------------------------

    def _slot(self, slot: int) -> _Slot:
        if not 0 <= slot < len(self._slots):
            raise AgentError(f"slot {slot} does not exist; this context has {len(self._slots)}")
        return self._slots[slot]

    def _check_prompt(self, slot: int, prompt: Sequence[int], params: SamplingParams) -> None:
        self._slot(slot)
        check_params(params)
        if not prompt or len(prompt) >= self.context_length:
            raise AgentError(
                f"a prompt of {len(prompt)} tokens does not fit a slot of {self.context_length}",
                hint="shorten the prompt",
            )
        if bad := next((t for t in prompt if not 0 <= t < self._n_vocab), None):
            raise AgentError(f"token id {bad} is not in the vocabulary of {self._n_vocab} tokens")
        if params.adapter is not None and params.adapter not in self._adapters:
            raise AgentError(f"no adapter is loaded under {params.adapter!r}", hint="load it first")

    def _use(self, adapter: str | None) -> None:
        """Set `adapter` (None: none) on the context for the next decodes, when it is not set yet."""
        if adapter == self._active:
            return
        if adapter is None:
            self._lib.llama_set_adapters_lora(self._ctx, None, 0, None)
        else:
            adapters = (self._lib.llama_adapter_lora_p_ctypes * 1)(self._adapters[adapter])
            # The user's scale is folded into the GGUF's alpha at build time (build/gguf_adapter.py).
            self._lib.llama_set_adapters_lora(self._ctx, adapters, 1, (ctypes.c_float * 1)(1.0))
        self._active = adapter

    def _by_adapter(
        self, entries: Sequence[T], slot_of: Callable[[T], int]
    ) -> Iterator[tuple[str | None, list[T]]]:
        """`entries` grouped by their slot's adapter (`slot_of(entry)`), in order within a group; the
        group of the adapter set on the context now comes first (one switch fewer)."""
        groups: dict[str | None, list[T]] = {}
        for entry in entries:
            groups.setdefault(self._slots[slot_of(entry)].adapter, []).append(entry)
        yield from sorted(groups.items(), key=lambda item: item[0] != self._active)

    def _forget(self, slot: int) -> None:
        """Empty `slot`'s cache."""
        self._lib.llama_memory_seq_rm(self._memory, slot, -1, -1)
        self._slots[slot].cached = []

    def _reuse(self, slot: int, prompt: list[int]) -> None:
        """Cut `slot`'s cache to the longest prefix of `prompt` that it, or another slot whose
        cache is copied over, holds (the prompt's last token always stays to decode)."""
        state = self._slots[slot]
        donor, _ = self._donor(slot, prompt)
        if donor is not None:
            # The whole stream is copied (llama.cpp copies streams only whole); cut below.
            self._lib.llama_memory_seq_cp(self._memory, donor, slot, -1, -1)
            state.cached = list(self._slots[donor].cached)
        keep = min(common_prefix(state.cached, prompt), len(prompt) - 1)
        if not self._lib.llama_memory_seq_rm(self._memory, slot, keep, -1):
            keep = 0
            self._lib.llama_memory_seq_rm(self._memory, slot, -1, -1)
        state.cached = list(prompt[:keep])

    def _decode_prompts(self, group: list[tuple[int, list[int]]]) -> dict[int, int | Exception]:
        """Decode the uncached rest of each slot's prompt, all in batches of up to n_batch tokens;
        each slot samples its first token from the row of its prompt's last token."""
        entries = [
            (token, position, slot, position == len(prompt) - 1)
            for slot, prompt in group
            for position, token in enumerate(
                prompt[len(self._slots[slot].cached) :], len(self._slots[slot].cached)
            )
        ]
        results: dict[int, int | Exception] = {}
        for start in range(0, len(entries), self._n_batch):
            chunk = entries[start : start + self._n_batch]
            self._fill(chunk)
            try:
                self._decode()
            except AgentError as exc:  # every slot not yet sampled: its cache is in an unknown state
                for slot, _ in group:
                    if slot not in results:
                        results[slot] = exc
                        self._lib.llama_memory_seq_rm(self._memory, slot, -1, -1)
                        self._slots[slot].cached = []
                break
            for row, (token, _, slot, last) in enumerate(chunk):
                state = self._slots[slot]
                state.cached.append(token)
                if last:
                    results[slot] = self._next_token(state, row)
        for slot, result in results.items():
            if isinstance(result, Exception):
                self._free_sampler(self._slots[slot])
        return results

    def _next_token(self, state: _Slot, row: int) -> int | Exception:
        """The slot's token sampled from `row` (its `last`), or the error of this slot alone (its
        grammar, its processing)."""
        try:
            state.last = self._sample(state, row)
        except Exception as exc:
            return exc
        return state.last

    def _donor(self, slot: int, prompt: Sequence[int]) -> tuple[int | None, int]:
        """See base.prefix_donor; only a cache computed with `slot`'s adapter can lend its prefix."""
        adapter = self._slots[slot].adapter
        return prefix_donor(
            slot, prompt, [state.cached if state.adapter == adapter else [] for state in self._slots]
        )

    def _clear(self, slots: int) -> None:
        """Empty the caches of slots 0 to `slots` - 1 (computed with the base, by `measure_steps`)."""
        for slot in range(slots):
            self._forget(slot)
            self._slots[slot].adapter = None

    def _fill(self, entries: Sequence[tuple[int, int, int, bool]]) -> None:
        """Write (token, position, sequence, wants logits) entries into the batch."""
        batch = self._batch
        for i, (token, position, seq, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        batch.n_tokens = len(entries)

    def _decode(self) -> None:
        code = self._lib.llama_decode(self._ctx, self._batch)
        if code != 0:
            # 1: no room in the KV cache; negative: a failure inside llama.cpp.
            raise AgentError(f"llama_decode failed with code {code}", hint="see the agent's journal")

    def _sample(self, state: _Slot, row: int) -> int:
        """The slot's next token from logits row `row` of the last decode, through its processor."""
        if state.processor is not None:
            # The sampler reads the context's logits buffer: the processed row is written in place.
            logits = np.ctypeslib.as_array(
                self._lib.llama_get_logits_ith(self._ctx, row), shape=(self._n_vocab,)
            )
            logits[:] = state.processor.process(logits)
        token = int(self._lib.llama_sampler_sample(state.sampler, self._ctx, row))
        if state.processor is not None:
            state.logprobs = state.processor.accept(token)
        return token

    def _new_sampler(self, params: SamplingParams) -> Any:
        lib = self._lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if params.temperature < GREEDY_BELOW:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
            return chain
        # The torch engine's order: top-k (which temperature does not change), temperature, then
        # top-p on the tempered distribution within the top k.
        if params.top_k > 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(params.top_k))
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(params.temperature))
        if params.top_p < 1:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(params.top_p, 1))
        # A fresh seed when none is asked for: the last request's must not repeat its answers.
        seed = secrets.randbits(31) if params.seed is None else params.seed % 2**32
        lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(ctypes.c_uint32(seed).value))
        return chain

    def _free_sampler(self, state: _Slot) -> None:
        state.processor = state.logprobs = None
        if state.sampler is not None:
            self._lib.llama_sampler_free(state.sampler)
            state.sampler = None


def measured_sizes(slots: int) -> list[int]:
    """The batch sizes whose step is timed: 1 to 4, then powers of two, and `slots` itself (up to
    64); the sizes between are interpolated."""
    sizes = {k for k in (1, 2, 3, 4) if k <= slots} | {slots}
    sizes |= {2**i for i in range(3, 7) if 2**i < slots}
    return sorted(k for k in sizes if k <= _MEASURED_UP_TO)


def cheapest_group(costs: Mapping[int, float], running: int) -> int:
    """The size of the first group when `running` sequences are stepped in the groups whose summed
    cost is least; each group's cost is `costs` at its size, interpolated between measured sizes and
    proportional beyond the largest. `running` itself when nothing was measured."""
    if not costs or running <= 1:
        return max(running, 1)
    measured = sorted(costs.items())

    def cost(k: int) -> float:
        below = max((m for m in measured if m[0] <= k), default=measured[0])
        above = min((m for m in measured if m[0] >= k), default=None)
        if above is None:
            return below[1] * k / below[0]
        if above[0] == below[0]:
            return below[1]
        return below[1] + (above[1] - below[1]) * (k - below[0]) / (above[0] - below[0])

    group_cost = [0.0] + [cost(k) for k in range(1, running + 1)]
    best, first = [0.0] * (running + 1), [0] * (running + 1)
    for n in range(1, running + 1):
        # On a tie the bigger group wins (fewer steps, less Python per token).
        total, negative_k = min((group_cost[k] + best[n - k], -k) for k in range(1, n + 1))
        best[n], first[n] = total, -negative_k
    return first[running]
