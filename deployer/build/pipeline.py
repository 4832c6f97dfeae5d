"""`build_artifact`: source model -> quantized, quality-gated artifact in the local store.

Steps: validate the source's files; hash them; look the inputs up in the build cache (a hit does
no work, but its recorded quality is still judged against today's limits); otherwise check the
tensors' shapes against the architecture's modules, quantize tensor by tensor into a staging
directory, copy the config and tokenizer files, run the quality gate, write the manifest and
rename the directory into the store. Any failure leaves nothing in artifacts/ and no cache entry.
"""

from __future__ import annotations

import errno
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deployer import __version__
from deployer.build import awq, gptq, mixed, quality
from deployer.build.artifact import (
    WEIGHTS_NAME,
    ArtifactWeights,
    WeightsWriter,
    copy_files,
    file_records,
    module_quants,
    read_manifest,
    write_manifest,
)
from deployer.build.progress import BuildProgress, SilentProgress
from deployer.build.quantize import TensorPlan, plan_tensor, quantize_tensor
from deployer.build.source import (
    SourceModel,
    SourceTensor,
    check_shapes,
    iter_tensors,
    open_source,
    source_sha256,
)
from deployer.build.spec import AwqSpec, BuildRequest, BuildResult, QualityReport, QuantSpec
from deployer.build.store import Store, build_key
from deployer.core.hashing import sha256_file
from deployer.core.memory import release_freed_heap
from deployer.core.quant_layout import ModuleQuant
from deployer.errors import BuildError

if TYPE_CHECKING:
    from deployer.build.gguf_writer import GGUFTensorPlan

BUILDER = {"name": "sits-deployer", "version": __version__}


@dataclass(frozen=True)
class _Written:
    """What quantizing the weights produced, and how the gate runs them (in `runtime`)."""

    modules: dict[str, ModuleQuant]
    tensors: dict[str, Any]  # name -> a record with to_json() (TensorRecord or GGUFTensorRecord)
    count: int
    size: int
    quantized: Callable[[], AbstractContextManager[quality.Quantized]]
    runtime: str = "torch"
    spec: dict[str, Any] = field(default_factory=dict)  # added to the manifest's quantization.spec

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight of the decoder's linear layers."""
        return quality.bits_per_weight(self.tensors, self.modules)


def build_artifact(request: BuildRequest, *, progress: BuildProgress | None = None) -> BuildResult:
    """Build (or find in the cache) the artifact `request` describes.

    Raises SourceModelError for a bad source, QualityGateError when the gate fails, and
    BuildError for anything else (disk full, unwritable store). Never leaves a partial artifact.
    """
    progress = progress or SilentProgress()
    started = time.perf_counter()
    try:
        return _build(request, progress, started)
    except OSError as exc:
        hint = "free some disk space and build again" if exc.errno == errno.ENOSPC else None
        raise BuildError(
            f"build of {request.name} failed: {exc.strerror or exc} ({exc.filename or request.store_dir})",
            hint=hint,
        ) from exc
    finally:
        progress.close()


def find_built(request: BuildRequest) -> BuildResult | None:
    """The artifact `request` describes if it was built before (intact in the store), else None.

    Read-only: it hashes the source and looks the inputs up; it never quantizes or writes. Raises
    SourceModelError for a source whose files are bad (its tensors' shapes are checked by a build).
    """
    source = open_source(request.source_dir, shapes=False)
    calibration = _calibration(request)
    key = build_key(_cache_inputs(request, source_sha256(source), calibration))
    artifact_id = Store(request.store_dir).lookup(key)
    if artifact_id is None:
        return None
    return _cached(request, Store(request.store_dir), artifact_id, time.perf_counter())


