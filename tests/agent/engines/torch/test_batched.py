"""The batched step interface of the torch engine on CPU: exactness against transformers,
batched equal to alone, prefix reuse, per-request seeds, bad input, fallbacks."""

from __future__ import annotations

import threading

import pytest
import torch

from deployer.agent.engines.base import common_prefix
from deployer.agent.types import SamplingParams
from deployer.errors import AgentError
from tests.agent.engines.torch.steps import GREEDY, PROMPTS, run


@pytest.fixture(scope="module")
def engine(varied_model_dir, engine_on):
    return engine_on(varied_model_dir, slots=4)


def test_greedy_128_tokens_equal_transformers_generate(varied_model_dir, engine):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(varied_model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # run all 128 tokens, as our step does
    model.generation_config.pad_token_id = 0
    prompt = engine.encode(PROMPTS[0])
    ours = run(engine, 0, prompt, GREEDY, 128)
    with torch.inference_mode():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=128, do_sample=False)[0, len(prompt) :]
    assert len(set(ours)) > 20  # the comparison covers many different tokens
    assert ours == want.tolist()


def test_batched_steps_equal_each_sequence_alone(engine):
    prompts = [engine.encode(p) for p in PROMPTS]
    params = [GREEDY, SamplingParams(temperature=0.9, top_p=0.9, seed=7), SamplingParams(top_k=5, seed=3)]
    alone = [run(engine, 0, p, s, 24) for p, s in zip(prompts, params, strict=True)]
    # slot 3 and slot 1 start together; slot 0 joins after 5 steps; slot 1 leaves after 12
    got = {3: [engine.prefill(3, prompts[0], params[0])], 1: [engine.prefill(1, prompts[1], params[1])]}
    for i in range(1, 24 + 5):
        if i == 5:
            got[0] = [engine.prefill(0, prompts[2], params[2])]
        running = [s for s in (3, 1, 0) if s in got and len(got[s]) < (12 if s == 1 else 24)]
        if not running:
            break
        for s, token in zip(running, engine.step(running), strict=True):
            got[s].append(token)
    for s in (3, 1, 0):
        engine.release(s)
    assert got[3] == alone[0]
    assert got[1] == alone[1][:12]
    assert got[0] == alone[2]


def test_prefix_reuse_skips_the_shared_part_and_changes_nothing(varied_model_dir, engine_on):
    engine = engine_on(varied_model_dir, slots=2)
    fresh = engine_on(varied_model_dir, slots=2)
    system = engine.encode("You are a helpful assistant. The capital of France is Paris.")
    first_turn = run(engine, 1, system, GREEDY, 10)
    second = system + first_turn + engine.encode(" And of Italy?")
    before = int(engine.describe().extra["prefix_tokens_reused"])
    reused = run(engine, 1, second, GREEDY, 20)
    # the slot held the system prompt and 9 of the 10 tokens (the last was never run)
    assert int(engine.describe().extra["prefix_tokens_reused"]) - before == len(system) + 9
    assert reused == run(fresh, 0, second, GREEDY, 20)
    # a prompt that diverges early reuses only the common part and still answers the same
    other = system[:3] + engine.encode(" something else entirely")
    assert run(engine, 1, other, GREEDY, 12) == run(fresh, 1, other, GREEDY, 12)


def _continue(engine, firsts, slots, n):
    """Step `slots` (started with `firsts`) together for n - 1 more tokens; each one's tokens."""
    got = [[first] for first in firsts]
    for _ in range(n - 1):
        for tokens, token in zip(got, engine.step(slots), strict=True):
            tokens.append(token)
    for slot in slots:
        engine.release(slot)
    return got


def test_prompts_started_together_copy_a_shared_prefix_and_answer_as_alone(varied_model_dir, engine_on):
    engine = engine_on(varied_model_dir, slots=4)
    fresh = engine_on(varied_model_dir, slots=4)
    system = engine.encode("You are a helpful assistant. The capital of France is Paris. Be brief.")
    prompts = [system + engine.encode(q) for q in (" And of Italy?", " And of Spain?")]
    prompts += [system, engine.encode(PROMPTS[2])]
    alone = [run(fresh, 0, p, GREEDY, 12) for p in prompts]
    before = int(engine.describe().extra["prefix_tokens_reused"])
    firsts = engine.prefill_many([(slot, p, GREEDY) for slot, p in enumerate(prompts)])
    # slots 1 and 2 copied from slot 0, run earlier in the same call: slot 1 what its prompt
    # shares with slot 0's (the system prompt and " And of"), slot 2 all but the last token of its
    # prompt, the system prompt itself
    shared = common_prefix(prompts[0], prompts[1])
    assert shared > len(system)
    assert int(engine.describe().extra["prefix_tokens_reused"]) - before == shared + len(system) - 1
    assert _continue(engine, firsts, [0, 1, 2, 3], 12) == alone
    # again: every prompt is in its slot's cache up to its last token, and those four last tokens
    # run as one batched step
    firsts = engine.prefill_many([(slot, p, GREEDY) for slot, p in enumerate(prompts)])
    assert _continue(engine, firsts, [0, 1, 2, 3], 12) == alone


