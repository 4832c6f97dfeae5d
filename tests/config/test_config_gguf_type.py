"""`model.quantization.gguf_type` in deploy.yaml: llama.cpp's own quantizer for the llama.cpp
engine. validate refuses unknown types at the field with the valid choices, and flags the settings
that would be silently ignored beside it."""

from __future__ import annotations

import pytest

from deployer.config import validate_file

AGENT = "agent:\n  engine: {engine}\n"


def _findings(write_config, quant: str, engine: str = "llama.cpp") -> list[tuple[str, int, int, str]]:
    path = write_config(
        replace=(("  version: 1.0.0\n", "  version: 1.0.0\n  quantization:\n" + quant),),
        append=AGENT.format(engine=engine),
    )
    return [(f.path, f.line, f.column, f.message) for f in validate_file(path, environ={}) if f.is_error]


@pytest.mark.parametrize("gguf_type", ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"])
def test_each_gguf_type_is_accepted_on_llama_cpp(write_config, gguf_type):
    assert _findings(write_config, f"    gguf_type: {gguf_type}\n") == []


def test_an_unknown_gguf_type_is_refused_at_the_field_with_the_choices(write_config):
    ((path, line, column, message),) = _findings(write_config, "    gguf_type: Q4_K_S\n")
    assert (path, line, column) == ("model.quantization.gguf_type", 6, 16)
    for choice in ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"):
        assert choice in message


def test_gguf_type_on_the_torch_engine_is_flagged(write_config):
    findings = _findings(write_config, "    gguf_type: Q4_K_M\n", engine="torch")
    assert [(f[0], f[3]) for f in findings] == [
        ("model.quantization.gguf_type", "gguf_type is not used: agent.engine is not llama.cpp")
    ]


def test_our_quantizer_s_settings_beside_gguf_type_are_flagged(write_config):
    quant = "    scheme: int4\n    group_size: 128\n    gguf_int4: Q4_0\n    gguf_type: Q4_K_M\n"
    findings = _findings(write_config, quant)
    assert [(f[0], f[1]) for f in findings] == [
        ("model.quantization.scheme", 6),
        ("model.quantization.group_size", 7),
        ("model.quantization.gguf_int4", 8),
    ]
    assert findings[0][3] == "scheme is not used: gguf_type Q4_K_M picks every tensor's type"


def test_imatrix_and_calibration_need_a_gguf_type_that_reads_them(write_config, tmp_path):
    unused = _findings(write_config, "    imatrix: false\n")
    assert [f[:2] for f in unused] == [("model.quantization.imatrix", 6)]
    (tmp_path / "calib.txt").write_text(" ".join(f"word{i}" for i in range(300)))
    # Q8_0's quantizer reads no importance matrix, so it has no use for a calibration text.
    q8 = _findings(write_config, "    gguf_type: Q8_0\n    calibration: calib.txt\n")
    assert [f[:2] for f in q8] == [("model.quantization.calibration", 7)]
    assert _findings(write_config, "    gguf_type: Q4_K_M\n    calibration: calib.txt\n") == []


def test_the_memory_estimate_counts_the_gguf_type_s_bytes():
    from deployer.config.estimate import SMOLLM2_SHAPE, weight_bytes
    from deployer.config.models import Quantization

    int8 = weight_bytes(SMOLLM2_SHAPE, Quantization(scheme="int8"))
    sizes = [weight_bytes(SMOLLM2_SHAPE, Quantization(gguf_type=t)) for t in ("Q4_K_M", "Q5_K_M", "Q6_K")]
    assert sizes == sorted(sizes) and sizes[-1] < int8