def _build(request: BuildRequest, progress: BuildProgress, started: float) -> BuildResult:
    source = open_source(request.source_dir, shapes=False)  # checked below, on a miss
    progress.stage(f"hashing source {source.path}")
    source_id = source_sha256(source)
    calibration = _calibration(request)
    key = build_key(_cache_inputs(request, source_id, calibration))
    store = Store(request.store_dir)
    if request.use_cache and (artifact_id := store.lookup(key)):
        return _cached(request, store, artifact_id, started)
    check_shapes(source)
    with store.staging() as staged:
        if request.format == "gguf":
            written = _write_gguf(source, request, staged, progress, calibration)
        else:
            written = _write_weights(source, request, staged, progress, calibration)
            copy_files(source.path, source.copy_files, staged)
        report = _gate(request, source, written, progress)
        manifest = _manifest(request, source, source_id, written, file_records(staged), report)
        artifact_id = write_manifest(staged, manifest)
        artifact_dir = store.commit(staged, artifact_id)
    store.remember(key, artifact_id)
    return BuildResult(
        artifact_dir=artifact_dir,
        artifact_id=artifact_id,
        cached=False,
        quality=report,
        tensors=written.count,
        bytes_written=written.size,
        seconds=time.perf_counter() - started,
    )


def _calibration(request: BuildRequest) -> awq.Calibration | None:
    """The calibration text the build reads (AWQ's, auto's, or llama.cpp's importance matrix's),
    checked."""
    if request.awq is not None:
        return awq.read_calibration(request.awq)
    if request.quant.scheme == "auto":
        return awq.read_calibration(AwqSpec(request.quant.calibration))
    if request.llama_quant is not None and request.llama_quant.uses_imatrix:
        return awq.read_calibration(AwqSpec(request.llama_quant.calibration))
    return None


def _cache_inputs(
    request: BuildRequest, source_id: str, calibration: awq.Calibration | None = None
) -> dict[str, Any]:
    """Everything that shapes the artifact's bytes (the gate's limits do not: they only judge).

    Raises BuildError when the calibration text is the eval text: the gate must score text the
    quantizer never saw."""
    gate = request.gate
    eval_sha256 = _eval_sha256(gate.eval_text) if gate else None
    # The format (and its version) join the key only when not the defaults, so existing caches
    # stay valid.
    formats: dict[str, Any] = {"format": request.format} if request.format != "safetensors" else {}
    if request.format_version != 1:
        formats["format_version"] = request.format_version
    if request.format == "gguf":
        # Both shape the bytes: the tensor types, and the gate's figures in the manifest.
        formats |= {"gguf_int4": request.gguf_int4, "gate_runtime": _gguf_gate_runtime()}
    if request.llama_quant is not None:
        from deployer.build.llama_quant import quantizer_version

        # Another llama.cpp may round differently: its version is an input too.
        formats["gguf_type"] = {"type": request.llama_quant.type, "llama_cpp": quantizer_version()}
    if calibration is not None and gate is not None and calibration.sha256 == eval_sha256:
        raise BuildError(
            f"{calibration.path}: model.quantization.calibration is the same text as "
            f"model.quality_gate.eval_text ({gate.eval_text})",
            hint="calibrate and evaluate on different texts: the gate must score text the "
            "quantizer never saw",
        )
    # The calibration text shapes AWQ's scales, GPTQ's rounding, auto's choice or llama.cpp's
    # importance matrix (each key only when used, so existing caches stay valid).
    awq_inputs: dict[str, Any] = {}
    if calibration is not None:
        used = {"calibration_sha256": calibration.sha256}
        if request.quant.scheme == "auto":
            awq_inputs["auto"] = used
        elif request.awq is None:
            awq_inputs["imatrix"] = used
        if request.awq is not None and request.awq.scales:
            awq_inputs["awq"] = used
        if request.awq is not None and request.awq.gptq:
            awq_inputs["gptq"] = {**used, "damp": gptq.DAMP, "block": gptq.BLOCK}
    return {
        **formats,
        **awq_inputs,
        "source_sha256": source_id,
        "quant": request.quant.to_json(),
        "eval_sha256": eval_sha256,
        "max_tokens": gate.max_tokens if gate else None,
        "model": {"name": request.name, "version": request.version},
        "builder": BUILDER,
    }


def _eval_sha256(path: Path) -> str:
    """Hash the eval text, failing before any work if it is missing."""
    if not path.is_file():
        raise BuildError(
            f"{path}: quality_gate.eval_text not found",
            hint="point model.quality_gate.eval_text at a UTF-8 text file (relative to deploy.yaml)",
        )
    return sha256_file(path)


