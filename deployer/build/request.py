"""The build request made from a loaded deploy.yaml: what `build`, `plan` and `apply` ask the builder for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deployer.build.spec import AwqSpec, BuildRequest, GateSpec, LlamaQuantSpec, Override, QuantSpec
from deployer.build.store import STORE_DIRNAME

if TYPE_CHECKING:
    from deployer.config import Config

__all__ = ["request_from_config"]


def request_from_config(config: Config, *, use_cache: bool = True) -> BuildRequest:
    """Map a loaded deploy.yaml `Config` onto the build's own request (paths resolved)."""
    from deployer.build.source import resolve_source

    model = config.model
    quant = model.quantization
    awq = None
    if quant.awq or quant.gptq:
        calibration = config.resolve(quant.calibration) if quant.calibration else None
        awq = AwqSpec(calibration, scales=quant.awq, gptq=quant.gptq)
    auto = quant.scheme == "auto"
    spec = QuantSpec(
        scheme=quant.scheme,
        group_size=quant.group_size,
        overrides=tuple(Override(o.pattern, o.scheme, o.group_size) for o in quant.overrides),
        max_size=quant.max_size,
        calibration=config.resolve(quant.calibration) if auto and quant.calibration else None,
    )
    llama_quant = None
    if quant.gguf_type is not None and config.agent.engine == "llama.cpp":
        # llama.cpp's quantizer starts from an f16 GGUF, as its convert script writes by default.
        spec = QuantSpec("fp16")
        calibration = config.resolve(quant.calibration) if quant.calibration else None
        llama_quant = LlamaQuantSpec(quant.gguf_type, quant.imatrix, calibration)
    gate = None
    if model.quality_gate is not None:
        g = model.quality_gate
        gate = GateSpec(
            eval_text=config.resolve(g.eval_text),
            max_tokens=g.max_tokens,
            max_perplexity_increase_pct=g.max_perplexity_increase_pct,
            min_top1_agreement=g.min_top1_agreement,
            max_mean_kl=g.max_mean_kl,
        )
    return BuildRequest(
        source_dir=resolve_source(model.source, config.base_dir),
        name=model.name,
        version=model.version,
        quant=spec,
        store_dir=config.base_dir / STORE_DIRNAME,
        gate=gate,
        use_cache=use_cache,
        # The llama.cpp engine runs GGUF files: build the artifact it can load.
        format="gguf" if config.agent.engine == "llama.cpp" else "safetensors",
        gguf_int4=quant.gguf_int4,
        awq=awq,
        llama_quant=llama_quant,
    )
