"""Canonical JSON stays compatible with what was signed; the config loader survives any input."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deployer.config.loader import MAX_CONFIG_BYTES_ENV, read_config
from deployer.core.canonical import canonical_json, legacy_canonical_json
from deployer.core.release import make_release, parse_envelope
from deployer.core.verify import load_trusted_keys, verify_release
from deployer.release.sign import add_signature, envelope_for

# A release as the controller makes it: ints, strings, nested objects, and the quality gate's
# floats as it measures them (never integral, never tiny).
REALISTIC = {
    "kind": "sits-release",
    "model": {"name": "smollm2-135m-instruct", "version": "1.4.2+int8"},
    "counter": 1234,
    "artifact": {"sha256": "ab" * 32, "files": {"model.safetensors": {"sha256": "cd" * 32, "size": 142216}}},
    "patch": None,
    "created": "2026-06-01T12:00:00Z",
    "quality": {
        "perplexity": {"reference": 23.456789, "quantized": 23.9012, "increase_pct": 1.8975},
        "top1_agreement": 0.9725,
        "mean_kl": 0.0123,
        "label": "ünïcode ✓",
    },
}


def test_rfc8785_bytes_equal_the_legacy_bytes_for_a_realistic_release():
    assert canonical_json(REALISTIC) == legacy_canonical_json(REALISTIC)


def test_where_rfc8785_differs_format_1_is_still_verified_over_the_legacy_bytes(kit, tmp_path: Path):
    # 1.0 and 1e-05 are written "1" and "0.00001" by RFC 8785 but "1.0" and "1e-05" before.
    differs = {"a": 1.0, "b": 1e-05}
    assert canonical_json(differs) != legacy_canonical_json(differs)
    body = make_release(kit.artifacts["1.0.0"], counter=1, expires_in=timedelta(days=1))
    old = body.model_copy(update={"format_version": 1, "quality": {"top1_agreement": 1.0, "mean_kl": 1e-05}})
    envelope = add_signature(envelope_for(old), kit.key)
    assert envelope.signed_bytes() == legacy_canonical_json(envelope.signed)
    received = parse_envelope(json.dumps(envelope.model_dump(mode="json")).encode(), "wire")
    trusted = load_trusted_keys([kit.public_key])
    assert verify_release(received, trusted, now=body.expires_at() - timedelta(hours=1)).format_version == 1


def test_config_larger_than_the_limit_is_refused_before_parsing(tmp_path: Path):
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("application: x\n" + "# padding\n" * 200)
    result = read_config(deploy, {MAX_CONFIG_BYTES_ENV: "1000"})
    assert result.config is None
    assert result.findings[0].message.startswith("the file is larger than the limit of 1000 bytes")


def test_inventory_larger_than_the_limit_is_refused(tmp_path: Path):
    (tmp_path / "inventory.yaml").write_text(
        "devices:\n" + "  - {name: d, transport: local, root: x}\n" * 100
    )
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("application: x\nfleet:\n  inventory: inventory.yaml\n")
    findings = read_config(deploy, {MAX_CONFIG_BYTES_ENV: "1000"}).findings
    assert any(f.file.endswith("inventory.yaml") and "larger than the limit" in f.message for f in findings)


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
_keys = st.sampled_from(
    ["application", "model", "fleet", "profiles", "signing", "strategy", "hooks", "agent"]
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=st.dictionaries(_keys, _values, max_size=6))
def test_fuzz_the_config_loader_never_raises(tmp_path: Path, doc):
    deploy = tmp_path / "deploy.yaml"
    # JSON is YAML; floats include nan and inf, written as YAML's .nan / .inf.
    text = json.dumps(doc).replace("NaN", ".nan").replace("-Infinity", "-.inf").replace("Infinity", ".inf")
    deploy.write_text(text)
    result = read_config(deploy, {})
    assert result.config is not None or result.findings