def _cached(request: BuildRequest, store: Store, artifact_id: str, started: float) -> BuildResult:
    artifact_dir = store.artifact_dir(artifact_id)
    manifest = read_manifest(artifact_dir)
    report = None
    if request.gate and manifest.quality:
        bits = quality.bits_per_weight(manifest.tensors, module_quants(manifest))
        report = quality.apply_limits(quality.report_from_manifest(manifest.quality, bits), request.gate)
        quality.enforce(report, request.label)
    return BuildResult(
        artifact_dir=artifact_dir,
        artifact_id=artifact_id,
        cached=True,
        quality=report,
        tensors=len(manifest.tensors),
        bytes_written=0,
        seconds=time.perf_counter() - started,
    )


def _write_weights(
    source: SourceModel,
    request: BuildRequest,
    staged: Path,
    progress: BuildProgress,
    calibration: awq.Calibration | None,
) -> _Written:
    quant, spec = request.quant, dict[str, Any]()
    if calibration is not None and quant.scheme == "auto":
        shapes = {t.name: t.entry.shape for t in _stored_tensors(source)}
        choice = mixed.choose(source, quant, shapes, calibration, progress.stage)
        quant, spec = choice.spec, {"auto": choice.record(calibration)}
    # AWQ and GPTQ work on the precisions auto chose (measured on the unscaled weights).
    folds = None
    if calibration is not None and request.awq is not None:
        folds = awq.search_folds(source, quant, request.awq, calibration, progress.stage)
        spec |= _awq_record(request, calibration, folds)
    plans = _plans(source, quant)
    total_bytes = sum(source_tensor.entry.length for source_tensor in source.tensors)
    writer = WeightsWriter(staged / WEIGHTS_NAME, (t for p in plans.values() for t in p.outputs))
    progress.stage(f"quantizing {len(plans)} tensors ({request.quant.label}) from {source.path}")
    progress.start_tensors(len(plans), total_bytes)
    try:
        for source_tensor, tensor in iter_tensors(source):
            plan = plans.get(source_tensor.name)
            if plan is None:
                continue
            rounded = None
            if folds is not None:
                tensor = folds.apply(source_tensor.name, tensor)
                rounded = folds.rounded.get(source_tensor.name)
            for name, stored in quantize_tensor(plan, tensor, rounded).items():
                writer.write(name, stored)
            progress.tensor_done(source_tensor.name, source_tensor.entry.length)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    modules = {p.module: p.quant for p in plans.values() if p.module and p.quant}
    return _Written(
        modules,
        dict(writer.records),
        len(writer.records),
        writer.size,
        lambda: nullcontext(ArtifactWeights(staged, modules)),
        spec=spec,
    )


def _awq_record(
    request: BuildRequest, calibration: awq.Calibration | None, folds: awq.Folds | None
) -> dict[str, Any]:
    """The manifest's `quantization.spec.awq`, when AWQ scaled the weights. (GPTQ's rounding is
    not recorded there: agents that know format 2 refuse unknown manifest keys, and its levels
    are in the weights, which the artifact id hashes.)"""
    if request.awq is None or not request.awq.scales or calibration is None or folds is None:
        return {}
    return {"awq": {"calibration_sha256": calibration.sha256, "tokens": folds.tokens}}


def _write_gguf(
    source: SourceModel,
    request: BuildRequest,
    staged: Path,
    progress: BuildProgress,
    calibration: awq.Calibration | None,
) -> _Written:
    """The weights, tokenizer and chat template as one GGUF file (for `agent.engine: llama.cpp`),
    gated through llama.cpp itself when it is installed. With `gguf_type`, our writer makes the
    f16 GGUF and llama.cpp's quantizer the artifact's."""
    from deployer.build.gguf_writer import GGUF_NAME, GGUFWeights, plan_gguf, write_gguf

    plans = plan_gguf(source, request.quant, int4_type=request.gguf_int4)
    path = staged / GGUF_NAME
    spec: dict[str, Any] = {}
    if request.llama_quant is None:
        progress.stage(f"writing GGUF ({request.quant.label}) from {source.path}")
        records = write_gguf(
            source, path, plans, name=request.name, version=request.version, progress=progress
        )
    else:
        work = staged / ".llama-quant"  # the f16 GGUF: not part of the artifact
        work.mkdir()
        try:
            progress.stage(f"writing the {request.quant.label} GGUF for llama.cpp's quantizer")
            f16 = work / "source.gguf"
            write_gguf(source, f16, plans, name=request.name, version=request.version, progress=progress)
            records, spec = _llama_quantize(request, source, plans, (f16, path), calibration, progress)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    runtime = _gguf_gate_runtime()

    def quantized() -> AbstractContextManager[quality.Quantized]:
        if runtime == "llama.cpp":
            return quality.llama_cpp_scorer(path, quality.window(source))
        return nullcontext(GGUFWeights(path, plans))

    return _Written({}, records, len(records), path.stat().st_size, quantized, runtime, spec)


