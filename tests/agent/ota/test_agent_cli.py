"""`sits-agent` end to end: install, status, rollback, gc and reload, with and without a running
server (a real AgentServer with the torch engine on tiny artifacts, driven over its control API)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner

from deployer import __version__
from deployer.agent.cli import cli
from deployer.core.canonical import canonical_json
from deployer.core.hashing import sha256_file
from deployer.core.release import make_release
from deployer.release.sign import add_signature, envelope_for

REPO = Path(__file__).resolve().parents[3]


def _run(device, *args: str, config: Path | None = None) -> tuple[int, str, str]:
    options = ["--root", str(device.root), "--config", str(config or device.root / "none.yaml")]
    result = CliRunner().invoke(cli, [args[0], *options, *args[1:]])
    return result.exit_code, result.stdout, result.stderr


def _install(device, kit, version: str, counter: int, base: str | None = None, *extra: str):
    source = (
        ["--patch", str(kit.patches[(base, version)])]
        if base
        else ["--artifact", str(kit.artifacts[version])]
    )
    manifest = kit.release(version, counter, base=base)
    return _run(device, "install", "--manifest", str(manifest), *source, *extra)


def test_version_prints_the_package_version():
    result = CliRunner().invoke(cli, ["version"])
    assert (result.exit_code, result.stdout.strip()) == (0, __version__)


def test_install_status_rollback_gc_without_a_server(device, kit):
    code, out, err = _install(device, kit, "1.0.0", 1, None, "--output", "json")
    assert code == 0, err
    installed = json.loads(out)
    assert (installed["version"], installed["changed"]) == ("1.0.0", True)
    assert installed["reload"]["served"] is False  # nothing listens: loads on start
    assert _install(device, kit, "1.1.0", 2, "1.0.0")[0] == 0
    assert _install(device, kit, "1.2.0", 3, "1.1.0")[0] == 0

    code, out, _ = _run(device, "status", "--output", "json")
    status = json.loads(out)
    assert (status["current"], status["previous"], status["release_counter"]) == ("1.2.0", "1.1.0", 3)
    assert sorted(status["versions"]) == ["1.0.0", "1.1.0", "1.2.0"]
    assert [h["version"] for h in status["history"]] == ["1.0.0", "1.1.0", "1.2.0"]

    code, out, _ = _run(device, "rollback", "--output", "json")
    assert (code, json.loads(out)["version"]) == (0, "1.1.0")
    code, out, _ = _run(device, "gc", "--keep", "1", "--output", "json")
    assert (code, json.loads(out)) == (0, {"removed": ["1.0.0"]})
    code, _, err = _run(device, "status")
    assert code == 0 and "current  1.1.0" in err


def test_a_refused_update_exits_1_with_the_reason(device, kit, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    code, _, err = _run(device, "install", "--manifest", str(bad), "--artifact", str(kit.artifacts["1.0.0"]))
    assert code == 1
    assert "error:" in err and "malformed release envelope" in err
    assert "Traceback" not in err


def test_usage_errors_exit_2(device, kit):
    manifest = kit.release("1.0.0", 1)
    both = ["--patch", str(manifest), "--artifact", str(kit.artifacts["1.0.0"])]
    assert _run(device, "install", "--manifest", str(manifest), *both)[0] == 2
    assert _run(device, "rollback", "--to", "1.0.0", "--on-failure")[0] == 2
    assert _run(device, "gc", "--keep", "0")[0] == 2


def test_reload_without_a_server_is_an_error(device, tmp_path):
    config = tmp_path / "agent.yaml"
    socket_path = tmp_path / "admin.sock"  # nothing listens there
    config.write_text(f"port: 1\nadmin_socket: {socket_path}\n")
    code, _, err = _run(device, "reload", config=config)
    assert code == 1 and f"no agent is listening on {socket_path}" in err


def test_on_failure_rollback_leaves_the_failing_version(device, kit):
    _install(device, kit, "1.0.0", 1)
    _install(device, kit, "1.1.0", 2, "1.0.0")
    code, out, err = _run(device, "rollback", "--on-failure", "--output", "json")
    assert code == 0, err
    assert json.loads(out)["version"] == "1.0.0"
    code, _, err = _run(device, "rollback", "--on-failure")
    assert code == 1 and "no healthy previous version" in err


def test_the_cli_imports_without_controller_dependencies():
    code = (
        "import sys, deployer.agent.cli; "
        "print(sorted(m for m in ('torch', 'paramiko', 'jinja2', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    ).stdout
    assert out.strip() == "[]"


# -- with a running server -------------------------------------------------------------------


def _broken_artifact(kit, dest: Path) -> Path:
    """A correctly hashed and signable artifact whose config names an unknown architecture."""
    shutil.copytree(kit.artifacts["1.2.0"], dest)
    config = dest / "config.json"
    data = json.loads(config.read_text())
    data["architectures"] = ["NoSuchForCausalLM"]
    data["model_type"] = "no-such-model"
    config.write_bytes(json.dumps(data).encode())
    manifest = json.loads((dest / "sits-manifest.json").read_bytes())
    manifest["files"]["config.json"] = {"sha256": sha256_file(config), "size": config.stat().st_size}
    (dest / "sits-manifest.json").write_bytes(canonical_json(manifest))
    return dest


@pytest.fixture
def served(device, kit, tmp_path):
    """A real agent server on 127.0.0.1 serving 1.0.0 from `device`, and a config pointing at it."""
    from deployer.agent.engines import make_engine
    from deployer.agent.http.server import AgentServer
    from deployer.agent.settings import AgentSettings

    assert _install(device, kit, "1.0.0", 1)[0] == 0
    settings = AgentSettings(port=0, root=device.root, context_length=256, max_prompt_tokens=128, threads=1)
    server = AgentServer(settings, lambda: make_engine("torch", context_length=256, threads=1))
    port = server.start()
    assert server.reload(reason="start").ok
    config = tmp_path / "agent.yaml"
    config.write_text(f"port: {port}\ncontext_length: 256\nmax_prompt_tokens: 128\n")
    yield server, config
    server.stop()


def test_install_reload_rollback_through_a_running_server(served, device, kit, tmp_path):
    server, config = served
    manifest = kit.release("1.1.0", 2, base="1.0.0")
    patch = kit.patches[("1.0.0", "1.1.0")]

    code, out, err = _run(
        device,
        "install",
        "--manifest",
        str(manifest),
        "--patch",
        str(patch),
        "--output",
        "json",
        config=config,
    )

    assert code == 0, err
    reload = json.loads(out)["reload"]
    assert (reload["ok"], reload["served"]) == (True, True)
    assert server.manager.active_info().version == "1.1.0"
    # The same release again, once its install is done, is a replay: refused, nothing changes.
    code, out, err = _run(
        device, "install", "--manifest", str(manifest), "--patch", str(patch), config=config
    )
    assert code != 0 and "not above the installed 2" in err
    assert server.manager.active_info().version == "1.1.0"

    code, out, err = _run(device, "rollback", "--output", "json", config=config)
    assert code == 0, err
    assert server.manager.active_info().version == "1.0.0"
    code, out, err = _run(device, "reload", "--output", "json", config=config)
    assert code == 0 and json.loads(out)["active_version"] == "1.0.0"

    # A signed, well-formed version that cannot load is refused; the old one keeps serving.
    broken = _broken_artifact(kit, tmp_path / "broken")
    release = make_release(broken, counter=3, expires_in=timedelta(days=1))
    bad = tmp_path / "broken.json"
    bad.write_bytes(add_signature(envelope_for(release), kit.key).to_bytes())
    code, _, err = _run(device, "install", "--manifest", str(bad), "--artifact", str(broken), config=config)
    assert code == 1 and "the server refused version 1.2.0" in err
    assert server.manager.active_info().version == "1.0.0"
    assert device.current_version() == "1.0.0"
    assert "1.2.0" not in device.installed_versions()  # not left promoted for a rollback to pick
