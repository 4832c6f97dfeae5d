"""Build a LoRA adapter artifact from a PEFT directory, for one base artifact (issue #41).

    PEFT dir ─► deployer.core.lora (fp16 factors, adapter.json, adapter.safetensors)
             ─► adapter.gguf, when the base is a GGUF artifact (deployer.build.gguf_adapter)
             ─► quality gate: quantized base + adapter against the unquantized merged reference
             ─► sits-adapter.json (its sha256 is the artifact id) ─► .sits/store/adapters/<id>/

Reproducible: the files are written byte for byte the same for the same inputs (canonical JSON,
sorted tensors, quality figures rounded by the gate), so the same PEFT files, base and settings
always give the same id. The id binds the base artifact's id (in `adapter.json` and the manifest),
so an adapter built for another base is another artifact.

The gate is the model gate's `quality.measure`, streamed a decoder layer at a time: the reference
is the source checkpoint with ``factor * B @ A`` added to each target module in fp32 as its weights
are read (the merged model, never written out), and the model under test is the base artifact's
dequantized weights with the same fp16 factors added, which is what the device computes (the
low-rank product beside the quantized matmul) up to rounding.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from deployer import __version__
from deployer.build.source import SourceModel, open_source
from deployer.build.spec import GateSpec, QualityReport
from deployer.build.store import Store
from deployer.core.adapter_release import AdapterManifest, hash_files, write_adapter_manifest
from deployer.core.lora import ADAPTER_JSON, ADAPTER_SAFETENSORS, LoraAdapter, from_peft, write_adapter
from deployer.core.manifest import read_manifest
from deployer.core.release import ModelRef
from deployer.errors import BuildError, FormatError

if TYPE_CHECKING:
    import torch

    from deployer.build import quality
    from deployer.config.models import Config

ADAPTERS_DIRNAME = "adapters"  # under the project's store: .sits/store/adapters/<id>/


@dataclass(frozen=True)
class AdapterBuildRequest:
    """What to build: the adapter's identity, its PEFT files, the base artifact and the gate."""

    name: str
    version: str
    peft_dir: Path
    scale: float
    base_artifact_dir: Path
    base_artifact_id: str
    base_source_dir: Path  # the base's HF-layout source: the gate's unquantized reference
    store_dir: Path
    base_sha256: str | None = None
    gate: GateSpec | None = None


@dataclass(frozen=True)
class AdapterBuild:
    """A built adapter artifact."""

    name: str
    version: str
    artifact_id: str
    artifact_dir: Path
    base_artifact_id: str
    quality: QualityReport | None

    @property
    def artifact_bytes(self) -> int:
        """Size of the whole artifact (what a full send costs)."""
        return sum(p.stat().st_size for p in self.artifact_dir.iterdir() if p.is_file())


def build_adapter(request: AdapterBuildRequest) -> AdapterBuild:
    """Build the adapter artifact `request` describes (or find the identical one in the store).

    Raises BuildError (a base that does not match, a module the base lacks), FormatError (from the
    PEFT files: rank, NaN, missing tensor) and QualityGateError.
    """
    # Here, not at the top: it imports torch and gguf, which `apply` (it reads this module's
    # names to find built adapters) does not need.
    from deployer.build.gguf_adapter import gguf_base, write_gguf_adapter

    base = read_manifest(request.base_artifact_dir)
    if request.base_sha256 is not None and base.source.sha256 != request.base_sha256:
        raise BuildError(
            f"adapter {request.name}: base_sha256 {request.base_sha256[:16]}... pins another base "
            f"than the model's source ({base.source.sha256[:16]}...)",
            hint="build the adapter for this base, or fix model.adapters[].base_sha256",
        )
    adapter = from_peft(
        request.peft_dir, request.name, request.version, request.base_artifact_id, request.scale
    )
    source = open_source(request.base_source_dir)  # once: the fit check and the gate both read it
    _check_fits(adapter, request, source)
    store = Store(request.store_dir / ADAPTERS_DIRNAME)
    with store.staging() as staged:
        write_adapter(adapter, staged)
        files = [ADAPTER_JSON, ADAPTER_SAFETENSORS]
        if (base_gguf := gguf_base(request.base_artifact_dir)) is not None:
            files.append(write_gguf_adapter(adapter, base_gguf, staged).name)
        report = _gate(adapter, request, source) if request.gate is not None else None
        manifest = AdapterManifest(
            adapter=ModelRef(name=request.name, version=request.version),
            base_artifact_id=request.base_artifact_id,
            files=hash_files(staged, sorted(files)),
            quality=report.to_json() if report is not None else None,
            builder={"name": "sits-deployer", "version": __version__},
        )
        artifact_id = write_adapter_manifest(staged, manifest)
        artifact_dir = _commit(store, staged, artifact_id)
    return AdapterBuild(
        request.name, request.version, artifact_id, artifact_dir, request.base_artifact_id, report
    )


