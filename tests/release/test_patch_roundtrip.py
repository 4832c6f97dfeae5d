"""Patches rebuild the target bit-exactly, with every codec, in bounded memory."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from deployer.core.patch_apply import apply_patch
from deployer.core.patch_format import Codec, Coder, PatchHeader, read_header
from deployer.core.safetensors_io import read_header as read_safetensors_header
from deployer.release.delta import create_patch
from tests.release.helpers import tree


def _pair(root: Path) -> tuple[Path, Path]:
    """Two checkpoints whose tensors change in every way a patch has to handle."""
    rng = np.random.default_rng(0)
    base, target = root / "base", root / "target"
    (base / "sub").mkdir(parents=True)
    (target / "sub").mkdir(parents=True)
    noise = rng.standard_normal((256, 64)).astype(np.float32)
    ints = rng.integers(-128, 127, (128, 128), dtype=np.int8)
    sparse = ints.copy()
    sparse.reshape(-1)[rng.choice(sparse.size, 100, replace=False)] += 1
    big = rng.standard_normal((5 * 1024 * 1024,)).astype(np.float16)  # 10 MiB: sampled, 10 blocks
    quant = rng.integers(0, 255, 1024 * 1024, dtype=np.uint8)  # packed int4-like: a few values move
    moved = quant.copy()
    moved[rng.choice(quant.size, 5000, replace=False)] += 1
    int8 = rng.integers(-100, 100, 1024 * 1024, dtype=np.int8)  # int8 weights that all moved by a step
    stepped = (int8 + rng.choice(np.array([-1, 0, 1], np.int8), int8.size, p=[0.3, 0.4, 0.3])).astype(np.int8)
    old = {
        "same": noise,
        "nudged": noise + 1,
        "ints": ints,
        "small": rng.standard_normal(300).astype(np.float32),
        "reshaped": np.zeros((4, 8), np.float32),
        "removed": np.ones(7, np.float32),
        "big": big,
        "quant": quant,
        "int8": int8,
    }
    new = {
        "same": noise,
        "nudged": noise + 1 + np.float32(1e-3) * rng.standard_normal(noise.shape).astype(np.float32),
        "ints": sparse,
        "small": old["small"] * np.float32(1.01),
        "reshaped": np.ones((8, 8), np.float32),
        "added": rng.integers(0, 255, 999, dtype=np.uint8),
        "big": (big + np.float16(0.001)).astype(np.float16),
        "quant": moved,
        "int8": stepped,
    }
    save_file(old, str(base / "model.safetensors"))
    save_file(new, str(target / "model.safetensors"))
    (base / "config.json").write_text(json.dumps({"layers": 2, "eps": 1e-5}))
    (target / "config.json").write_text(json.dumps({"layers": 2, "eps": 1e-6}))
    (base / "gone.txt").write_text("only in the base")
    (target / "sub" / "new.txt").write_text("only in the target\n" * 50)
    (base / "empty").write_bytes(b"")
    (target / "empty").write_bytes(b"")
    return base, target


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    return _pair(tmp_path)


def _apply(patch: Path, base: Path, tmp_path: Path) -> Path:
    out = tmp_path / "staging"
    out.mkdir()
    apply_patch(patch, base, out)
    return out


def test_roundtrip_is_bit_exact_and_picks_codecs(pair, tmp_path):
    base, target = pair
    summary = create_patch(base, target, tmp_path / "p.patch")
    out = _apply(summary.path, base, tmp_path)
    assert tree(out) == tree(target)
    header, _ = read_header(summary.path)
    codec_of = {s.name: s.codec for t in header.targets for s in t.segments}
    assert _codec_at(header, target / "model.safetensors", "same") is Codec.COPY
    assert codec_of["added"] is Codec.RAW
    assert codec_of["nudged"] in (Codec.PLANES, Codec.XOR, Codec.XOR_PLANES)
    assert codec_of["big"] in (Codec.PLANES, Codec.XOR, Codec.XOR_PLANES)
    # A few moved values cost about two bytes each, and go to the small-segment stream; steps of
    # most one-byte elements go to bzip2; float differences to the fast zstd stream.
    seg = {s.name: s for t in header.targets for s in t.segments}
    assert seg["quant"].codec is Codec.SPARSE
    assert seg["quant"].stream_bytes < 3 * 5000
    coder_of = {name: header.streams[s.stream].coder for name, s in seg.items() if s.stream is not None}
    assert coder_of["int8"] is Coder.BZ2
    assert coder_of["big"] is coder_of["quant"] is Coder.ZSTD
    assert len(header.streams) == 3
    # The unchanged tensor costs no payload; the patch is far smaller than the target.
    assert summary.size < summary.target_bytes / 2


def _codec_at(header: PatchHeader, weights: Path, tensor: str) -> Codec:
    """The codec of the segment that rebuilds `tensor` (copies of neighbours are merged with it)."""
    entry = next(e for e in read_safetensors_header(weights).tensors if e.name == tensor)
    start = 0
    for seg in next(t for t in header.targets if t.path == "model.safetensors").segments:
        if start <= entry.offset and entry.offset + entry.length <= start + seg.length:
            return seg.codec
        start += seg.length
    raise AssertionError(f"no single segment holds {tensor}")


def test_unchanged_runs_are_one_copy_segment(pair, tmp_path):
    base, _ = pair
    summary = create_patch(base, base, tmp_path / "p.patch")
    header, _ = read_header(summary.path)
    assert all(len(t.segments) == 1 and t.segments[0].codec is Codec.COPY for t in header.targets)
    assert header.streams == ()


@pytest.mark.parametrize("codec", [c for c in Codec if c is not Codec.COPY])
def test_each_codec_roundtrips(pair, tmp_path, codec):
    base, target = pair
    summary = create_patch(base, target, tmp_path / "p.patch", codecs={codec})
    header, _ = read_header(summary.path)
    used = {s.codec for t in header.targets for s in t.segments}
    assert codec in used
    assert tree(_apply(summary.path, base, tmp_path)) == tree(target)


def test_real_artifacts_roundtrip(fleet, tmp_path):
    out = _apply(fleet.patch, fleet.v1, tmp_path)
    assert tree(out) == tree(fleet.v2)


def test_apply_memory_stays_below_one_tensor(tmp_path):
    rng = np.random.default_rng(1)
    base, target = tmp_path / "a", tmp_path / "b"
    base.mkdir()
    target.mkdir()
    weight = rng.standard_normal(8 * 1024 * 1024).astype(np.float32)  # one 32 MiB tensor
    save_file({"w": weight}, str(base / "model.safetensors"))
    weight += np.float32(1e-4) * rng.standard_normal(weight.size).astype(np.float32)
    save_file({"w": weight}, str(target / "model.safetensors"))
    del weight
    patch = create_patch(base, target, tmp_path / "p.patch").path
    out = tmp_path / "staging"
    out.mkdir()
    tracemalloc.start()
    try:
        apply_patch(patch, base, out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert tree(out) == tree(target)
    assert peak < 32 * 1024 * 1024 // 4


def test_sparse_gaps_of_every_length_roundtrip(tmp_path):
    """Gaps of 0, 254, 255 (one escape), 510 and more, across blocks, up to the very last element."""
    base, target = tmp_path / "a", tmp_path / "b"
    base.mkdir()
    target.mkdir()
    weight = np.arange(3 * 1024 * 1024 // 2, dtype=np.uint16)  # 3 MiB of 2-byte elements: 3 blocks
    save_file({"w": weight}, str(base / "model.safetensors"))
    gaps = np.array([0, 0, 254, 255, 256, 510, 511, 70_000, 600_000])
    positions = np.cumsum(gaps + 1) - 1
    weight[np.append(positions, weight.size - 1)] -= np.uint16(3)  # wraps below zero at position 0
    save_file({"w": weight}, str(target / "model.safetensors"))
    summary = create_patch(base, target, tmp_path / "p.patch", codecs={Codec.SPARSE})
    header, _ = read_header(summary.path)
    assert {s.codec for s in header.targets[0].segments if s.name == "w"} == {Codec.SPARSE}
    assert tree(_apply(summary.path, base, tmp_path)) == tree(target)
