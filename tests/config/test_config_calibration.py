"""`model.quantization.calibration` in deploy.yaml: validate reports a bad or reused calibration
text at the field's line and column, naming the position inside the text file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from deployer.config import validate_file
from deployer.core.calibration import DEFAULT_CALIBRATION

QUANT = "  version: 1.0.0\n  quantization:\n    scheme: int4\n    awq: true\n    calibration: calib.txt\n"
GATE = "  quality_gate:\n    eval_text: eval.txt\n"
# Line and column of `calibration:`'s value in the config QUANT makes.
AT = (8, 18, "model.quantization.calibration")


def _findings(write_config, tmp_path: Path, calibration: bytes, quant: str = QUANT) -> list:
    (tmp_path / "calib.txt").write_bytes(calibration)
    shutil.copyfile(DEFAULT_CALIBRATION, tmp_path / "eval.txt")
    path = write_config(replace=(("  version: 1.0.0\n", quant + GATE),))
    return [f for f in validate_file(path, environ={}) if f.is_error]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "calib.txt:1:1: the calibration text is empty"),
        (b"words\nand \x00 more", "calib.txt:2:5: the calibration text is not UTF-8 text (byte 0x00)"),
        (b"just a few words", "calib.txt:1:17: the calibration text has 4 words"),
    ],
    ids=["empty", "binary", "too-short"],
)
def test_bad_calibration_text_is_found_at_the_field(write_config, tmp_path, content, message):
    findings = _findings(write_config, tmp_path, content)
    assert len(findings) == 1
    found = findings[0]
    assert (found.line, found.column, found.path) == AT
    assert message in found.message


def test_calibrating_on_the_eval_text_is_refused(write_config, tmp_path):
    findings = _findings(write_config, tmp_path, DEFAULT_CALIBRATION.read_bytes())
    assert [(f.line, f.column, f.path) for f in findings] == [AT]
    assert "the calibration text and quality_gate.eval_text are the same text" in findings[0].message
    # Without calibration: the default text is used, so the finding points at the eval text.
    quant = "  version: 1.0.0\n  quantization:\n    scheme: int4\n    awq: true\n"
    default = _findings(write_config, tmp_path, b"", quant=quant)
    assert [(f.path, "same text" in f.message) for f in default] == [("model.quality_gate.eval_text", True)]


def test_calibration_needs_awq(write_config, tmp_path):
    quant = QUANT.replace("    awq: true\n", "")
    findings = _findings(write_config, tmp_path, DEFAULT_CALIBRATION.read_bytes(), quant=quant)
    assert [(f.path, f.message) for f in findings] == [
        (
            "model.quantization.calibration",
            "calibration is used only with awq, gptq, scheme auto or a K-quant gguf_type",
        )
    ]
    # GPTQ rounding reads the calibration text too.
    gptq = QUANT.replace("    awq: true\n", "    gptq: true\n")
    assert _findings(write_config, tmp_path, b" ".join(b"w%d" % i for i in range(300)), quant=gptq) == []


@pytest.mark.parametrize(
    ("quant", "engine", "at", "message"),
    [
        (
            "    scheme: int8\n    gptq: true\n",
            None,
            (7, 11),
            "gptq rounds int4 weights, and no weight is int4 (scheme int8)",
        ),
        (
            "    scheme: int4\n    group_size: 32\n    gptq: true\n",
            "llama.cpp",
            (8, 11),
            "gptq is built for the torch engine's artifacts, not llama.cpp's GGUF",
        ),
    ],
    ids=["no-int4", "llama.cpp"],
)
def test_gptq_where_it_cannot_apply_is_found_at_the_field(write_config, tmp_path, quant, engine, at, message):
    path = write_config(
        replace=(("  version: 1.0.0\n", "  version: 1.0.0\n  quantization:\n" + quant),),
        append=f"agent:\n  engine: {engine}\n" if engine else "",
    )
    findings = [f for f in validate_file(path, environ={}) if f.is_error]
    assert [(f.line, f.column, f.path, f.message) for f in findings] == [
        (*at, "model.quantization.gptq", message)
    ]


def test_a_good_calibration_text_passes(write_config, tmp_path):
    text = " ".join(f"word{i}" for i in range(300)).encode()
    assert _findings(write_config, tmp_path, text) == []