def _commit(store: Store, staged: Path, artifact_id: str) -> Path:
    """Move the staged artifact to adapters/artifacts/<id>, keeping an identical one in place."""
    dest = store.artifact_dir(artifact_id)
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    staged.rename(dest)
    return dest


def _check_fits(adapter: LoraAdapter, request: AdapterBuildRequest, source: SourceModel) -> None:
    """Every target module is a linear of the base (its source's 2-D weights, which also covers a
    float base, whose manifest lists no quantized modules), with the factors' features."""
    linears = {
        t.name.removesuffix(".weight"): t.entry.shape
        for t in source.tensors
        if t.name.endswith(".weight") and len(t.entry.shape) == 2
    }
    for module, (a, b) in adapter.tensors.items():
        shape = linears.get(module)
        if shape is None:
            raise BuildError(
                f"adapter {request.name}: {request.peft_dir}: module {module} is not a linear of the "
                f"base artifact {request.base_artifact_id[:16]}...",
                hint="the adapter was trained on another base; `sits-deployer validate` says more",
            )
        if (a.shape[1], b.shape[0]) != (shape[1], shape[0]):
            raise BuildError(
                f"adapter {request.name}: {module}: factors are {a.shape[1]} -> {b.shape[0]}, the base's "
                f"module is {shape[1]} -> {shape[0]}",
                hint="the adapter was trained on a base of another shape",
            )


def _deltas(adapter: LoraAdapter) -> dict[str, torch.Tensor]:
    """``factor * B @ A`` per target module's weight name, in fp32."""
    import torch

    return {
        f"{module}.weight": adapter.factor * (torch.from_numpy(b).float() @ torch.from_numpy(a).float())
        for module, (a, b) in adapter.tensors.items()
    }


class _Merged:
    """Weights (the quality gate's `Weights`) with ``factor * B @ A`` added to each target module's
    weight as it is read: the merged model, never materialized whole or written to disk."""

    def __init__(self, weights: quality.Weights, deltas: Mapping[str, torch.Tensor]) -> None:
        self._weights = weights
        self._deltas = deltas

    def tensors(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The named tensors in fp32, merged."""
        state = self._weights.tensors(names)
        return {name: t + self._deltas[name] if name in self._deltas else t for name, t in state.items()}

    def row_blocks(self, name: str, rows: int) -> Iterator[torch.Tensor]:
        """The tensor `name`, `rows` rows at a time, merged (a head or embedding target too)."""
        delta = self._deltas.get(name)
        for start, block in zip(itertools.count(0, rows), self._weights.row_blocks(name, rows)):
            yield block if delta is None else block + delta[start : start + len(block)]


def _gate(adapter: LoraAdapter, request: AdapterBuildRequest, source: SourceModel) -> QualityReport:
    """Quantized base + adapter against the unquantized merged model, on the gate's eval text."""
    from deployer.build import quality
    from deployer.build.artifact import ArtifactWeights, module_quants

    gate = request.gate
    assert gate is not None  # the caller checked
    if any(p.suffix == ".gguf" for p in request.base_artifact_dir.iterdir()):
        raise FormatError(
            f"adapter {request.name}: the quality gate of an adapter needs a safetensors base artifact",
            hint="remove model.quality_gate for adapters of a llama.cpp (GGUF) base",
        )
    deltas = _deltas(adapter)
    base = ArtifactWeights(request.base_artifact_dir, module_quants(read_manifest(request.base_artifact_dir)))
    measured = quality.measure(
        source, _Merged(base, deltas), gate, 16.0, reference=_Merged(quality.SourceWeights(source), deltas)
    )
    report = quality.apply_limits(measured, gate)
    quality.enforce(report, f"adapter {adapter.name} {adapter.version}")
    return report


def adapter_requests(
    config: Config, base_artifact_id: str, base_artifact_dir: Path
) -> list[AdapterBuildRequest]:
    """One build request per `model.adapters` entry of deploy.yaml, for the base artifact built from
    it (the model's quality gate, when set, gates each adapter too)."""
    from deployer.build.request import request_from_config

    base = request_from_config(config)
    return [
        AdapterBuildRequest(
            name=spec.name,
            version=spec.version,
            peft_dir=config.resolve(spec.source),
            scale=spec.scale,
            base_artifact_dir=base_artifact_dir,
            base_artifact_id=base_artifact_id,
            base_source_dir=base.source_dir,
            store_dir=base.store_dir,
            base_sha256=spec.base_sha256,
            gate=base.gate,
        )
        for spec in config.model.adapters
    ]