def test_a_bad_prompt_among_others_fails_alone(engine):
    good = engine.encode(PROMPTS[0])
    want = run(engine, 0, good, GREEDY, 4)
    out = engine.prefill_many([(0, [10**9], GREEDY), (1, good, GREEDY), (2, good, SamplingParams(top_k=-1))])
    assert isinstance(out[0], AgentError) and "token id 1000000000 is not in the vocabulary" in str(out[0])
    assert isinstance(out[2], AgentError) and "top_k" in str(out[2])
    assert _continue(engine, [out[1]], [1], 4) == [want]
    with pytest.raises(AgentError, match="name a slot twice"):
        engine.prefill_many([(0, good, GREEDY), (0, good, GREEDY)])


def test_same_seed_same_tokens_different_seed_different(engine):
    prompt = engine.encode(PROMPTS[1])
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    a = [engine.prefill(0, prompt, params), engine.prefill(1, prompt, params)]
    for _ in range(15):
        a += engine.step([0, 1])
    assert a[0::2] == a[1::2]  # two requests with one seed, stepped together
    assert a[0::2] == run(engine, 2, prompt, params, 16)
    assert a[0::2] != run(engine, 2, prompt, SamplingParams(temperature=1.0, top_p=0.95, seed=43), 16)
    engine.release(0)
    engine.release(1)


def test_bad_slots_and_prompts_are_refused(varied_model_dir, engine_on):
    engine = engine_on(varied_model_dir, slots=2, max_context=32)
    prompt = engine.encode(PROMPTS[0])
    with pytest.raises(AgentError, match=r"slot 2 does not exist: this engine has slots 0\.\.1"):
        engine.prefill(2, prompt, GREEDY)
    with pytest.raises(AgentError, match="slot -1 does not exist"):
        engine.step([-1])
    with pytest.raises(AgentError, match="slot 1 is not running"):
        engine.step([1])
    with pytest.raises(AgentError, match="context holds 32"):
        engine.prefill(0, list(range(3, 40)), GREEDY)
    with pytest.raises(AgentError, match="top_k"):
        engine.prefill(0, prompt, SamplingParams(top_k=-1))
    engine.prefill(0, prompt, GREEDY)
    with pytest.raises(AgentError, match="distinct slots"):
        engine.step([0, 0])
    # a sequence may run until its cache is full; one step more ends it with an error (not a
    # crash) while the sequence beside it gets its token as alone
    alone = run(engine, 1, prompt, GREEDY, 2)
    for _ in range(32 - len(prompt)):
        engine.step([0])
    first = engine.prefill(1, prompt, GREEDY)
    full, second = engine.step([0, 1])
    assert isinstance(full, AgentError) and "filled its 32 cache positions" in str(full)
    assert [first, second] == alone
    with pytest.raises(AgentError, match="slot 0 is not running"):
        engine.step([0])
    engine.release(0)
    engine.release(1)
    assert engine.max_slots == 2


def test_an_engine_with_compile_off_runs_eager_layers_on_a_model_compiled_before(varied_model_dir, engine_on):
    from deployer.agent.engines.torch.engine import TorchEngine

    compiled = engine_on(varied_model_dir)
    layers = compiled._require().loaded.model.model.layers
    for layer in layers:
        layer.compile()  # lazy: as an engine with compile on leaves them, without compiling here
    eager = TorchEngine(max_context=256, slots=4, compile="off")
    eager.attach(compiled._require().loaded)
    assert all(layer._compiled_call_impl is None for layer in layers)
    assert eager.describe().extra["compile"] == "off"


def test_compile_that_fails_falls_back_to_eager_with_the_reason(varied_model_dir, engine_on, monkeypatch):
    # A fake: torch.compile works here, so stand in for a device without a C++ compiler. On a
    # CPU the engine compiles the whole decode step, which fails at its first call.
    def broken_compile(fn, *args, **kwargs):
        def fail(*a, **k):
            raise RuntimeError("no C++ compiler found")

        return fail

    monkeypatch.setattr(torch, "compile", broken_compile)
    engine = engine_on(varied_model_dir, compile="on")
    extra = engine.describe().extra
    assert extra["compile"] == "off (compile failed: RuntimeError: no C++ compiler found)"
    assert extra["decode"] == extra["prefill"] == "eager (CUDA graphs are for CUDA devices)"
    prompt = engine.encode(PROMPTS[0])
    assert run(engine, 0, prompt, GREEDY, 8) == run(engine_on(varied_model_dir), 0, prompt, GREEDY, 8)


def test_without_usable_fused_kernels_the_exact_ops_run_torchs_and_say_why(engine):
    from deployer.agent.engines.torch import exact_ops

    assert engine.describe().extra["fused_ops"] == "torch (fused kernels are for CUDA)"
    # Here triton is missing (CI) or there is no card to check its kernels on: either way the
    # ops must fall back, with the reason, rather than fail a CUDA model's load.
    kernels, note = exact_ops._fused_kernels.__wrapped__()
    assert kernels is None
    assert note.startswith("torch (fused kernels unavailable: ") and len(note) > 40, note


