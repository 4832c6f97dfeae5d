"""Speculative decoding with an int4 draft (engines/torch/speculative.py): the model's greedy tokens
whatever the draft proposes, alone, after batched steps, at the end of the cache, compiled;
sampled and processed requests never speculate; bad settings are refused."""

from __future__ import annotations

import pytest
import torch

from deployer.agent.engines.torch.engine import TorchEngine
from deployer.agent.engines.torch.speculative import accepted_run
from deployer.agent.types import SamplingParams
from deployer.errors import AgentError
from tests.agent.engines.torch.steps import GREEDY, PROMPTS, run


@pytest.fixture(scope="module")
def plain(varied_model_dir, engine_on):
    return engine_on(varied_model_dir, slots=2)


@pytest.fixture(scope="module")
def drafted(varied_model_dir, engine_on):
    return engine_on(varied_model_dir, slots=2, draft="int4")


def stats(engine):
    return engine._require().drafter.stats


def test_the_round_keeps_the_agreed_proposals_and_the_models_next_pick():
    assert accepted_run([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all agreed, plus one
    assert accepted_run([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the model's pick where they part
    assert accepted_run([5, 6, 7], [4, 6, 7, 8]) == [4]


def test_greedy_tokens_are_the_models_own_for_128_tokens(plain, drafted):
    before = stats(drafted).rounds
    for text in PROMPTS:
        prompt = plain.encode(text)
        assert run(drafted, 0, prompt, GREEDY, 128) == run(plain, 0, prompt, GREEDY, 128)
    rounds = stats(drafted).rounds - before
    # Speculation ran, and gained tokens: fewer rounds than tokens.
    assert 0 < rounds < 2 * 127
    assert stats(drafted).accepted > 0
    assert "proposals accepted" in drafted.describe().extra["draft"]


def test_after_batched_steps_the_draft_catches_up_and_the_tokens_stay_the_models(plain, drafted):
    prompts = [plain.encode(p) for p in PROMPTS[:2]]
    alone = [run(plain, s, p, GREEDY, 40) for s, p in enumerate(prompts)]
    got = [[drafted.prefill(0, prompts[0], GREEDY)], [drafted.prefill(1, prompts[1], GREEDY)]]
    for _ in range(9):  # both running: one token a step each, no speculation
        for tokens, token in zip(got, drafted.step([0, 1]), strict=True):
            tokens.append(token)
    drafted.release(1)
    rounds = stats(drafted).rounds
    while len(got[0]) < 40:  # slot 0 alone: speculates from a draft cache 9 tokens behind
        got[0].append(drafted.step([0])[0])
    drafted.release(0)
    assert stats(drafted).rounds > rounds
    assert got[0] == alone[0]
    assert got[1] == alone[1][:10]


def test_a_step_of_two_slots_returns_tokens_a_round_decided_and_runs_the_other(plain, drafted):
    prompts = [plain.encode(p) for p in PROMPTS[:2]]
    alone = [run(plain, s, p, GREEDY, 24) for s, p in enumerate(prompts)]
    first = [drafted.prefill(0, prompts[0], GREEDY)]
    first.append(drafted.step([0])[0])  # a round: more tokens wait in slot 0
    second = [drafted.prefill(1, prompts[1], GREEDY)]
    while len(second) < 20:
        a, b = drafted.step([0, 1])
        first.append(a)
        second.append(b)
    drafted.release(0)
    drafted.release(1)
    assert first == alone[0][:21]
    assert second == alone[1][:20]


def test_sampled_and_processed_requests_never_speculate(plain, drafted):
    prompt = plain.encode(PROMPTS[0])
    before = stats(drafted).rounds
    sampled = SamplingParams(temperature=0.9, seed=7)
    processed = SamplingParams(temperature=0, logit_bias=((5, 2.0),))
    for params in (sampled, processed):
        assert run(drafted, 0, prompt, params, 24) == run(plain, 0, prompt, params, 24)
    assert stats(drafted).rounds == before


def test_at_the_end_of_the_cache_rounds_shrink_and_a_full_cache_is_an_error(varied_model_dir, engine_on):
    small_plain = engine_on(varied_model_dir, max_context=40)
    small = engine_on(varied_model_dir, max_context=40, draft="int4")
    prompt = small.encode(PROMPTS[1])
    n = 40 - len(prompt)  # every position: the last round has room for fewer than DRAFT_TOKENS
    assert run(small, 0, prompt, GREEDY, n) == run(small_plain, 0, prompt, GREEDY, n)
    small.prefill(0, prompt, GREEDY)
    results = [small.step([0])[0] for _ in range(n + 1)]  # the first token came from the prefill
    assert not any(isinstance(r, Exception) for r in results[:-1])
    assert isinstance(results[-1], AgentError)
    assert "filled its 40 cache positions" in str(results[-1])


def test_with_compiled_steps_and_draft_the_tokens_stay_the_models(varied_model_dir, plain, engine_on):
    compiled = engine_on(varied_model_dir, slots=2, compile="on", draft="int4")
    assert compiled._require().drafter.step is not None
    assert "compiled" in compiled.describe().extra["draft"]
    prompt = plain.encode(PROMPTS[0])
    assert run(compiled, 0, prompt, GREEDY, 64) == run(plain, 0, prompt, GREEDY, 64)


def test_in_the_agent_the_draft_compiles_after_the_model_in_background(varied_model_dir, plain, engine_on):
    engine = engine_on(varied_model_dir, slots=2, compile="on", draft="int4", background_compile=True)
    prompt = plain.encode(PROMPTS[1])
    assert run(engine, 0, prompt, GREEDY, 32) == run(plain, 0, prompt, GREEDY, 32)  # served meanwhile
    assert engine.wait_compiled(600)
    assert engine._require().drafter.step is not None
    assert ", compiled, for a lone greedy sequence" in engine.describe().extra["draft"]
    assert run(engine, 0, prompt, GREEDY, 32) == run(plain, 0, prompt, GREEDY, 32)


def test_a_bad_draft_is_refused_one_that_cannot_work_is_off_saying_why(varied_model_dir, build, monkeypatch):
    with pytest.raises(AgentError, match="draft must be off or int4"):
        TorchEngine(draft="int3")
    engine = TorchEngine(dtype="auto", max_context=64, draft="int4")
    engine.load(build(varied_model_dir, "int4", 32))  # serves, without a draft
    assert engine.describe().extra["draft"].startswith("off (")
    assert "would be the model itself" in engine.describe().extra["draft"]
    prompt = engine.encode(PROMPTS[0])
    assert len(run(engine, 0, prompt, GREEDY, 8)) == 8
    # No CUDA device here: pretend torch sees one (device auto would choose it), then stop before a load.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "a GPU")
    on_cuda = TorchEngine(device="auto", draft="int4")
    assert on_cuda._draft_off == "off (int4 asked for: the draft is for CPU devices, this model runs on cuda)"
