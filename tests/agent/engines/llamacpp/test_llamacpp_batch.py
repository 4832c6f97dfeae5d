"""The llama.cpp engine's batched step interface: several sequences per llama_decode, each answering
exactly as it would alone (greedy), with its own seeded sampler, and prefix reuse per slot; the step
costs measured at warm-up and the groups they lead to."""

from __future__ import annotations

import random

import pytest

from deployer.agent.engines import make_engine
from deployer.agent.engines.llamacpp.batch import cheapest_group, measured_sizes
from deployer.agent.types import ChatMessage, SamplingParams
from deployer.errors import AgentError
from tests.agent.engines.llamacpp.conftest import needs_llama_cpp

pytestmark = needs_llama_cpp

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
QUESTIONS = ("Hello, how are you?", "What is the capital of France?", "Count to five.", "Name a colour.")
TINY_VOCAB = 384


def _engine(artifact_dir, slots=4, context_length=256):
    engine = make_engine("llama.cpp", context_length=context_length, threads=1, slots=slots)
    engine.load(artifact_dir)
    return engine


def _alone(engine, prompt, params, n):
    tokens = [engine.prefill(0, prompt, params)]
    while len(tokens) < n:
        tokens += engine.step([0])
    engine.release(0)
    return tokens


def _together(engine, prompts, params, n, stagger=0):
    """Run every prompt in its own slot; slot i joins after i*stagger steps of the others."""
    out: dict[int, list[int]] = {}
    step = 0
    while len(out) < len(prompts) or any(len(t) < n for t in out.values()):
        for i, prompt in enumerate(prompts):
            if i not in out and step >= i * stagger:
                out[i] = [engine.prefill(i, prompt, params[i] if isinstance(params, list) else params)]
        running = [i for i, t in out.items() if len(t) < n]
        if running:
            for i, token in zip(running, engine.step(running), strict=True):
                out[i].append(token)
        step += 1
    for i in out:
        engine.release(i)
    return [out[i] for i in range(len(prompts))]


def _prompts(engine):
    return [engine.chat_prompt([ChatMessage("user", q)]) for q in QUESTIONS]


def _random_prompts():
    """Prompts of seeded random ids: the random tiny model answers each differently (its answers to
    the chat prompts above all start alike)."""
    rng = random.Random(0)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(8 + 3 * i)] for i in range(4)]


def test_greedy_answers_are_the_same_alone_and_in_a_batch(tiny_gguf_dir):
    engine = _engine(tiny_gguf_dir)
    prompts = _random_prompts()
    alone = [_alone(engine, p, GREEDY, 24) for p in prompts]
    assert len({tuple(a) for a in alone}) > 1  # the prompts lead to different answers
    assert _together(engine, prompts, GREEDY, 24) == alone
    # Joining a batch that is already running (continuous batching) changes nothing either.
    assert _together(engine, prompts, GREEDY, 24, stagger=3) == alone


def test_seeded_sampling_in_a_batch_repeats_what_it_does_alone(tiny_gguf_dir):
    engine = _engine(tiny_gguf_dir)
    prompts = _prompts(engine)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=s) for s in range(4)]
    alone = [_alone(engine, p, params[i], 16) for i, p in enumerate(prompts)]
    assert _together(engine, prompts, params, 16) == alone
    other_seed = _alone(engine, prompts[0], SamplingParams(temperature=1.0, top_p=0.9, seed=99), 16)
    assert other_seed != alone[0]


def test_a_prompt_that_extends_what_a_slot_holds_gives_the_same_answer(tiny_gguf_dir):
    engine = _engine(tiny_gguf_dir, slots=1)
    first, second = _prompts(engine)[:2]
    fresh = _alone(engine, first + second, GREEDY, 12)
    engine.prefill(0, first, GREEDY)  # the slot now holds `first`: only `second` is decoded next
    engine.release(0)
    assert _alone(engine, first + second, GREEDY, 12) == fresh


def _spy_decodes(engine):
    """The sizes of the batches `engine` decodes from now on, in a list that grows."""
    batch, decoded = engine._loaded.batch, []
    real_fill = batch._fill

    def fill_spy(entries):
        decoded.append(len(entries))
        real_fill(entries)

    batch._fill = fill_spy
    return decoded