def _llama_quantize(
    request: BuildRequest,
    source: SourceModel,
    plans: list[GGUFTensorPlan],
    paths: tuple[Path, Path],
    calibration: awq.Calibration | None,
    progress: BuildProgress,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The f16 GGUF `paths[0]` quantized by llama.cpp to `paths[1]` per `request.llama_quant`:
    the tensor records and the manifest's `quantization.spec.gguf` (the type; the importance
    matrix's sha256, token count and calibration's sha256)."""
    from deployer.build import llama_quant

    wanted = request.llama_quant
    if wanted is None:
        raise BuildError("internal: _llama_quantize without gguf_type")
    imatrix, record = None, None
    if calibration is not None:
        progress.stage(f"importance matrix on {calibration.path.name}")
        imatrix = llama_quant.compute_imatrix(source, plans, calibration, progress.stage)
        record = {"sha256": imatrix.sha256, "tokens": imatrix.tokens}
        record["calibration_sha256"] = calibration.sha256
    progress.stage(f"llama.cpp's quantizer: {wanted.type}{' with the importance matrix' if imatrix else ''}")
    f16, out = paths
    llama_quant.quantize(f16, out, wanted.type, imatrix, llama_quant.threads())
    return llama_quant.gguf_records(out), {"gguf": {"type": wanted.type, "imatrix": record}}


def _gguf_gate_runtime() -> str:
    """Where a GGUF's quality gate runs: llama.cpp's kernels, or (without the extra) torch in fp32."""
    return "llama.cpp" if quality.llama_cpp_available() else "torch"


def _stored_tensors(source: SourceModel) -> list[SourceTensor]:
    """The source tensors the artifact stores: a tied output head is stored once, as the embedding."""
    return [t for t in source.tensors if not (t.name == "lm_head.weight" and source.tied_embeddings)]


def _plans(source: SourceModel, quant: QuantSpec) -> dict[str, TensorPlan]:
    """A plan per stored source tensor."""
    return {t.name: plan_tensor(quant, t.name, t.entry.shape) for t in _stored_tensors(source)}


def _gate(
    request: BuildRequest, source: SourceModel, written: _Written, progress: BuildProgress
) -> QualityReport | None:
    if request.gate is None:
        return None
    release_freed_heap()  # the quantizer's freed tensors, before the gate's layers need memory
    progress.stage(f"quality gate: scoring on up to {request.gate.max_tokens} tokens ({written.runtime})")
    with written.quantized() as quantized:
        measured = quality.measure(source, quantized, request.gate, written.bits_per_weight)
        report = quality.apply_limits(measured, request.gate)
    quality.enforce(report, request.label)
    return report


def _manifest(
    request: BuildRequest,
    source: SourceModel,
    source_id: str,
    written: _Written,
    files: dict[str, dict[str, Any]],
    report: QualityReport | None,
) -> dict[str, Any]:
    return {
        "format_version": request.format_version,
        "kind": "sits-artifact",
        "model": {
            "name": request.name,
            "version": request.version,
            "architecture": source.architecture,
        },
        "source": {"sha256": source_id},
        "quantization": {
            "spec": {**request.quant.to_json(), **written.spec},
            "modules": {m: q.to_json() for m, q in sorted(written.modules.items())},
        },
        "files": files,
        "tensors": {n: r.to_json() for n, r in sorted(written.tensors.items())},
        "quality": report.to_json() if report else None,
        "builder": BUILDER,
    }