def test_the_compiled_cpu_step_gives_the_eager_tokens_alone_and_batched(varied_model_dir, engine, engine_on):
    compiled = engine_on(varied_model_dir, slots=4, compile="on")
    assert compiled.describe().extra["compile"] == "on (decode step, inductor C++ wrapper)"
    prompts = [engine.encode(p) for p in PROMPTS[:2]]
    assert run(compiled, 0, prompts[0], GREEDY, 128) == run(engine, 0, prompts[0], GREEDY, 128)
    # rows 0..2 in one step (the batch graph); slot 1 runs no sequence and writes only scratch
    got = [[compiled.prefill(0, prompts[0], GREEDY)], [compiled.prefill(2, prompts[1], GREEDY)]]
    for _ in range(15):
        for tokens, token in zip(got, compiled.step([0, 2]), strict=True):
            tokens.append(token)
    assert got == [run(engine, 0, p, GREEDY, 16) for p in prompts]


def test_compiled_decode_layers_give_the_eager_logits_bit_for_bit_in_bf16(varied_model_dir, engine_on):
    # The engine's CUDA compile (_compile_layers: exact ops on, each decode layer compiled with
    # exact_ops.EMULATE_CASTS), run here by inductor's CPU backend. With neither, the compiled
    # layers' logits differed from eager by up to 0.0078 (torch 2.13).
    from deployer.agent.engines.torch.compile import _compile_layers

    engine = engine_on(varied_model_dir, dtype="bf16", compile="off")
    loaded = engine._require().loaded
    model, ids = loaded.model, engine.encode(PROMPTS[1])

    def decode_each() -> torch.Tensor:
        rows = []
        with torch.inference_mode():
            model.prefill(torch.tensor([ids[:4]]), 0, 0)
            for pos in range(4, len(ids)):
                # two rows, the second at the scratch position: the batched shapes of a step
                tokens, positions = torch.tensor([ids[pos], 0]), torch.tensor([pos, model.scratch_position])
                rows.append(model.decode(tokens, positions)[0])
        return torch.stack(rows)

    eager = decode_each()
    torch._dynamo.utils.counters.clear()
    compiled, note = _compile_layers(loaded, engine._require().io.step)
    assert compiled, note
    assert torch.equal(decode_each(), eager)
    # Every layer runs one compiled code per batch size (1 in the compile's trial, 2 here): a
    # first layer with a code of its own doubled them, past dynamo's limit of 8 at 5 CUDA buckets.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_a_background_compile_serves_eager_steps_until_the_compiled_step_is_ready(
    varied_model_dir, engine, engine_on, monkeypatch
):
    from deployer.agent.engines.torch import compile as torch_compile

    # Hold the compile until the engine has served eager steps: a deterministic "while compiling".
    release, compile_step = threading.Event(), torch_compile._compile_step

    def held(loaded, io):
        assert release.wait(60), "the test never released the compile"
        return compile_step(loaded, io)

    monkeypatch.setattr(torch_compile, "_compile_step", held)
    compiling = engine_on(varied_model_dir, slots=4, compile="on", background_compile=True)
    assert compiling.describe().extra["compile"].startswith("compiling in the background")
    assert not compiling.wait_compiled(0)
    prompt = engine.encode(PROMPTS[0])
    want = run(engine, 0, prompt, GREEDY, 64)
    first = [compiling.prefill(0, prompt, GREEDY)] + [compiling.step([0])[0] for _ in range(31)]
    assert compiling._require().decode.step is None  # those 32 tokens came from eager steps
    release.set()
    assert compiling.wait_compiled(300)
    note = compiling.describe().extra["compile"]
    assert note.startswith("on (decode step, inductor C++ wrapper), ready after "), note
    assert compiling._require().decode.step is not None
    # The same sequence goes on with compiled steps and gives the eager engine's tokens.
    rest = [compiling.step([0])[0] for _ in range(32)]
    compiling.release(0)
    assert first + rest == want


def test_a_background_compile_that_fails_keeps_serving_eager_with_the_reason(
    varied_model_dir, engine, engine_on, monkeypatch
):
    from deployer.agent.engines.torch import compile as torch_compile

    def broken(loaded, io):
        raise RuntimeError("inductor crashed")  # a fake: stands in for a backend bug

    monkeypatch.setattr(torch_compile, "_compile_step", broken)
    compiling = engine_on(varied_model_dir, compile="on", background_compile=True)
    assert compiling.wait_compiled(60)
    assert compiling.describe().extra["compile"] == "off (compile failed: RuntimeError: inductor crashed)"
    prompt = engine.encode(PROMPTS[1])
    assert run(compiling, 0, prompt, GREEDY, 16) == run(engine, 0, prompt, GREEDY, 16)


def test_background_compile_is_for_cpu_steps_compiled_on_request(varied_model_dir, engine_on):
    off = engine_on(varied_model_dir, compile="off", background_compile=True)
    assert off.wait_compiled(0) and off.describe().extra["compile"] == "off"