def _steps_after(engine, slots, firsts, n):
    """The answers of `slots`, started with tokens `firsts`, stepped together to `n` tokens each."""
    got = {s: [t] for s, t in zip(slots, firsts, strict=True)}
    while running := [s for s in got if len(got[s]) < n]:
        for s, token in zip(running, engine.step(running), strict=True):
            got[s].append(token)
    for s in slots:
        engine.release(s)
    return [got[s] for s in slots]


def test_prompts_started_together_answer_as_alone_in_one_decode(tiny_gguf_dir):
    engine = _engine(tiny_gguf_dir)
    prompts = _random_prompts()
    alone = [_alone(engine, p, GREEDY, 16) for p in prompts]
    fresh = _engine(tiny_gguf_dir)
    decoded = _spy_decodes(fresh)
    firsts = fresh.prefill_many([(s, p, GREEDY) for s, p in enumerate(prompts)])
    assert decoded == [sum(len(p) for p in prompts)]  # every prompt in a single llama_decode
    assert _steps_after(fresh, [0, 1, 2, 3], firsts, 16) == alone


def test_prompts_started_together_decode_their_shared_prefix_once(tiny_gguf_dir):
    rng = random.Random(2)
    shared = [rng.randrange(3, TINY_VOCAB) for _ in range(40)]  # one app's system prompt
    prompts = [[*shared, 5, 6], [*shared, 7], list(shared), _random_prompts()[0]]
    baseline = _engine(tiny_gguf_dir)
    alone = [_alone(baseline, p, GREEDY, 12) for p in prompts]
    engine = _engine(tiny_gguf_dir)
    decoded = _spy_decodes(engine)
    firsts = engine.prefill_many([(s, p, GREEDY) for s, p in enumerate(prompts)])
    # First the prompts that share nothing with an earlier one, then the others from their caches:
    # [7] for the second; the third is the prefix itself, of which its last token is decoded.
    assert decoded == [len(prompts[0]) + len(prompts[3]), 1 + 1]
    assert _steps_after(engine, [0, 1, 2, 3], firsts, 12) == alone


def test_a_bad_prompt_started_with_others_fails_alone(tiny_gguf_dir):
    engine = _engine(tiny_gguf_dir)
    good = _random_prompts()[:2]
    too_long = [3] * engine._loaded.batch.context_length
    alone = [_alone(engine, p, GREEDY, 8) for p in good]
    results = engine.prefill_many(
        [
            (0, good[0], GREEDY),
            (1, too_long, GREEDY),
            (2, good[1], GREEDY),
            (3, [1], SamplingParams(top_k=-1)),
        ]
    )
    assert isinstance(results[1], AgentError) and "does not fit" in str(results[1])
    assert isinstance(results[3], AgentError)
    assert _steps_after(engine, [0, 2], [results[0], results[2]], 8) == alone
    with pytest.raises(AgentError, match="twice"):
        engine.prefill_many([(0, good[0], GREEDY), (0, good[1], GREEDY)])


def test_a_prompt_starts_from_another_slots_cache_and_answers_the_same(tiny_gguf_dir):
    rng = random.Random(1)
    shared = [rng.randrange(3, TINY_VOCAB) for _ in range(40)]  # a system prompt, say
    first, second = [*shared, 5, 6, 7], [*shared, 8, 9]
    baseline = _engine(tiny_gguf_dir)
    expected = [_alone(baseline, p, GREEDY, 12) for p in (first, second)]
    engine = _engine(tiny_gguf_dir)
    decoded = _spy_decodes(engine)
    got = {0: [engine.prefill(0, first, GREEDY)]}
    got[0] += engine.step([0])
    got[1] = [engine.prefill(1, second, GREEDY)]  # slot 0 runs, its cache starts with `shared`
    assert decoded[-1] == 2  # only [8, 9]: the 40 shared tokens were copied from slot 0
    while running := [s for s in got if len(got[s]) < 12]:
        for s, token in zip(running, engine.step(running), strict=True):
            got[s].append(token)
    assert [got[0], got[1]] == expected


def test_a_prompt_goes_to_the_free_slot_that_holds_most_of_it(tiny_gguf_dir):
    engine = _engine(tiny_gguf_dir, slots=3)
    first, second = _random_prompts()[:2]
    engine.prefill(1, first, GREEDY)
    engine.prefill(2, second, GREEDY)
    engine.release(1)
    engine.release(2)
    assert engine.choose_slot([0, 1, 2], [*first, 7]) == 1
    assert engine.choose_slot([0, 2], second) == 2
    assert engine.choose_slot([0, 1], second) == 0  # nothing shared: the first free one


