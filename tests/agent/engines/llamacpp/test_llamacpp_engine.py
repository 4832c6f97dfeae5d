"""The llama.cpp engine on GGUF artifacts of the tiny checkpoint (and, slow, of SmolLM2)."""

from __future__ import annotations

import shutil
import sys
import threading

import pytest

from deployer.agent.chat import ChatTemplate, TextCodec
from deployer.agent.engines import make_engine
from deployer.agent.types import ChatMessage, SamplingParams
from deployer.build.gguf_writer import GGUF_NAME
from deployer.errors import AgentError, FormatError
from tests.agent.engines.llamacpp.conftest import build_gguf, needs_llama_cpp

MESSAGES = [ChatMessage("user", "Hello, how are you today?")]


def _engine(artifact_dir, context_length=256):
    engine = make_engine("llama.cpp", context_length=context_length, threads=1)
    engine.load(artifact_dir)
    return engine


def _run(engine, prompt, **params):
    return list(engine.stream(prompt, SamplingParams(**params)))


def test_a_missing_llama_cpp_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # what `import llama_cpp` sees when absent
    with pytest.raises(AgentError, match="llama-cpp-python") as info:
        make_engine("llama.cpp")
    assert "pip install 'sits-deployer[llamacpp]'" in info.value.hint


def test_the_llama_cpp_engine_refuses_a_cuda_device():
    with pytest.raises(AgentError, match="runs on the CPU") as info:
        make_engine("llama.cpp", device="cuda")
    assert "device: cpu" in info.value.hint and "device: auto" in info.value.hint


@needs_llama_cpp
def test_device_auto_runs_the_llama_cpp_engine_on_the_cpu(tiny_gguf_dir):
    engine = make_engine("llama.cpp", context_length=256, threads=1, device="auto")
    engine.load(tiny_gguf_dir)
    info = engine.describe()
    assert (info.device, info.extra["device_choice"]) == ("cpu", "cpu (the llama.cpp engine runs on the CPU)")


@needs_llama_cpp
def test_describe_reports_the_gguf_model(tiny_gguf_dir):
    info = _engine(tiny_gguf_dir).describe()
    assert (info.engine, info.model, info.version, info.quantization) == (
        "llama.cpp",
        "tiny",
        "1.0.0",
        "Q8_0",
    )
    assert (info.context_length, info.device, info.extra["threads"]) == (256, "cpu", "1")


@needs_llama_cpp
def test_the_chat_prompt_tokenizes_like_the_source_tokenizer(tiny_gguf_dir, tiny_model_dir):
    engine = _engine(tiny_gguf_dir)
    text = ChatTemplate.from_dir(tiny_model_dir).render(MESSAGES, add_generation_prompt=True)
    expected = TextCodec.from_dir(tiny_model_dir).encode(text, add_special_tokens=False)
    assert engine.chat_prompt(MESSAGES) == expected
    assert engine.decode(expected[1:4]) == TextCodec.from_dir(tiny_model_dir).decode(expected[1:4])


@needs_llama_cpp
def test_greedy_fp32_matches_the_torch_engine(tiny_model_dir, tmp_path):
    gguf_dir = build_gguf(tiny_model_dir, tmp_path / "store", scheme="fp32")
    ours = _engine(gguf_dir)
    torch_engine = make_engine("torch", context_length=256, threads=1)
    torch_engine.load(tiny_model_dir)
    prompt = torch_engine.chat_prompt(MESSAGES)
    assert ours.chat_prompt(MESSAGES) == prompt
    greedy = {"max_tokens": 8, "temperature": 0.0}
    assert [e.token_id for e in _run(ours, prompt, **greedy)] == [
        e.token_id for e in _run(torch_engine, prompt, **greedy)
    ]


@needs_llama_cpp
def test_max_tokens_and_stop_strings_end_the_stream(tiny_gguf_dir):
    engine = _engine(tiny_gguf_dir)
    prompt = engine.encode("The capital of France is")
    events = _run(engine, prompt, max_tokens=6, temperature=0.0)
    assert len(events) == 6 and events[-1].finish_reason == "length"
    assert all(e.finish_reason is None for e in events[:-1])
    text = "".join(e.text for e in events)
    stop = text.strip()[2:5]
    stopped = _run(engine, prompt, max_tokens=6, temperature=0.0, stop=(stop,))
    assert stopped[-1].finish_reason == "stop"
    assert "".join(e.text for e in stopped) == text[: text.find(stop)]


