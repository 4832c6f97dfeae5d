"""Write a source model as one GGUF file for llama.cpp: weights, architecture, tokenizer, chat template.

Tensors are quantized one at a time with the `gguf` package's reference quantizers and streamed
to disk (the tensor table is written first, from the plans), so memory stays at one tensor.
Everything written comes from the source files in a fixed order with no timestamps, so the same
inputs give the same bytes. Each tensor's sha256 (over its stored bytes, padding excluded) goes
into the artifact manifest beside the file.

Which ggml type a tensor gets follows deploy.yaml's scheme per module (overrides and the layered
preset included): fp32/fp16/bf16 -> F32/F16/BF16, int8 -> Q8_0, int4 (group size 32) -> Q4_1
(asymmetric, like our int4) or Q4_0 (symmetric), as `quantization.gguf_int4` says. Norms stay F32;
the token embedding (also the tied output head) is Q8_0 under integer schemes, as llama.cpp's own
files keep it. (The K-quants are not offered: the gguf package cannot quantize to them.)
Llama and Mistral become llama.cpp's `llama` architecture, Qwen2 its `qwen2` (q/k/v biases kept F32).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from deployer.build.progress import BuildProgress, SilentProgress
from deployer.build.quantize import is_head_or_embedding, module_scheme
from deployer.build.source import SourceModel, iter_tensors
from deployer.build.spec import GGUF_INT4_TYPES, QuantSpec
from deployer.core.fsutil import read_json_object
from deployer.core.gguf_io import GGUF_FILE, read_gguf_header
from deployer.errors import BuildError, SourceModelError

__all__ = [
    "GGUF_NAME",
    "INT4_TYPES",
    "GGUFTensorPlan",
    "GGUFTensorRecord",
    "GGUFWeights",
    "load_gguf_state",
    "plan_gguf",
    "write_gguf",
]

GGUF_NAME = GGUF_FILE
INT4_TYPES = GGUF_INT4_TYPES
GGUF_BLOCK = 32
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
# Each GGUF architecture's tensor names, and whether its q/k rows are permuted: llama.cpp's llama
# graph rotates interleaved halves (permute_rows); its qwen2 graph rotates HF's halves as stored.
GGUF_LAYOUTS = {"llama": (gguf.MODEL_ARCH.LLAMA, True), "qwen2": (gguf.MODEL_ARCH.QWEN2, False)}
_FLOAT_TYPES = {"fp32": "F32", "fp16": "F16", "bf16": "BF16"}
_FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "BF16": 32}
# tokenizer.json pre-tokenizers llama.cpp knows, as the `tokenizer.ggml.pre` name it expects.
_BYTE_LEVEL = {"type": "ByteLevel", "use_regex": True}
_DIGITS = {"type": "Digits", "individual_digits": True}


@dataclass(frozen=True)
class GGUFTensorPlan:
    """One source tensor's place in the GGUF: its GGUF name, ggml type, and the head count to
    permute its rows by (llama.cpp's rotary layout for q/k projections), or None."""

    source: str
    name: str
    ggml_type: str
    shape: tuple[int, ...]  # numpy order, as in the source
    permute_heads: int | None


@dataclass(frozen=True)
class GGUFTensorRecord:
    """A written tensor: the manifest's `tensors` entry (shape in ggml order, as the file stores it)."""

    dtype: str
    shape: tuple[int, ...]
    sha256: str

    def to_json(self) -> dict[str, Any]:
        """Manifest form."""
        return {"file": GGUF_NAME, "dtype": self.dtype, "shape": list(self.shape), "sha256": self.sha256}


def plan_gguf(
    source: SourceModel, spec: QuantSpec, *, int4_type: str = INT4_TYPES[0]
) -> list[GGUFTensorPlan]:
    """The GGUF name, type and layout of every stored source tensor, in source order.

    Raises SourceModelError for an architecture llama.cpp's llama and qwen2 graphs do not cover, and
    BuildError for a scheme GGUF cannot hold (int4 with a group size other than 32).
    """
    arch = ARCHITECTURES.get(source.architecture)
    if arch is None:
        raise SourceModelError(
            f"{source.path}: GGUF export supports {', '.join(ARCHITECTURES)}, not {source.architecture}",
            hint="use `agent.engine: torch` for this model",
        )
    if int4_type not in INT4_TYPES:
        raise BuildError(f"unknown int4 GGUF type {int4_type!r}", hint=f"use one of {', '.join(INT4_TYPES)}")
    blocks = int(source.config["num_hidden_layers"])
    model_arch, permuted = GGUF_LAYOUTS[arch]
    names = gguf.get_tensor_name_map(model_arch, blocks)
    heads = int(source.config["num_attention_heads"])
    kv_heads = int(source.config.get("num_key_value_heads", heads))
    plans = []
    for tensor in source.tensors:
        if tensor.name == "lm_head.weight" and source.tied_embeddings:
            continue
        name = names.get_name(tensor.name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise SourceModelError(f"{source.path}: no GGUF name for tensor {tensor.name!r}")
        ggml_type = _tensor_type(spec, tensor.name, tensor.entry.shape, int4_type)
        permute = heads if ".q_proj." in tensor.name else kv_heads if ".k_proj." in tensor.name else None
        permute = permute if permuted else None
        plans.append(GGUFTensorPlan(tensor.name, name, ggml_type, tensor.entry.shape, permute))
    return plans


def _tensor_type(spec: QuantSpec, name: str, shape: tuple[int, ...], int4_type: str) -> str:
    if len(shape) != 2 or not name.endswith(".weight"):
        return "F32"  # norms and biases: llama.cpp wants them F32
    module = name.removesuffix(".weight")
    scheme, group_size = module_scheme(spec, module)
    if is_head_or_embedding(module):
        return _FLOAT_TYPES.get(spec.scheme, "Q8_0")
    if scheme in _FLOAT_TYPES:
        return _FLOAT_TYPES[scheme]
    if shape[1] % GGUF_BLOCK:
        raise BuildError(f"{name}: rows of {shape[1]} are not whole GGUF blocks of {GGUF_BLOCK}")
    if scheme == "int8":
        return "Q8_0"
    if group_size != GGUF_BLOCK:
        raise BuildError(
            f"{module}: int4 with group size {group_size} has no GGUF type",
            hint="GGUF's 4-bit types use blocks of 32: set model.quantization.group_size: 32",
        )
    return int4_type


def write_gguf(
    source: SourceModel,
    out: Path,
    plans: list[GGUFTensorPlan],
    *,
    name: str,
    version: str,
    progress: BuildProgress | None = None,
) -> dict[str, GGUFTensorRecord]:
    """Write `out` (a GGUF file) from `source` per `plans`; return each tensor's record by GGUF name.

    Raises SourceModelError when the tokenizer or config cannot be expressed in GGUF.
    """
    progress = progress or SilentProgress()
    writer = gguf.GGUFWriter(out, ARCHITECTURES[source.architecture])
    _add_model_metadata(writer, source, plans, name, version)
    _add_tokenizer(writer, source)
    by_source = {p.source: p for p in plans}
    for plan in plans:
        qtype = gguf.GGMLQuantizationType[plan.ggml_type]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(plan.shape)) // block * size
        writer.add_tensor_info(plan.name, plan.shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    records: dict[str, GGUFTensorRecord] = {}
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        progress.start_tensors(len(plans), sum(t.entry.length for t in source.tensors))
        for tensor, weight in iter_tensors(source):
            wanted = by_source.get(tensor.name)
            if wanted is not None:
                data = _quantize(wanted, weight)
                writer.write_tensor_data(data)
                records[wanted.name] = GGUFTensorRecord(
                    wanted.ggml_type,
                    tuple(reversed(wanted.shape)),
                    hashlib.sha256(data.tobytes()).hexdigest(),
                )
            progress.tensor_done(tensor.name, tensor.entry.length)
    finally:
        writer.close()
    return records


def _quantize(plan: GGUFTensorPlan, weight: torch.Tensor) -> np.ndarray:
    array = weight.float().numpy()
    if plan.permute_heads:
        array = permute_rows(array, plan.permute_heads)
    data = gguf.quants.quantize(np.ascontiguousarray(array), gguf.GGMLQuantizationType[plan.ggml_type])
    if plan.ggml_type in ("F32", "F16"):  # quantize() returns these as floats; the file wants bytes
        data = data.view(np.uint8)
    return np.ascontiguousarray(data)


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's q/k row order -> llama.cpp's (the rotary halves interleaved per head), as convert_hf_to_gguf."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_model_metadata(
    writer: gguf.GGUFWriter, source: SourceModel, plans: list[GGUFTensorPlan], name: str, version: str
) -> None:
    c = source.config
    if c.get("rope_scaling") or (c.get("rope_parameters") or {}).get("rope_type", "default") != "default":
        raise SourceModelError(f"{source.path}/config.json: rope scaling is not supported by the GGUF export")
    heads, hidden = int(c["num_attention_heads"]), int(c["hidden_size"])
    head_dim = int(c.get("head_dim") or hidden // heads)
    rope_theta = c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    writer.add_name(name)
    writer.add_version(version)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_context_length(int(c.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(int(c["intermediate_size"]))
    writer.add_block_count(int(c["num_hidden_layers"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(c.get("num_key_value_heads", heads)))
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-6)))
    writer.add_rope_dimension_count(head_dim)
    if head_dim != hidden // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(int(c["vocab_size"]))
    linear = Counter(p.ggml_type for p in plans if len(p.shape) == 2 and ".layers." in p.source)
    writer.add_file_type(_FILE_TYPES[linear.most_common(1)[0][0]] if linear else 0)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_tokenizer(writer: gguf.GGUFWriter, source: SourceModel) -> None:
    tok = _read_json(source.path / "tokenizer.json")
    tok_config = _read_json(source.path / "tokenizer_config.json")
    model = tok.get("model") or {}
    if model.get("type") != "BPE":
        raise SourceModelError(
            f"{source.path}/tokenizer.json: GGUF export supports byte-level BPE tokenizers, "
            f"not {model.get('type')!r}"
        )
    tokens, types = _vocab(source, model["vocab"], tok.get("added_tokens") or [])
    ids = {t: i for i, t in enumerate(tokens)}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(source, tok.get("pre_tokenizer")))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])])
    for key, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
        ("unk_token", writer.add_unk_token_id),
        ("pad_token", writer.add_pad_token_id),
    ):
        text = _token_text(tok_config.get(key))
        if text is not None and text in ids:
            add(ids[text])
    writer.add_add_bos_token(bool(tok_config.get("add_bos_token", False)))
    template = _chat_template(source, tok_config)
    if template:
        writer.add_chat_template(template)