def test_bad_slots_and_prompts_are_refused(tiny_gguf_dir):
    engine = _engine(tiny_gguf_dir, slots=2, context_length=64)
    prompt = _prompts(engine)[0]
    assert engine.max_slots == 2
    with pytest.raises(AgentError, match="slot 2 does not exist"):
        engine.prefill(2, prompt, GREEDY)
    with pytest.raises(AgentError, match="no running sequence"):
        engine.step([1])
    with pytest.raises(AgentError, match="does not fit"):
        engine.prefill(0, prompt * 10, GREEDY)
    with pytest.raises(AgentError, match="token id 999 is not in the vocabulary"):
        engine.prefill(0, [1, 999], GREEDY)
    engine.prefill(0, prompt, GREEDY)
    with pytest.raises(AgentError, match="twice"):
        engine.step([0, 0])
    assert len(engine.step([0])) == 1  # still usable after the refusals
    # a full slot ends with an error, not a crash, and the slot beside it steps on as alone
    beside = [engine.prefill(1, prompt, GREEDY)]
    full: int | Exception = 0
    while isinstance(full, int):
        full, token = engine.step([0, 1])
        beside.append(token)
    assert isinstance(full, AgentError) and "is full" in str(full)
    with pytest.raises(AgentError, match="no running sequence"):
        engine.step([0])
    engine.release(1)
    assert beside == _alone(engine, prompt, GREEDY, len(beside))


# Seconds per step of k sequences of SmolLM2 Q8_0 on 2 AVX2 cores, 1 thread (llama-cpp-python 0.3.36):
# one sequence goes through ggml's vec_dot kernels, two or more through tinyBLAS, slower here.
X86_Q8_0 = {1: 0.0081, 2: 0.0324, 3: 0.0422, 4: 0.0409, 8: 0.0421, 16: 0.0859}


def test_sequences_are_stepped_apart_where_that_costs_less():
    assert [cheapest_group(X86_Q8_0, n) for n in (1, 2, 3, 4, 5)] == [1, 1, 1, 1, 1]
    assert cheapest_group(X86_Q8_0, 8) == 8  # 42 ms for 8, against 65 ms one by one
    assert cheapest_group(X86_Q8_0, 16) == 8  # two steps of 8 cost a little less than one of 16
    assert cheapest_group(X86_Q8_0, 40) == 8  # beyond 16: proportional to the 16-step
    # Where batching pays (a step of 4 costs about 2 of 1), everything goes in one step.
    assert cheapest_group({1: 0.008, 2: 0.013, 4: 0.017, 8: 0.03}, 7) == 7
    assert cheapest_group({}, 5) == 5  # nothing measured: one step for all


def test_step_sizes_measured_are_the_small_ones_and_powers_of_two():
    assert measured_sizes(1) == [1]
    assert measured_sizes(4) == [1, 2, 3, 4]
    assert measured_sizes(12) == [1, 2, 3, 4, 8, 12]
    assert measured_sizes(256) == [1, 2, 3, 4, 8, 16, 32, 64]


def test_measuring_the_steps_leaves_the_slots_as_they_were(tiny_gguf_dir):
    engine = _engine(tiny_gguf_dir)
    prompts = _random_prompts()
    before = [_alone(engine, p, GREEDY, 12) for p in prompts]
    engine.prefill(0, prompts[0], GREEDY)
    with pytest.raises(AgentError, match="while no slot runs"):
        engine._loaded.batch.measure_steps()
    engine.release(0)
    engine.warmup()  # measures
    costs = engine._loaded.batch.step_costs
    assert sorted(costs) == [1, 2, 3, 4]
    assert all(0 < seconds < 1 for seconds in costs.values())
    assert engine.describe().extra["step_ms"].startswith("1:")
    assert [_alone(engine, p, GREEDY, 12) for p in prompts] == before
    assert _together(engine, prompts, GREEDY, 12) == before
    assert 1 <= engine.step_group(4) <= 4


@pytest.mark.slow
def test_smollm2_greedy_answers_are_the_same_alone_and_in_a_batch(smollm2_gguf_dir):
    engine = _engine(smollm2_gguf_dir, context_length=512)
    prompts = _prompts(engine)
    alone = [_alone(engine, p, GREEDY, 24) for p in prompts]
    assert _together(engine, prompts, GREEDY, 24, stagger=2) == alone
