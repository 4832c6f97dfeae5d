"""Issue 18, the fleet side, one test per numbered problem that needs no running agent (the README
run in test_quickstart.py covers serving, the delta update, the pointer-switch rollback and down).

Projects are made by `sits-deployer init` and then point at the seeded tiny checkpoint; commands
run through the real CLI (click's runner keeps stdout and stderr apart) or as real subprocesses
where the output streams or a library's own logging is under test.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from deployer.cli.main import cli
from deployer.config import load_config
from deployer.core.redact import Secret
from deployer.push.facts import DeviceSite, gather_facts
from deployer.push.plan import DesiredState, DeviceFacts, StepKind, plan_device
from deployer.release.sign import generate_key
from deployer.transport import LocalTransport

ROOT = Path(__file__).resolve().parents[2]
PASSPHRASE = "a long enough passphrase"


def run(*args: str, env: dict[str, str] | None = None):
    return CliRunner(env=env).invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture
def project(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`init` + an encrypted key pair, the model pointed at the tiny checkpoint; no passphrase set."""
    monkeypatch.delenv("SITS_SIGNING_PASSPHRASE", raising=False)
    directory = tmp_path / "my-fleet"
    assert run("init", str(directory)).exit_code == 0
    generate_key(
        directory / "keys/release.key", directory / "keys/release.pub", passphrase=Secret(PASSPHRASE)
    )
    deploy = directory / "deploy.yaml"
    deploy.write_text(deploy.read_text().replace("builtin:smollm2-135m-instruct", str(tiny_model_dir)))
    return directory


def _edit(project: Path, **strategy: object) -> None:
    deploy = project / "deploy.yaml"
    doc = yaml.safe_load(deploy.read_text())
    doc["strategy"].update(strategy)
    deploy.write_text(yaml.safe_dump(doc, sort_keys=False))


def _site(project: Path, name: str) -> DeviceSite:
    config = load_config(project / "deploy.yaml", environ={}, secrets=False)
    return DeviceSite.of(config, next(d for d in config.fleet.devices if d.name == name))


# 2. A controller venv on PATH is not the device's agent.
def test_facts_never_take_the_bootstrap_interpreter_for_the_agent(project):
    inventory = project / "inventory.yaml"
    doc = yaml.safe_load(inventory.read_text())
    for device in doc["devices"]:
        device["python"] = "python3"  # the default: the agent lives in the device's own venv
    inventory.write_text(yaml.safe_dump(doc))
    site = _site(project, "dev1")
    # As with `source .venv/bin/activate`: python3 is an interpreter that has sits-deployer.
    site = DeviceSite(**{**site.__dict__, "bootstrap_python": sys.executable})
    facts = gather_facts(site, LocalTransport(Path(site.root)))
    assert facts.reachable and facts.agent_version is None
    desired = DesiredState("1.0.0", "a" * 64, 10, "0.1.0", {})
    assert plan_device(desired, facts).steps[0].kind is StepKind.BOOTSTRAP


# 1. Why a device is offline, in one line.
def test_an_offline_reason_is_one_line_that_says_what_was_found(project, tmp_path):
    missing = tmp_path / "nowhere"
    site = DeviceSite(**{**_site(project, "dev1").__dict__, "root": str(missing)})
    facts = gather_facts(site, LocalTransport(missing))
    assert not facts.reachable
    assert facts.error == f"dev1: device root {missing} does not exist (mkdir -p {missing})"
    site = DeviceSite(
        **{**_site(project, "dev1").__dict__, "python": "/no/python", "bootstrap_python": "/no/py3"}
    )
    facts = gather_facts(site, LocalTransport(Path(site.root)))
    assert "\n" not in (facts.error or "") and len(facts.error or "") < 240
    assert "no Python on the device: neither /no/python nor /no/py3 runs" in (facts.error or "")


# 6. plan builds nothing, needs no passphrase; an artifact not built is a pending change.
def test_plan_before_build_is_a_pending_change_and_builds_nothing(project):
    result = run("plan", "-f", str(project / "deploy.yaml"), "--detailed-exitcode")
    assert result.exit_code == 2, result.stderr
    assert result.stdout.count("1.0.0 not built: run `sits-deployer build`") == 2  # the table: stdout
    assert not (project / ".sits/store/artifacts").exists()
    assert not (project / ".sits/releases").exists()


