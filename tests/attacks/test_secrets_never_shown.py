"""No secret appears in any output: a run seeded with marker secrets, every output grepped.

The project has one local device with a real agent and one SSH device whose host, known_hosts path
and a label come from `${VAR}`s in the inventory; that device is down (a closed port), so
paramiko's error text names the host. The signing key is encrypted with a marker passphrase. The
CLI's stdout and stderr of validate, build, plan (text, -v, JSON, plan file), apply, status and a
wrong-passphrase sign, the plan file, everything under .sits/ (audit log, releases, ledger) and the
device's agent log must hold none of the markers; the labels that replace them must show up, so
the values did reach the outputs and were redacted. On the device side, a channel password in
pull.yaml's url stays out of `sits-agent`'s output and the poll state.
"""

from __future__ import annotations

import io
import logging
import pickle
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from deployer.agent.cli import cli as agent_cli
from deployer.cli.main import cli
from deployer.core.redact import (
    MIN_FRAGMENT,
    RedactingFilter,
    Secret,
    redact,
    redact_pieces,
    redacted_json,
    redacting_stdio,
    redaction_scope,
)
from deployer.release.sign import generate_key
from tests.fleet.conftest import Project, local_devices, make_project
from tests.pull.project import Project as PullProject
from tests.pull.project import make_device

HOST = "127.77.77.77"  # a loopback address nothing listens on: the device is down
LABEL = "lbl-MARKER-3141-secret"
PASSPHRASE = "pp-MARKER-1618-horse"
WRONG_PASSPHRASE = "pp-MARKER-0000-wrong"
KNOWN_HOSTS = "kh-MARKER-2718-secret"  # a file name: the valid config's known_hosts file
MISSING_KNOWN_HOSTS = "/nonexistent/kh-MARKER-2222-secret"  # the example
MARKERS = (HOST, LABEL, PASSPHRASE, WRONG_PASSPHRASE, KNOWN_HOSTS, "MARKER")


def _far(known_hosts_var: str) -> dict:
    return {
        "name": "far",
        "host": "${SITS_T_HOST}",
        "port": 1,
        "known_hosts": "${" + known_hosts_var + "}",
        "labels": {"ring": "main", "site": "${SITS_T_LABEL}"},
    }