@needs_llama_cpp
def test_seeded_sampling_repeats(tiny_gguf_dir):
    engine = _engine(tiny_gguf_dir)
    prompt = engine.encode("Edge devices")
    sample = {"max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "seed": 7}
    assert [e.token_id for e in _run(engine, prompt, **sample)] == [
        e.token_id for e in _run(engine, prompt, **sample)
    ]


@needs_llama_cpp
def test_a_second_generation_at_once_is_refused_and_closing_frees_the_engine(tiny_gguf_dir):
    engine = _engine(tiny_gguf_dir)
    prompt = engine.encode("Hello")
    first = engine.stream(prompt, SamplingParams(max_tokens=8, temperature=0.0))
    next(first)
    with pytest.raises(AgentError, match="already generating"):
        next(engine.stream(prompt, SamplingParams(max_tokens=2)))
    first.close()
    assert len(_run(engine, prompt, max_tokens=2, temperature=0.0)) == 2


@needs_llama_cpp
def test_a_truncated_gguf_is_refused_naming_the_file(tiny_gguf_dir, tmp_path):
    broken = shutil.copytree(tiny_gguf_dir, tmp_path / "broken")
    path = broken / GGUF_NAME
    path.write_bytes(path.read_bytes()[:-4096])
    engine = make_engine("llama.cpp", context_length=256, threads=1)
    with pytest.raises(FormatError, match="past the end of the file") as info:
        engine.load(broken)
    assert str(path) in info.value.message


@needs_llama_cpp
def test_a_gguf_from_another_build_than_its_manifest_is_refused(tiny_gguf_dir, tiny_model_dir, tmp_path):
    mixed = shutil.copytree(tiny_gguf_dir, tmp_path / "mixed")
    fp16 = build_gguf(tiny_model_dir, tmp_path / "store", scheme="fp16")
    shutil.copyfile(fp16 / GGUF_NAME, mixed / GGUF_NAME)
    with pytest.raises(FormatError, match="does not match"):
        make_engine("llama.cpp", context_length=256, threads=1).load(mixed)


@needs_llama_cpp
def test_a_safetensors_artifact_is_refused_with_the_way_out(tiny_model_dir):
    with pytest.raises(FormatError, match=r"no model\.gguf") as info:
        make_engine("llama.cpp", context_length=256, threads=1).load(tiny_model_dir)
    assert "agent.engine: llama.cpp" in info.value.hint


@pytest.mark.slow
@needs_llama_cpp
def test_smollm2_answers_as_llama_cpp_does_on_the_shipped_gguf(smollm2_gguf_dir):
    from llama_cpp import Llama

    from deployer.build.demo_model import smollm2_gguf_path

    engine = _engine(smollm2_gguf_dir, context_length=512)
    engine.warmup()
    prompt = engine.chat_prompt([ChatMessage("user", "What is the capital of France?")])
    ours = [e.token_id for e in _run(engine, prompt, max_tokens=16, temperature=0.0)]
    shipped = Llama(model_path=str(smollm2_gguf_path()), n_ctx=512, n_threads=1, verbose=False)
    theirs = [t for t, _ in zip(shipped.generate(prompt, temp=0.0), range(16), strict=False)]
    assert ours == theirs
    assert engine.decode(ours).strip()


@needs_llama_cpp
def test_every_decode_runs_on_the_one_llama_thread_whichever_thread_asks(tiny_gguf_dir):
    """Requests arrive on a new thread each; llama.cpp's OpenMP teams must not multiply (see the
    module docstring of engines/llamacpp/engine.py), so decoding always happens on the same thread."""
    engine = _engine(tiny_gguf_dir)
    engine.warmup()  # on this (the main) thread's call
    batch = engine._loaded.batch
    real_decode, seen = batch._decode, []

    def decode_spy():  # the real llama_decode call, recording which thread runs it
        seen.append(threading.current_thread().name)
        return real_decode()

    batch._decode = decode_spy
    prompt = engine.chat_prompt(MESSAGES)
    workers = [
        threading.Thread(target=_run, args=(engine, prompt), kwargs={"max_tokens": 3}) for _ in range(2)
    ]
    for worker in workers:
        worker.start()
        worker.join()
    assert len(seen) >= 2 and len(set(seen)) == 1, seen
    assert seen[0].startswith("llama.cpp") and seen[0] not in {w.name for w in workers}