def test_status_and_logs_need_no_passphrase(project):
    status = run("status", "-f", str(project / "deploy.yaml"))
    assert status.exit_code == 0, status.stderr
    assert [line.split()[1] for line in status.stdout.splitlines() if "dev1" in line] == ["dev1"]
    log = project / ".sits/fleet/dev1/var/log/sits-agent.log"
    log.parent.mkdir(parents=True)
    log.write_text("agent started\n")
    logs = run("logs", "dev1", "-f", str(project / "deploy.yaml"))
    assert (logs.exit_code, logs.stdout) == (0, "agent started\n"), logs.stderr


# 5. Offline is drift; under offline: fail it is an error, in plan and in apply --dry-run.
@pytest.mark.parametrize(("policy", "code"), [("fail", 1), ("skip", 2)])
def test_offline_devices_fail_the_drift_check(project, policy, code):
    _edit(project, offline=policy)
    (project / ".sits/fleet/dev2").rmdir()
    assert run("build", "-f", str(project / "deploy.yaml"), "-q").exit_code == 0
    result = run("plan", "-f", str(project / "deploy.yaml"), "--detailed-exitcode")
    assert result.exit_code == code, result.stderr
    assert "dev2: device root" in result.stdout
    dry = run("apply", "-f", str(project / "deploy.yaml"), "--dry-run")
    assert dry.exit_code == (1 if policy == "fail" else 0), dry.stderr
    if policy == "fail":
        assert "dry run: a real apply would refuse: 1 device(s) offline" in dry.stderr
    assert not (project / ".sits/releases").exists()  # a dry run signs nothing


# 6. A stale saved plan is refused at once, blaming deploy.yaml.
def test_a_saved_plan_is_refused_fast_when_deploy_yaml_changed(project):
    deploy = project / "deploy.yaml"
    assert run("build", "-f", str(deploy), "-q").exit_code == 0
    assert run("plan", "-f", str(deploy), "-o", str(project / "plan.json")).exit_code == 0
    deploy.write_text(deploy.read_text().replace("version: 1.0.0", "version: 1.0.1"))
    result = run("apply", str(project / "plan.json"), env={"SITS_SIGNING_PASSPHRASE": PASSPHRASE})
    assert result.exit_code == 1
    assert f"{deploy} changed since this plan was made; not applying it" in result.stderr
    assert not list((project / ".sits/store/artifacts").iterdir())[1:]  # 1.0.1 was not built


# 8. apply deploy.yaml (no -f) is a usage error with the fix.
def test_a_positional_deploy_yaml_gets_a_hint(project):
    result = run("apply", str(project / "deploy.yaml"))
    assert result.exit_code == 2
    assert f"use `sits-deployer apply -f {project / 'deploy.yaml'}`" in result.stderr


# 8. -q/-v after the subcommand; -q is quiet.
def test_quiet_and_verbose_after_the_subcommand(project):
    quiet = run(
        "validate", "-f", str(project / "deploy.yaml"), "-q", env={"SITS_SIGNING_PASSPHRASE": PASSPHRASE}
    )
    assert (quiet.exit_code, quiet.stderr) == (0, "")
    loud = run(
        "validate", "-f", str(project / "deploy.yaml"), "-v", env={"SITS_SIGNING_PASSPHRASE": PASSPHRASE}
    )
    assert loud.exit_code == 0 and "valid (my-fleet, 2 devices)" in loud.stderr


# 8. SSH failures: our one-line error, no paramiko traceback.
def test_an_ssh_failure_prints_no_traceback(project):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def close_each() -> None:  # an "sshd" that hangs up before its banner
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=close_each, daemon=True).start()
    inventory = project / "inventory.yaml"
    doc = yaml.safe_load(inventory.read_text())
    doc["devices"][1] = {  # dev1 stays local; the canary's 2 steps need 2 devices
        "name": "edge",
        "transport": "ssh",
        "host": "127.0.0.1",
        "port": port,
        "trust_on_first_use": True,
    }
    inventory.write_text(yaml.safe_dump(doc))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "deployer", "status", "-f", str(project / "deploy.yaml")],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
    finally:
        server.close()
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    (row,) = [cells for cells in map(str.split, done.stdout.splitlines()) if cells[1:2] == ["edge"]]
    assert row[1] == "edge" and "offline" in row


