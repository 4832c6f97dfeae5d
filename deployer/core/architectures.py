"""The decoder architectures the project builds and serves, and why a config.json is refused.

One list for the builder (build/source.py), validate (config/checks.py) and the torch engine
(agent/engines/torch/model.py), so validate refuses what a build or a device would refuse later.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# architecture name in config.json -> model_type it must carry
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
# Rope scaling the torch engine computes (None and "default": plain rope).
ROPE_TYPES = (None, "default", "llama3")


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """The rope settings of an HF config.json, old and new spellings merged.

    transformers 5 writes `rope_parameters`; older configs have top-level rope_theta/rope_scaling
    (which wins: an edited old-style field must not hide behind a default rope_parameters).
    """
    params = dict(config.get("rope_parameters") or {})
    for key, value in (config.get("rope_scaling") or {}).items():
        params["rope_type" if key == "type" else key] = value
    if "rope_theta" in config:
        params.setdefault("rope_theta", config["rope_theta"])
    return params


def unsupported_reason(config: Mapping[str, Any]) -> str | None:
    """Why a model with this config.json cannot be built and served, or None when it can."""
    names = config.get("architectures") or []
    if not isinstance(names, list) or not any(n in SUPPORTED_ARCHITECTURES for n in names):
        found = names or config.get("model_type")
        return f"architecture {found!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
    act = config.get("hidden_act", "silu")
    if act != "silu":
        return f"hidden_act {act!r} is not supported (only silu)"
    kind = rope_parameters(config).get("rope_type")
    if kind not in ROPE_TYPES:
        return f"rope scaling {kind!r} is not supported (default and llama3 rope are)"
    return None