@pytest.fixture
def seeded(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Project:
    base = tmp_path / "project"
    project = make_project(base, {"1.0.0": tiny_model_dir}, local_devices(base, ("edge-a",), sys.executable))
    generate_key(base / "keys/secret.key", base / "keys/secret.pub", passphrase=Secret(PASSPHRASE))
    (tmp_path / KNOWN_HOSTS).write_text("")
    for name, known_hosts_var in (("inventory.yaml", "SITS_T_KH"), ("inventory-bad.yaml", "SITS_T_BADKH")):
        inventory = {"apiVersion": "sits.dev/v1", "kind": "Inventory", "devices": [_far(known_hosts_var)]}
        (base / name).write_text(yaml.safe_dump(inventory, sort_keys=False))
    doc = yaml.safe_load(project.config_path.read_text())
    doc["signing"] = {"private_key": "keys/secret.key", "trusted_keys": ["keys/secret.pub"]}
    doc["fleet"]["inventory"] = "inventory.yaml"
    project.config_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    doc["fleet"]["inventory"] = "inventory-bad.yaml"
    (base / "deploy-bad.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    for name, value in {
        "SITS_T_HOST": HOST,
        "SITS_T_LABEL": LABEL,
        "SITS_T_KH": str(tmp_path / KNOWN_HOSTS),
        "SITS_T_BADKH": MISSING_KNOWN_HOSTS,
        "SITS_SIGNING_PASSPHRASE": PASSPHRASE,
    }.items():
        monkeypatch.setenv(name, value)
    yield project
    project.stop_agents()


def _run(outputs: list[str], *args: str, env: dict[str, str] | None = None) -> int:
    result = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
    outputs += [f"$ sits-deployer {' '.join(args)}\n{result.stdout}", result.stderr]
    return result.exit_code


def _files(*roots: Path) -> dict[str, str]:
    """Every file under `roots` that is text, by path."""
    texts = {}
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            try:
                texts[str(path)] = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue  # weights, patches: no text of ours in them
    return texts


def test_no_marker_secret_reaches_any_output(seeded: Project):
    project = seeded
    config, bad = str(project.config_path), str(project.dir / "deploy-bad.yaml")
    plan_file = project.dir / "plan.json"
    outputs: list[str] = []

    assert _run(outputs, "validate", "-f", bad) != 0
    assert _run(outputs, "validate", "-f", bad, "--output", "json") != 0
    assert "<value from ${SITS_T_BADKH}>" in outputs[-2]  # the finding names the file, redacted
    assert _run(outputs, "validate", "-f", config) == 0
    assert _run(outputs, "build", "-f", config) == 0
    assert _run(outputs, "plan", "-f", config) == 0
    assert _run(outputs, "-v", "plan", "-f", config) == 0
    assert _run(outputs, "plan", "-f", config, "--output", "json") == 0
    assert _run(outputs, "plan", "-f", config, "-o", str(plan_file)) == 0
    assert _run(outputs, "-vv", "apply", "-f", config, str(plan_file)) == 0
    assert _run(outputs, "status", "-f", config) == 0
    assert _run(outputs, "status", "-f", config, "--output", "json") == 0
    release = next((project.dir / ".sits/releases").glob("[0-9]*.json"))
    wrong = {"SITS_SIGNING_PASSPHRASE": WRONG_PASSPHRASE}
    assert _run(outputs, "sign", str(release), "--key", str(project.dir / "keys/secret.key"), env=wrong) != 0

    shown = "\n".join(outputs)
    assert "<value from ${SITS_T_HOST}>" in shown  # paramiko's error text named the host
    files = _files(project.dir / ".sits", project.device_root("edge-a") / "var/log")
    files[str(plan_file)] = plan_file.read_text()
    for marker in MARKERS:
        assert marker not in shown, _context(shown, marker)
        for path, text in files.items():
            assert marker not in text, f"{path}: {_context(text, marker)}"


def _context(text: str, marker: str) -> str:
    at = text.find(marker)
    return f"{marker!r} shown: ...{text[max(0, at - 300) : at + 100]}..."


def test_a_secret_shows_only_its_label():
    secret = Secret("hunter2-MARKER", "<value from ${PW}>")
    shown = f"{secret} {secret!r} {secret:>30} {[secret]} {secret!s} %s" % secret
    assert "hunter2" not in shown and "<value from ${PW}>" in shown
    assert secret.reveal() == "hunter2-MARKER" and secret.encode() == b"hunter2-MARKER"
    with pytest.raises(TypeError):
        pickle.dumps(secret)


def test_every_output_path_redacts_a_registered_value(capsys, caplog):
    Secret('zürich-MARKER-"quoted"', "<value from ${S}>")
    text = 'error: cannot reach zürich-MARKER-"quoted" (paramiko said so)'
    assert redact(text) == "error: cannot reach <value from ${S}> (paramiko said so)"
    # JSON escapes (non-ASCII, quotes) would hide the value from a redaction of the encoded text.
    assert "MARKER" not in redacted_json({"error": text, 'zürich-MARKER-"quoted"': [text, Path(text)]})
    with redacting_stdio():
        print("split across ", end="")
        print("writes zürich-MARK", end="", file=sys.stdout)
        print('ER-"quoted" on one line')
        print('and a partial line zürich-MARKER-"quoted"', end="", file=sys.stderr)
    out, err = capsys.readouterr()
    assert "MARKER" not in out + err and out.count("<value from ${S}>") == 1 and "<value" in err
    logger = logging.getLogger("tests.secrets")
    logger.setLevel(logging.DEBUG)  # an earlier CLI run in this process may have raised the root level
    handler = logging.StreamHandler(io.StringIO())
    handler.addFilter(RedactingFilter())
    logger.addHandler(handler)
    try:
        logger.warning("device %s refused", 'zürich-MARKER-"quoted"')
        try:
            raise ValueError(text)
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    logged = handler.stream.getvalue()
    assert "MARKER" not in logged and logged.count("<value from ${S}>") == 2  # message, exception


def test_a_scope_forgets_its_secrets_and_a_nested_command_keeps_them_for_the_outer_one(capsys):
    with redaction_scope():
        Secret("scoped-MARKER", "<scoped>")
        assert redact("scoped-MARKER") == "<scoped>"
    assert redact("scoped-MARKER") == "scoped-MARKER"
    # main() redacts around the command (LazyGroup.invoke): a traceback it prints after the
    # command ended is still redacted with what the command learned.
    with redacting_stdio():
        with redacting_stdio():
            Secret("inner-MARKER", "<inner>")
        print("Traceback: ValueError: inner-MARKER")
    assert capsys.readouterr().out == "Traceback: ValueError: <inner>\n"


CHANNEL_PASSWORD = "chpw-MARKER-4242"


def test_a_channel_password_never_reaches_the_agents_output(tmp_path: Path, project: PullProject):
    """A channel behind basic auth: the password in pull.yaml's url, a server that is down (every
    poll error names the url)."""
    project.publish(tmp_path / "published", "1.0.0")
    url = f"http://sits:{CHANNEL_PASSWORD}@127.0.0.1:9/stable/"
    device = make_device(tmp_path / "device", project, url)
    root = str(device.store.root)
    (device.store.root / "etc/sits/pull.yaml").write_text(yaml.safe_dump({"url": url, "timeout_s": 1}))
    shown = []
    for args in (
        ["poll", "--root", root],
        ["poll", "--root", root, "--force", "--output", "json"],
        ["status", "--root", root],
        ["status", "--root", root, "--output", "json"],
    ):
        result = CliRunner().invoke(agent_cli, args, catch_exceptions=False)
        shown += [result.stdout, result.stderr]
    text = "\n".join(shown) + device.state_path.read_text()
    assert "<password of the channel url>" in text  # the url was named, its password redacted
    assert CHANNEL_PASSWORD not in text, _context(text, CHANNEL_PASSWORD)


def test_no_piece_of_a_secret_survives_a_cut_anywhere():
    # A third party's text quoting the key, cut to length at any point: what is left of the key
    # goes whole, the piece on either side of the cut too, down to MIN_FRAGMENT characters.
    key = "sk-9f3b2c71d0e84a65b7c1e2f3a4d5c6b7e8f9a0b1"
    text = f"upstream said: bad auth Bearer {key} (request {key[5:30]})"
    for cut in range(len(text) + 1):
        shown = redact_pieces(text[:cut], key, "[redacted]")
        pieces = [key[i : i + MIN_FRAGMENT] for i in range(len(key) - MIN_FRAGMENT + 1)]
        assert not [p for p in pieces if p in shown], (cut, shown)
    assert redact_pieces(text, key, "[R]") == "upstream said: bad auth Bearer [R] (request [R])"
    assert redact_pieces("k" * 100_000, "sk-" + "k" * 32, "[R]") == "[R]"  # one run, one label
