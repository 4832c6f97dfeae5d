"""Inference engines behind one small interface (see base.py), and the factory that picks one by name."""

from __future__ import annotations

from deployer.agent.engines.base import Engine
from deployer.errors import AgentError

__all__ = ["ENGINE_NAMES", "make_engine"]

ENGINE_NAMES = ("torch", "llama.cpp")


def make_engine(
    name: str,
    *,
    context_length: int = 2048,
    device: str = "cpu",
    threads: int | None = None,
    slots: int | None = None,
    compile: str = "auto",
    draft: str = "off",
    kv_cache_type: str = "auto",
) -> Engine:
    """A new, unloaded engine of the named kind ("torch" or "llama.cpp"); `slots` is how many
    sequences its batched step runs together (agent.yaml's max_concurrent; None: the engine's
    default). `device` is "cpu", "cuda" or "auto" (the torch engine: CUDA when torch sees a CUDA
    device, else the CPU; llama.cpp: the CPU). `compile` is the torch engine's "auto", "on" or
    "off" (see TorchEngine); llama.cpp has nothing to compile and refuses "on". `draft` is the
    torch engine's speculative decoding on a CPU ("off" or "int4"); llama.cpp refuses it.
    `kv_cache_type` is how the torch engine stores its KV cache ("auto", "fp32", "fp16", "bf16",
    "int8": see TorchEngine); llama.cpp keeps its own fp16 cache and refuses any but "auto".

    Raises AgentError for an unknown name or an engine whose optional dependency is missing.
    """
    if name == "torch":
        # Imported here: torch takes seconds to import, and only the chosen engine should pay it.
        from deployer.agent.engines.torch.engine import TorchEngine

        # In the agent a CPU compile runs in the background: it can take minutes, and the health
        # gate (readiness) should not wait for a speed-up while eager steps can serve.
        return TorchEngine(
            device=device,
            max_context=context_length,
            threads=threads,
            slots=slots,
            compile=compile,
            background_compile=True,
            draft=draft,
            kv_cache_type=kv_cache_type,
        )
    if name == "llama.cpp":
        if device not in ("cpu", "auto"):
            raise AgentError(
                f"the llama.cpp engine runs on the CPU here, not {device}",
                hint="set `device: cpu` or `device: auto`",
            )
        if compile == "on":
            raise AgentError(
                "the llama.cpp engine has nothing to compile: compile: on means nothing there",
                hint="set `compile: auto` (or leave it out), or use `engine: torch`",
            )
        if draft != "off":
            raise AgentError(
                f"the llama.cpp engine here has no draft model: draft: {draft} is the torch engine's",
                hint="set `draft: off` (or leave it out), or use `engine: torch`",
            )
        if kv_cache_type != "auto":
            raise AgentError(
                f"kv_cache_type {kv_cache_type} is the torch engine's: llama.cpp keeps its fp16 cache here",
                hint="set `kv_cache_type: auto` (or leave it out), or use `engine: torch`",
            )
        from deployer.agent.engines.llamacpp.engine import LlamaCppEngine

        return LlamaCppEngine(max_context=context_length, threads=threads, slots=slots)
    raise AgentError(
        f"unknown engine {name!r}", hint=f"agent.yaml `engine:` is one of {', '.join(ENGINE_NAMES)}"
    )
