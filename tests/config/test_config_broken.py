"""Broken deploy.yaml files: each gives the expected message at the expected line and column.

The cases edit the minimal valid config in conftest.py (19 lines; appended text starts at 20).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from deployer.config import load_config, validate_file
from deployer.config.findings import Finding
from deployer.errors import ConfigError

# (id, edit, (line, column, path, message fragment))
CASES = [
    (
        "tab-indent",
        {"replace": (("  name: m", "\tname: m"),)},
        (3, 1, "<yaml>", "tab character in indentation"),
    ),
    (
        "duplicate-key",
        {"append": "application: other\n"},
        (20, 1, "application", "duplicate key 'application' (first defined at line 1)"),
    ),
    ("undefined-alias", {"append": "namespace: *ns\n"}, (20, 12, "<yaml>", "undefined alias *ns")),
    (
        "bad-merge",
        {"append": "agent:\n  <<: 5\n"},
        (21, 7, "<yaml>", "a merge key (<<) must refer to a mapping"),
    ),
    (
        "unknown-top-field",
        {"append": "strategi: canary\n"},
        (20, 1, "strategi", "unknown field 'strategi'"),
    ),
    (
        "unknown-nested-field",
        {"append": "agent:\n  max_concurent: 2\n"},
        (21, 3, "agent.max_concurent", "unknown field 'max_concurent'"),
    ),
    (
        "wrong-type",
        {"replace": (("source: builtin:smollm2-135m-instruct", "source: 5"),)},
        (5, 11, "model.source", "Input should be a valid string, got a number"),
    ),
    (
        "not-semver",
        {"replace": (("version: 1.0.0", "version: v1"),)},
        (4, 12, "model.version", "'v1' is not a valid semantic version"),
    ),
    (
        "unknown-scheme",
        {"replace": (("  version: 1.0.0", "  version: 1.0.0\n  quantization: {scheme: int9}"),)},
        (5, 26, "model.quantization.scheme", "unknown value 'int9'"),
    ),
    (
        "bad-group-size",
        {"replace": (("  version: 1.0.0", "  version: 1.0.0\n  quantization: {group_size: 100}"),)},
        (5, 30, "model.quantization.group_size", "unknown value 100; expected 32, 64 or 128"),
    ),
    (
        "missing-required",
        {"replace": (("  name: m\n", ""),)},
        (2, 1, "model.name", "missing required field 'name'"),
    ),
    (
        "bad-quantity",
        {"replace": (("memory: 4Gi", "memory: 4Gx"),)},
        (19, 19, "profiles.small.memory", "invalid memory quantity '4Gx'"),
    ),
    (
        "absurd-memory",
        {"replace": (("memory: 4Gi", "memory: 4"),)},
        (19, 19, "profiles.small.memory", "memory 4 B is implausible for an edge device"),
    ),
    (
        "absurd-cpu",
        {"append": "resources: {cpu: 100000}\n"},
        (20, 18, "resources.cpu", "is implausible for an edge device"),
    ),
    (
        "unknown-agent-device",
        {"append": "agent:\n  device: gpu\n"},
        (21, 11, "agent.device", "unknown value 'gpu'; expected 'auto', 'cpu' or 'cuda'"),
    ),
    (
        "unknown-compile",
        {"append": "agent:\n  compile: always\n"},
        (21, 12, "agent.compile", "unknown value 'always'; expected 'auto', 'on' or 'off'"),
    ),
    (
        "compile-on-llama-cpp",
        {"append": "agent:\n  engine: llama.cpp\n  compile: on\n"},
        (22, 12, "agent.compile", "compile: on means nothing for agent.engine llama.cpp"),
    ),
    (
        "cuda-on-llama-cpp",
        {"append": "agent:\n  engine: llama.cpp\n  device: cuda\n"},
        (22, 11, "agent.device", "agent.engine llama.cpp runs on the CPU: device cuda would fail"),
    ),
    (
        "unknown-draft",
        {"append": "agent:\n  draft: int2\n"},
        (21, 10, "agent.draft", "unknown value 'int2'; expected 'off' or 'int4'"),
    ),
    (
        "draft-on-llama-cpp",
        {"append": "agent:\n  engine: llama.cpp\n  draft: int4\n"},
        (22, 10, "agent.draft", "agent.engine llama.cpp has no draft model here"),
    ),
    (
        "draft-on-cuda",
        {"append": "agent:\n  device: cuda\n  draft: int4\n"},
        (22, 10, "agent.draft", "the int4 draft is for CPU devices"),
    ),
    (
        "unknown-kv-cache-type",
        {"append": "agent:\n  kv_cache_type: q4_0\n"},
        (21, 18, "agent.kv_cache_type", "unknown value 'q4_0'; expected 'auto', 'fp32', 'fp16', 'bf16' or"),
    ),
    (
        "kv-cache-type-on-llama-cpp",
        {"append": "agent:\n  engine: llama.cpp\n  kv_cache_type: int8\n"},
        (22, 18, "agent.kv_cache_type", "kv_cache_type int8 is the torch engine's"),
    ),
    (
        "int8-kv-cache-on-cuda",
        {"append": "agent:\n  device: cuda\n  kv_cache_type: int8\n"},
        (22, 18, "agent.kv_cache_type", "an int8 KV cache is for CPU devices"),
    ),
    (
        "draft-of-int4",
        {
            "replace": (("  version: 1.0.0", "  version: 1.0.0\n  quantization: {scheme: int4}"),),
            "append": "agent:\n  draft: int4\n",
        },
        (22, 10, "agent.draft", "the model is int4 already"),
    ),
    (
        "cuda-without-accelerator",
        {
            "replace": (("      transport: local\n      root: ./fleet/d2", "      host: 10.0.0.2"),),
            "append": "agent:\n  device: cuda\n",
        },
        (15, 16, "fleet.devices[1].profile", "agent.device is cuda, but device 'd2' would not see a GPU"),
    ),
    (
        "duplicate-device",
        {"replace": (("name: d2", "name: d1"),)},
        (13, 13, "fleet.devices[1].name", "duplicate device name 'd1'"),
    ),
    (
        "unknown-profile",
        {"replace": (("profile: small\n      labels", "profile: smal\n      labels"),)},
        (11, 16, "fleet.devices[0].profile", "unknown profile 'smal'"),
    ),
    (
        "ssh-without-host",
        {"replace": (("      transport: local\n      root: ./fleet/d2", "      root: ./fleet/d2"),)},
        (13, 7, "fleet.devices[1].host", "device 'd2' uses ssh but has no host"),
    ),
    (
        "bad-port",
        {"replace": (("      root: ./fleet/d2", "      root: ./fleet/d2\n      port: 70000"),)},
        (16, 13, "fleet.devices[1].port", "less than or equal to 65535"),
    ),
    (
        "missing-hook",
        {"append": "hooks:\n  pre-deploy: ./nope.sh\n"},
        (21, 15, "hooks.pre-deploy.path", "file ./nope.sh does not exist"),
    ),
    (
        "non-executable-hook",
        {"append": "hooks:\n  post-deploy: {path: hook.sh, timeout: 30s}\n"},
        (21, 23, "hooks.post-deploy.path", "hook hook.sh is not executable"),
    ),
    (
        "bad-hook-timeout",
        {"append": "hooks:\n  pre-rollback: {path: hook.sh, timeout: 5x}\n"},
        (21, 42, "hooks.pre-rollback.timeout", "invalid duration '5x'"),
    ),
    (
        "strategy-typo",
        {"append": "strategy: canery\n"},
        (20, 11, "strategy.type", "unknown value 'canery'"),
    ),
    (
        "selector-matches-nothing",
        {"append": "strategy:\n  type: canary\n  selector: {ring: blue}\n"},
        (22, 13, "strategy.selector", "selector {ring: blue} matches none of the 2 devices"),
    ),
    (
        "canary-step-too-large",
        {"append": "strategy:\n  type: canary\n  steps: [1, 5]\n"},
        (22, 14, "strategy.steps[1]", "canary step 5 is more than the 2 devices"),
    ),
    (
        "steps-on-rolling",
        {"append": "strategy:\n  type: rolling\n  steps: [1]\n"},
        (22, 3, "strategy.steps", "steps is not used by the rolling strategy"),
    ),
    (
        "percent-over-100",
        {"append": "strategy:\n  type: canary\n  steps: [1, '150%']\n"},
        (22, 14, "strategy.steps[1]", "percentage '150%' must be above 0% and at most 100%"),
    ),
    (
        "resources-exceed-profile",
        {"append": "resources: {memory: 8Gi}\n"},
        (20, 21, "resources.memory", "resources.memory 8.0 GiB exceeds the 4.0 GiB of profile 'small'"),
    ),
    (
        "model-does-not-fit",
        {"replace": (("memory: 4Gi", "memory: 512Mi"),)},
        (19, 19, "profiles.small.memory", "model m needs about"),
    ),
    (
        "missing-model-dir",
        {"replace": (("source: builtin:smollm2-135m-instruct", "source: ./models/m"),)},
        (5, 11, "model.source", "model directory ./models/m does not exist"),
    ),
    (
        "unknown-builtin",
        {"replace": (("builtin:smollm2-135m-instruct", "builtin:llama-70b"),)},
        (5, 11, "model.source", "unknown builtin model 'builtin:llama-70b'"),
    ),
    (
        "unset-env-var",
        {"append": "namespace: ${SITS_TEST_SURELY_UNSET}\n"},
        (20, 12, "namespace", "environment variable ${SITS_TEST_SURELY_UNSET} is not set"),
    ),
    (
        "missing-inventory",
        {"append": "", "replace": (("fleet:\n", "fleet:\n  inventory: inv.yaml\n"),)},
        (7, 14, "fleet.inventory", "inventory inv.yaml does not exist"),
    ),
    ("not-a-mapping", {"text": "- a\n- b\n"}, (1, 1, "<root>", "the file must be a mapping")),
    ("empty-file", {"text": "# nothing here\n"}, (1, 1, "<root>", "the file is empty")),
]


def _key(tmp: Path, name: str, pem: bytes) -> None:
    (tmp / name).write_bytes(pem)


@pytest.fixture
def key_files(tmp_path: Path) -> Path:
    """An RSA public key, an encrypted EC P-256 private key and its public key, in tmp_path."""
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    _key(tmp_path, "rsa.pub", rsa_key.public_key().public_bytes(serialization.Encoding.PEM, public))
    _key(tmp_path, "ec.pub", ec_key.public_key().public_bytes(serialization.Encoding.PEM, public))
    encrypted = ec_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"correct horse"),
    )
    _key(tmp_path, "ec.key", encrypted)
    return tmp_path


def _errors(findings: list[Finding]) -> list[str]:
    """The findings that make a config invalid (the base config has no signing: a warning)."""
    return [str(f) for f in findings if f.is_error]


def _assert_found(findings: list[Finding], path: Path, expected: tuple) -> None:
    line, column, field, fragment = expected
    matches = [f for f in findings if fragment in f.message]
    assert matches, f"no finding contains {fragment!r}: {[str(f) for f in findings]}"
    found = matches[0]
    assert (found.file, found.line, found.column, found.path) == (str(path), line, column, field), str(found)


@pytest.mark.parametrize(("edit", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_broken_config_is_reported_at_its_position(write_config, tmp_path, edit, expected):
    (tmp_path / "hook.sh").write_text("#!/bin/sh\n")  # exists, not executable
    path = write_config(**edit)
    _assert_found(validate_file(path, environ={}), path, expected)


def test_there_are_at_least_twenty_cases():
    assert len(CASES) >= 20


def test_the_base_config_is_valid(write_config):
    path = write_config()
    assert _errors(validate_file(path, environ={})) == []
    config = load_config(path, environ={})
    assert [d.name for d in config.fleet.devices] == ["d1", "d2"]
    assert config.resolve("fleet/d1") == path.parent / "fleet/d1"


def test_agent_device_and_compile_defaults_and_bare_on(write_config):
    assert load_config(write_config(), environ={}).agent.model_dump(include={"device", "compile"}) == {
        "device": "auto",
        "compile": "auto",
    }
    # YAML 1.1 reads a bare on/off as true/false; they mean the words written.
    config = load_config(write_config(append="agent:\n  device: cpu\n  compile: on\n"), environ={})
    assert (config.agent.device, config.agent.compile) == ("cpu", "on")
    assert load_config(write_config(append="agent: {compile: off}\n"), environ={}).agent.compile == "off"


def test_cuda_is_checked_against_each_ssh_devices_profile(write_config):
    ssh_d2 = ("      transport: local\n      root: ./fleet/d2\n      profile: small", "      host: 10.0.0.2")
    cuda = "agent:\n  device: cuda\n"
    without_profile = validate_file(write_config(replace=(ssh_d2,), append=cuda), environ={})
    assert [(f.path, "it has no profile" in f.message) for f in without_profile if "cuda" in f.message] == [
        ("fleet.devices[1].name", True)
    ]
    # A profile that names its GPU keeps the device nodes visible; local devices run no unit.
    gpu = "  orin: {memory: 8Gi, accelerator: nvidia-orin}\n"
    with_gpu = (*ssh_d2[:1], "      host: 10.0.0.2\n      profile: orin")
    assert [
        f
        for f in validate_file(write_config(replace=(with_gpu,), append=gpu + cuda), environ={})
        if "cuda" in f.message
    ] == []


def test_every_problem_is_reported_in_one_run(write_config):
    path = write_config(
        append="strategi: x\nagent: {engine: torhc}\nhooks: {pre-deploy: ./nope.sh}\n",
        replace=(("version: 1.0.0", "version: one"), ("name: d2", "name: d1")),
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    messages = [f.message for f in caught.value.findings if f.is_error]
    assert len(messages) == 5, messages
    assert [f.line for f in caught.value.findings] == sorted(f.line for f in caught.value.findings)


def test_did_you_mean_for_near_misses(write_config):
    path = write_config(append="strategi: canary\nagent: {engine: torhc}\n")
    hints = {f.path: f.hint for f in validate_file(path, environ={})}
    assert hints["strategi"] == "did you mean 'strategy'?"
    assert hints["agent.engine"] == "did you mean 'torch'?"


def test_interpolated_values_are_never_echoed(write_config):
    path = write_config(append='agent: {engine: "${ENGINE}"}\nnamespace: ${NS}\n')
    findings = validate_file(path, environ={"ENGINE": "s3cr3t-engine", "NS": "Hunter_22"})
    text = "\n".join(str(f) for f in findings)
    assert "s3cr3t-engine" not in text and "Hunter_22" not in text
    assert "<value from ${ENGINE}>" in text and "<value from ${NS}>" in text


def test_interpolation_fills_values(write_config):
    path = write_config(append='agent: {port: "${PORT}"}\nhealth: {smoke_prompts: ["costs $${price}"]}\n')
    config = load_config(path, environ={"PORT": "9000"})
    assert config.agent.port == 9000
    assert config.health.smoke_prompts == ["costs ${price}"]


def test_wrong_key_types_are_findings(write_config, key_files):
    path = write_config(append="signing:\n  private_key: ec.key\n  trusted_keys: [rsa.pub, ec.key, ec.pub]\n")
    findings = {f.path: f for f in validate_file(path, environ={})}
    assert "is an RSA key; release keys must be EC P-256" in findings["signing.trusted_keys[0]"].message
    assert findings["signing.trusted_keys[0]"].line == 22
    assert "is a private key" in findings["signing.trusted_keys[1]"].message
    assert "signing.trusted_keys[2]" not in findings
    private = findings["signing.private_key"]
    assert (private.line, private.column) == (21, 16)
    assert "encrypted and $SITS_SIGNING_PASSPHRASE is not set" in private.message


def test_encrypted_private_key_opens_with_its_passphrase(write_config, key_files):
    path = write_config(append="signing:\n  private_key: ec.key\n  trusted_keys: [ec.pub]\n")
    assert _errors(validate_file(path, environ={"SITS_SIGNING_PASSPHRASE": "correct horse"})) == []
    wrong = validate_file(path, environ={"SITS_SIGNING_PASSPHRASE": "wrong horse"})
    assert [f.message for f in wrong] == [
        "the passphrase in $SITS_SIGNING_PASSPHRASE does not decrypt private key ec.key"
    ]
    assert "horse" not in str(wrong[0])


def test_inventory_findings_point_into_the_inventory(write_config, tmp_path):
    (tmp_path / "inv.yaml").write_text(
        "devices:\n  - name: d3\n    transport: local\n    profile: nope\n"
        "  - name: d1\n    transport: local\n"
    )
    path = write_config(replace=(("fleet:\n", "fleet:\n  inventory: inv.yaml\n"),))
    findings = {f.path: f for f in validate_file(path, environ={})}
    inventory = str(tmp_path / "inv.yaml")
    assert (findings["devices[0].profile"].file, findings["devices[0].profile"].line) == (inventory, 4)
    assert findings["devices[1].name"].message.startswith("duplicate device name 'd1' (also at")
    assert findings["devices[1].name"].file == inventory


def test_inventory_devices_are_merged(write_config, tmp_path):
    (tmp_path / "inv.yaml").write_text(
        "kind: Inventory\ndevices:\n  - {name: d3, transport: local, agent_port: 8083}\n"
    )
    path = write_config(replace=(("fleet:\n", "fleet:\n  inventory: inv.yaml\n"),))
    config = load_config(path, environ={})
    assert [d.name for d in config.fleet.devices] == ["d1", "d2", "d3"]


def test_missing_file_is_a_finding(tmp_path):
    findings = validate_file(tmp_path / "absent.yaml", environ={})
    assert [(f.line, f.column, f.message) for f in findings] == [(1, 1, "file not found")]


def test_executable_hook_passes(write_config, tmp_path):
    hook = tmp_path / "hook.sh"
    hook.write_text("#!/bin/sh\n")
    hook.chmod(0o755)
    path = write_config(append="hooks:\n  pre-deploy: hook.sh\n")
    assert _errors(validate_file(path, environ={})) == []
    assert load_config(path, environ={}).hooks.pre_deploy.path == "hook.sh"


def test_the_memory_estimate_counts_the_kv_cache_type(write_config):
    from deployer.config.estimate import SMOLLM2_SHAPE, estimate_memory

    def cache(kv_cache_type):
        config = load_config(write_config(append=f"agent:\n  kv_cache_type: {kv_cache_type}\n"), environ={})
        return estimate_memory(SMOLLM2_SHAPE, config.model, config.agent)

    # SmolLM2: 30 layers x 3 kv heads x 64 values, K and V, of 4 sequences of 512 positions.
    values = 2 * 30 * 3 * 64 * 4 * 512
    assert cache("auto").kv_cache == cache("fp32").kv_cache == values * 4
    assert cache("fp16").kv_cache == cache("bf16").kv_cache == values * 2
    # int8: a byte a value and an fp32 scale per position and head.
    assert cache("int8").kv_cache == values + 2 * 30 * 3 * 4 * 4 * 512
    assert cache("int8").total < cache("fp16").total < cache("fp32").total


def test_the_memory_estimate_counts_the_draft(write_config):
    from deployer.config.estimate import SMOLLM2_SHAPE, draft_bytes, estimate_memory

    config = load_config(write_config(append="agent:\n  draft: int4\n"), environ={})
    with_draft = estimate_memory(SMOLLM2_SHAPE, config.model, config.agent)
    without = estimate_memory(SMOLLM2_SHAPE, config.model, config.agent.model_copy(update={"draft": "off"}))
    # SmolLM2's int4 projections, an int8 head, a bf16 embedding and one sequence's fp32 cache.
    added = with_draft.total - without.total
    assert 150 * 2**20 < added == draft_bytes(SMOLLM2_SHAPE, 46080 * 512) < 200 * 2**20
    between = (with_draft.total + without.total) // 2 // 2**20
    fits = write_config(replace=(("memory: 4Gi", f"memory: {between}Mi"),))
    assert not [f for f in validate_file(fits, {}) if f.is_error]
    tight = write_config(replace=(("memory: 4Gi", f"memory: {between}Mi"),), append="agent:\n  draft: int4\n")
    [finding] = [str(f) for f in validate_file(tight, {}) if f.is_error]
    assert "profiles.small.memory" in finding and "int4 draft" in finding
