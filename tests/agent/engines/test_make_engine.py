"""The engine factory the server uses: torch by name, a clear refusal for an unknown name,
`device: auto` resolved where the engine is made, with its reason shown, and agent.yaml's device
and compile reaching the engine."""

import pytest
import torch

from deployer.agent.engines import make_engine
from deployer.agent.engines.base import Engine
from deployer.agent.engines.torch.engine import choose_device
from deployer.agent.http.server import engine_factory_for
from deployer.agent.settings import AgentSettings
from deployer.errors import AgentError

# The CI machine has no GPU: the CUDA branch of `device: auto` cannot run here. What auto *chooses*
# on a CUDA machine is checked below with torch's answer stood in for; these tests need the CPU.
needs_no_gpu = pytest.mark.skipif(
    torch.cuda.is_available(), reason="asserts what a machine without CUDA does"
)


def test_torch_engine_by_name():
    assert isinstance(make_engine("torch", context_length=128), Engine)


def test_unknown_engine_lists_the_known_ones():
    with pytest.raises(AgentError, match="unknown engine 'onnx'") as info:
        make_engine("onnx")
    assert "torch" in info.value.hint


@needs_no_gpu
def test_device_auto_runs_on_the_cpu_without_cuda_and_says_why(tiny_model_dir):
    engine = make_engine("torch", context_length=128, device="auto", threads=1)
    engine.load(tiny_model_dir)
    info = engine.describe()
    assert info.device == "cpu"
    # This torch is a CPU-only build; on a CUDA build without a GPU it says "sees no CUDA device".
    built = torch.version.cuda is not None or torch.version.hip is not None
    why = "torch sees no CUDA device" if built else "this torch is built without CUDA"
    assert info.extra["device_choice"] == f"cpu (auto: {why})"


def test_device_auto_chooses_cuda_where_torch_sees_a_gpu(monkeypatch):
    # Only the choice: nothing runs on the stand-in GPU.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Orin (stand-in)")
    assert choose_device("auto") == ("cuda", "cuda (auto: torch sees Orin (stand-in))")


def test_an_explicit_device_is_taken_as_asked():
    assert choose_device("cpu") == ("cpu", "cpu (asked for)")


@needs_no_gpu
def test_an_explicit_cuda_without_a_gpu_stays_an_error():
    with pytest.raises(AgentError, match="device cuda was asked for but torch sees no CUDA device") as info:
        make_engine("torch", device="cuda")
    assert "device: auto" in info.value.hint


def _failing_compile(fn, *args, **kwargs):
    """Stands in for torch.compile: the compiled step fails at its first call, as it does on a
    device without a C++ compiler. Compiling for real takes minutes on the CI machine's two cores;
    the note the failure leaves shows that the engine was asked to compile."""

    def fail(*a, **k):
        raise RuntimeError("no C++ compiler found")

    return fail


@needs_no_gpu
@pytest.mark.parametrize(
    ("compile_setting", "note"),
    [
        ("on", "off (compile failed: RuntimeError: no C++ compiler found)"),
        ("auto", "off"),  # auto compiles on CUDA only
        ("off", "off"),
    ],
)
def test_agent_yaml_compile_and_device_reach_the_engine(tiny_model_dir, monkeypatch, compile_setting, note):
    monkeypatch.setattr(torch, "compile", _failing_compile)
    settings = AgentSettings(
        compile=compile_setting,
        device="auto",
        threads=1,
        context_length=128,
        max_prompt_tokens=64,
        max_concurrent=2,
    )
    engine = engine_factory_for(settings)()
    engine.load(tiny_model_dir)
    assert engine.wait_compiled(60)  # the agent's engine compiles on a CPU in the background
    extra = engine.describe().extra
    assert extra["compile"] == note
    assert extra["device_choice"].startswith("cpu (auto: ")
    assert (extra["slots"], engine.describe().context_length) == ("2", 128)


def test_the_llama_cpp_engine_refuses_compile_on():
    with pytest.raises(AgentError, match="nothing to compile") as info:
        make_engine("llama.cpp", compile="on")
    assert "compile: auto" in info.value.hint


def test_the_llama_cpp_engine_refuses_a_draft():
    with pytest.raises(AgentError, match="no draft model") as info:
        make_engine("llama.cpp", draft="int4")
    assert "draft: off" in info.value.hint


def test_agent_yaml_draft_reaches_the_torch_engine(tiny_model_dir):
    settings = AgentSettings(context_length=128, max_prompt_tokens=64, max_concurrent=2, draft="int4")
    engine = engine_factory_for(settings)()
    engine.load(tiny_model_dir)
    assert engine.describe().extra["draft"].startswith("int4-g32 (draft), up to 5 proposals a round, eager")