# 7. logs --follow streams.
def test_logs_follow_streams_new_lines(project):
    log = project / ".sits/fleet/dev1/var/log/sits-agent.log"
    log.parent.mkdir(parents=True)
    log.write_text("first\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        "-m",
        "deployer",
        "logs",
        "dev1",
        "--follow",
        "-f",
        str(project / "deploy.yaml"),
    ]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) as follow:
        try:
            assert _line(follow) == "first\n"
            with log.open("a") as out:
                out.write("second\n")
            assert _line(follow) == "second\n"  # printed while the command still runs
            assert follow.poll() is None
        finally:
            follow.terminate()


def _line(proc: subprocess.Popen) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready, "no output within 60 s"
    return proc.stdout.readline()


# 8. gc: the controller's store keeps what devices run, what deploy.yaml names, the last N released.
def test_gc_keeps_the_current_target_and_removes_the_rest(project):
    deploy = project / "deploy.yaml"
    for version in ("1.0.0", "1.1.0", "1.2.0"):
        text = deploy.read_text()
        deploy.write_text(text.replace(text.split("version: ", 1)[1].split("\n", 1)[0], version, 1))
        assert run("build", "-f", str(deploy), "-q").exit_code == 0
    artifacts = project / ".sits/store/artifacts"
    assert len(list(artifacts.iterdir())) == 3
    result = run("gc", "-f", str(deploy), "--output", "json")
    assert result.exit_code == 0, result.stderr
    assert len(json.loads(result.stdout)) == 2
    (kept,) = artifacts.iterdir()
    assert json.loads((kept / "sits-manifest.json").read_text())["model"]["version"] == "1.2.0"


# 7. A rollback to a version still on the device is a pointer switch (the planner's part).
def test_a_version_still_on_the_device_is_switched_to_not_sent():
    facts = DeviceFacts(
        "d",
        True,
        agent_version="0.1.0",
        model_version="1.1.0",
        model_sha256="b" * 64,
        free_disk_bytes=0,
        stored_artifacts={"a" * 64: "1.0.0", "b" * 64: "1.1.0"},
    )
    desired = DesiredState("1.0.0", "a" * 64, 10**8, "0.1.0", {}, patches={"b" * 64: 10**7})
    plan = plan_device(desired, facts)
    assert [s.kind for s in plan.steps][:2] == [StepKind.SEND_MANIFEST, StepKind.INSTALL]
    assert plan.bytes_to_send == 0 and plan.reason == "1.0.0 is still on the device: switch to it"


# 9. setup.sh says, before it starts, that the silent llama.cpp compile takes 5-10 minutes. The
# compile is scripts/llamacpp.sh's `pip wheel`, which setup.sh runs before installing the extra.
def test_setup_announces_the_llama_cpp_compile_before_it_starts():
    setup = (ROOT / "scripts/setup.sh").read_text().splitlines()
    built_at = next(i for i, line in enumerate(setup) if "scripts/llamacpp.sh" in line and " wheel)" in line)
    installed_at = next(i for i, line in enumerate(setup) if 'install -e "$ROOT[dev,llamacpp]"' in line)
    assert built_at < installed_at
    lines = (ROOT / "scripts/llamacpp.sh").read_text().splitlines()
    compile_at = next(i for i, line in enumerate(lines) if "pip wheel" in line)
    said = [i for i, line in enumerate(lines[:compile_at]) if line.strip().startswith("log ")]
    assert said and "5-10 minutes" in lines[said[-1]]
    assert not any("about a minute" in line for line in setup + lines)