def _vocab(source: SourceModel, vocab: dict[str, int], added: Iterable[dict]) -> tuple[list[str], list[int]]:
    size = int(source.config["vocab_size"])
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [int(gguf.TokenType.UNUSED)] * size
    entries = [(i, t, int(gguf.TokenType.NORMAL)) for t, i in vocab.items()]
    for a in added:
        token_type = gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED
        entries.append((a["id"], a["content"], int(token_type)))
    for i, text, kind in entries:
        if not 0 <= i < size:
            raise SourceModelError(
                f"{source.path}/tokenizer.json: token id {i} is outside the model's vocab_size {size}"
            )
        tokens[i], types[i] = text, kind
    return tokens, types


def _pre_tokenizer(source: SourceModel, pre: object) -> str:
    def matches(node: object, want: dict) -> bool:
        return isinstance(node, dict) and all(node.get(k) == v for k, v in want.items())

    if matches(pre, _BYTE_LEVEL):
        return "gpt-2"
    steps = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else None
    if steps and len(steps) == 2 and matches(steps[0], _DIGITS) and matches(steps[1], _BYTE_LEVEL):
        return "smollm"
    raise SourceModelError(
        f"{source.path}/tokenizer.json: its pre-tokenizer has no llama.cpp equivalent known to this exporter",
        hint="use `agent.engine: torch`, or convert the model with llama.cpp's convert_hf_to_gguf.py",
    )