# 5. examples/seed-003: its devices cannot be reached, so a real apply refuses; so does the dry run.
def test_seed_003_dry_run_reports_the_refusal(tmp_path, tiny_model_dir):
    shutil.copytree(ROOT / "examples/seed-003", tmp_path / "seed-003")
    shutil.copytree(ROOT / "examples/keys", tmp_path / "keys")
    model = tmp_path / "cache/models/smollm2-135m-instruct-v1"  # the tiny model as the builtin
    shutil.copytree(tiny_model_dir, model)
    (model / ".complete").write_text("ok\n")
    # Tests reach only loopback: its hosts become a bound port of ours that nothing listens on.
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    deploy = tmp_path / "seed-003/deploy.yaml"
    text = deploy.read_text()
    for host, loopback in (("10.40.0.11", "127.0.0.1"), ("10.40.0.12", "127.0.0.2")):
        assert f"host: {host}\n" in text
        text = text.replace(f"host: {host}\n", f"host: {loopback}\n      port: {closed.getsockname()[1]}\n")
    deploy.write_text(text)
    env = {"SITS_CACHE_DIR": str(tmp_path / "cache")}
    try:
        result = run("apply", "-f", str(deploy), "--dry-run", env=env)
    finally:
        closed.close()
    assert result.exit_code == 1
    assert "dry run: a real apply would refuse: 2 device(s) offline" in result.stderr
    assert result.stdout.count(" offline ") == 2
    assert not (tmp_path / "seed-003/.sits/store/artifacts").exists()  # the dry run built nothing


# 8. A hook's output (the executor hands it to on_phase: tests/push) shows with -v, also when it
# arrives from a worker thread, where click's context is not visible.
@pytest.mark.parametrize("level", [0, 1])
def test_a_hooks_output_is_shown_with_v(level, capsys):
    import click

    from deployer.cli.fleet_cmds import _on_phase

    with click.Context(cli, obj={"verbosity": level}):
        on_phase = _on_phase(None)
    worker = threading.Thread(target=on_phase, args=("dev1", "pre-deploy output", "checked dev1\n"))
    worker.start()
    worker.join()
    on_phase("dev1", "install", "verify and install 1.0.0")
    err = capsys.readouterr().err
    assert ("dev1: pre-deploy output:\nchecked dev1" in err) == (level == 1)
    assert "dev1: install verify and install 1.0.0" in err  # progress lines without -v too


# A project in a deep directory: the agent's admin socket must still fit a unix socket's path.
def test_a_deep_project_gets_an_admin_socket_path_that_fits(project):
    from deployer.push.bootstrap import UNIX_PATH_MAX, agent_settings

    config = load_config(project / "deploy.yaml", environ={}, secrets=False)
    site = _site(project, "dev1")
    short = DeviceSite(**{**site.__dict__, "root": "/srv/dev1"})
    assert "admin_socket" not in yaml.safe_load(agent_settings(config, short))  # the default fits
    deep = DeviceSite(**{**site.__dict__, "root": "/srv/" + "d" * 100 + "/dev1"})
    socket_path = yaml.safe_load(agent_settings(config, deep))["admin_socket"]
    assert len(socket_path.encode()) <= UNIX_PATH_MAX and socket_path.startswith(str(Path.home()))
    other = DeviceSite(**{**deep.__dict__, "root": "/srv/" + "d" * 100 + "/dev2"})
    assert yaml.safe_load(agent_settings(config, other))["admin_socket"] != socket_path


# 5. A drift check runs where no signing key is (docs/ci.md's drift job): a missing key is not
# its error; the dry run of a real apply names it.
def test_no_signing_key_is_drift_for_plan_and_a_refusal_for_the_dry_run(project):
    deploy = project / "deploy.yaml"
    doc = yaml.safe_load(deploy.read_text())
    del doc["signing"]["private_key"]
    deploy.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert run("build", "-f", str(deploy), "-q").exit_code == 0
    drift = run("plan", "-f", str(deploy), "--detailed-exitcode")
    assert drift.exit_code == 2, drift.stderr
    dry = run("apply", "-f", str(deploy), "--dry-run")
    assert dry.exit_code == 1
    assert "dry run: a real apply would refuse: deploy.yaml has no signing.private_key" in dry.stderr
    assert "sits-deployer keygen -o keys/release" in dry.stderr