def _chat_template(source: SourceModel, tok_config: dict[str, Any]) -> str | None:
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: llama.cpp takes the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    jinja = source.path / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    return template if isinstance(template, str) else None


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, SourceModelError)


def load_gguf_state(path: Path, plans: list[GGUFTensorPlan]) -> dict[str, torch.Tensor]:
    """The GGUF's weights dequantized to fp32 under the source checkpoint's names and layout
    (for the quality gate and tests: it materializes the whole model in fp32)."""
    header = read_gguf_header(path)
    stored = header.by_name()
    state = {}
    with path.open("rb") as f:
        for plan in plans:
            entry = stored.get(plan.name)
            if entry is None:
                raise BuildError(f"{path}: tensor {plan.name!r} is missing")
            f.seek(entry.offset)
            raw = np.frombuffer(f.read(entry.length), dtype=np.uint8)
            qtype = gguf.GGMLQuantizationType[entry.dtype]
            values = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(plan.shape)
            if plan.permute_heads:
                values = _unpermute(values, plan.permute_heads)
            state[plan.source] = torch.from_numpy(np.ascontiguousarray(values))
    return state


class GGUFWeights:
    """A GGUF's weights dequantized to fp32 under the source checkpoint's names (the quality gate's
    `Weights`, where llama.cpp is not installed): a decoder layer at a time, but the head whole."""

    def __init__(self, path: Path, plans: list[GGUFTensorPlan]) -> None:
        self._path = path
        self._plans = {plan.source: plan for plan in plans}

    def tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors in fp32."""
        return load_gguf_state(self._path, [self._plans[name] for name in names])

    def row_blocks(self, name: str, rows: int) -> Iterator[torch.Tensor]:
        """The tensor `name`, `rows` rows at a time, in fp32."""
        yield from self.tensors([name])[name].split(rows)
