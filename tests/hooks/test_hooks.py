"""Running hooks: the documented environment, failures, timeouts that take the children along."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from deployer.config.loader import load_config
from deployer.errors import HookError
from deployer.push import hooks
from deployer.push.hooks import PHASES, HookContext, run_hook, run_phase_hook

CONTEXT = HookContext(
    phase="pre-deploy",
    device="edge-01",
    host="10.77.1.11",
    from_version="1.0.0",
    to_version="1.1.0",
    application="chat-edge",
    namespace="prod",
)


def script(directory: Path, body: str, name: str = "hook.sh", mode: int = 0o755) -> Path:
    path = directory / name
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(mode)
    return path


def alive(pid: int, *, grace_s: float = 5.0) -> bool:
    """Still running after `grace_s` (a zombie waiting to be reaped counts as gone).

    A killed process needs to be scheduled once to die, which on a loaded machine takes a moment.
    """
    deadline = time.monotonic() + grace_s
    while True:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return False
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)


def test_environment_is_documented_and_complete(tmp_path):
    out = tmp_path / "env.txt"
    hook = script(tmp_path, f"env > {out}\n")
    result = run_hook(hook, CONTEXT, timeout_s=30, base_env={"PATH": os.environ["PATH"], "KEEP_ME": "yes"})
    env = dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
    assert {key: env[key] for key in CONTEXT.environment()} == {
        "SITS_PHASE": "pre-deploy",
        "SITS_DEVICE": "edge-01",
        "SITS_HOST": "10.77.1.11",
        "SITS_FROM_VERSION": "1.0.0",
        "SITS_TO_VERSION": "1.1.0",
        "SITS_APPLICATION": "chat-edge",
        "SITS_NAMESPACE": "prod",
    }
    assert env["KEEP_ME"] == "yes"
    assert result.returncode == 0
    for variable in CONTEXT.environment():
        assert variable in hooks.__doc__


def test_fresh_device_has_an_empty_from_version(tmp_path):
    hook = script(tmp_path, 'printf "from=[%s] phase=%s" "$SITS_FROM_VERSION" "$SITS_PHASE"\n')
    context = HookContext(phase="post-deploy", device="new", host="h", to_version="1.0.0")
    assert run_hook(hook, context, timeout_s=30).output == "from=[] phase=post-deploy"


def test_output_is_captured_from_stdout_and_stderr(tmp_path):
    hook = script(tmp_path, "echo to-stdout\necho to-stderr >&2\n")
    output = run_hook(hook, CONTEXT, timeout_s=30).output
    assert "to-stdout" in output
    assert "to-stderr" in output


def test_nonzero_exit_names_the_hook_the_code_and_the_last_lines(tmp_path):
    hook = script(tmp_path, 'for i in $(seq 1 30); do echo "line $i"; done\nexit 3\n')
    with pytest.raises(HookError) as info:
        run_hook(hook, CONTEXT, timeout_s=30)
    error = info.value
    assert error.returncode == 3
    assert error.phase == "pre-deploy"
    assert str(hook) in error.message
    assert "edge-01" in error.message
    assert "exited with code 3" in error.message
    assert "line 30" in error.message
    assert "line 21" in error.message
    assert "line 20\n" not in error.message
    assert "SITS_DEVICE=edge-01" in error.hint
    assert "line 1\n" in error.output  # the full tail stays available to the report


def test_hanging_hook_is_killed_at_the_timeout_with_its_children(tmp_path):
    pids = tmp_path / "pids"
    hook = script(tmp_path, f"sleep 300 &\necho $! > {pids}\necho $$ >> {pids}\necho started\nwait\n")
    with pytest.raises(HookError, match="timeout") as info:
        run_hook(hook, CONTEXT, timeout_s=5)  # room for a loaded CI machine to start it
    child, parent = (int(line) for line in pids.read_text().split())
    assert not alive(child)
    assert not alive(parent)
    assert info.value.returncode == -15
    assert "started" in info.value.message


def test_hook_ignoring_sigterm_is_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(hooks, "KILL_GRACE_S", 0.5)
    hook = script(tmp_path, "trap '' TERM\nwhile :; do sleep 0.1; done\n")
    with pytest.raises(HookError, match="timeout") as info:
        run_hook(hook, CONTEXT, timeout_s=0.5)
    assert info.value.returncode == -9


def test_children_left_behind_by_a_successful_hook_are_killed(tmp_path):
    pid_file = tmp_path / "pid"
    hook = script(tmp_path, f"sleep 300 &\necho $! > {pid_file}\nexit 0\n")
    run_hook(hook, CONTEXT, timeout_s=30)
    assert not alive(int(pid_file.read_text()))


def test_missing_hook(tmp_path):
    with pytest.raises(HookError, match="does not exist") as info:
        run_hook(tmp_path / "nope.sh", CONTEXT, timeout_s=5)
    assert info.value.returncode is None
    assert "hooks.pre-deploy" in info.value.hint


def test_non_executable_hook(tmp_path):
    hook = script(tmp_path, "exit 0\n", mode=0o644)
    with pytest.raises(HookError, match="is not executable") as info:
        run_hook(hook, CONTEXT, timeout_s=5)
    assert info.value.hint == f"chmod +x {hook}"


def test_directory_is_not_a_hook(tmp_path):
    with pytest.raises(HookError, match="not a regular file"):
        run_hook(tmp_path, CONTEXT, timeout_s=5)


def test_script_without_interpreter_line(tmp_path):
    hook = tmp_path / "bare"
    hook.write_text("echo hi\n")
    hook.chmod(0o755)
    with pytest.raises(HookError, match="could not be started") as info:
        run_hook(hook, CONTEXT, timeout_s=5)
    assert "#!" in info.value.hint


def test_output_is_bounded(tmp_path):
    hook = script(tmp_path, f"yes {'x' * 49} | head -n 4000\necho END\n")
    output = run_hook(hook, CONTEXT, timeout_s=30).output
    assert output.startswith("[... earlier output dropped ...]")
    assert output.rstrip().endswith("END")
    assert len(output) < hooks.OUTPUT_LIMIT_BYTES + 100


def test_a_python_hook_runs_too(tmp_path):
    hook = tmp_path / "hook.py"
    hook.write_text(f"#!{sys.executable}\nimport os\nprint(os.environ['SITS_TO_VERSION'])\n")
    hook.chmod(0o755)
    assert run_hook(hook, CONTEXT, timeout_s=30).output == "1.1.0\n"


def write_deploy_yaml(directory: Path, hooks_section: str) -> Path:
    path = directory / "deploy.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            apiVersion: sits.dev/v1
            kind: Deployment
            application: chat-edge
            model: {name: smollm2, version: 1.1.0, source: "builtin:smollm2-135m-instruct"}
            fleet:
              devices: [{name: edge-01, host: 10.77.1.11}]
            """
        )
        + hooks_section
    )
    return path


def test_configured_hook_runs_relative_to_deploy_yaml(tmp_path):
    (tmp_path / "hooks").mkdir()
    script(tmp_path / "hooks", "pwd\n", name="post.sh")
    config = load_config(
        write_deploy_yaml(tmp_path, "hooks:\n  post-deploy: {path: hooks/post.sh, timeout: 10s}\n")
    )
    context = HookContext(phase="post-deploy", device="edge-01", host="10.77.1.11", to_version="1.1.0")
    result = run_phase_hook(config, context)
    assert result is not None
    assert result.output.strip() == str(tmp_path)
    assert result.path == tmp_path / "hooks" / "post.sh"


def test_configured_timeout_applies(tmp_path):
    script(tmp_path, "sleep 30\n", name="slow.sh")
    config = load_config(
        write_deploy_yaml(tmp_path, "hooks:\n  pre-rollback: {path: slow.sh, timeout: 1s}\n")
    )
    context = HookContext(phase="pre-rollback", device="edge-01", host="h", to_version="1.0.0")
    with pytest.raises(HookError, match="1s timeout"):
        run_phase_hook(config, context)


@pytest.mark.parametrize("phase", PHASES)
def test_unconfigured_phase_runs_nothing(tmp_path, phase):
    config = load_config(write_deploy_yaml(tmp_path, ""))
    assert run_phase_hook(config, HookContext(phase=phase, device="d", host="h", to_version="1.0.0")) is None


REPO = Path(__file__).resolve().parents[2]


def test_shipped_example_hooks_run(tmp_path):
    post = HookContext(phase="post-deploy", device="edge-01", host="local", to_version="1.1.0")
    env = {"PATH": os.environ["PATH"]}
    assert (
        "1.0.0 -> 1.1.0 ok" in run_hook(REPO / "hooks" / "pre-deploy-check.sh", CONTEXT, timeout_s=30).output
    )
    assert (
        "edge-01"
        in run_hook(REPO / "hooks" / "post-deploy-smoke.sh", post, timeout_s=30, base_env=env).output
    )


def test_shipped_pre_deploy_hook_refuses_a_bad_version():
    bad = HookContext(phase="pre-deploy", device="edge-01", host="local", to_version="latest")
    with pytest.raises(HookError, match="not a semantic version"):
        run_hook(REPO / "hooks" / "pre-deploy-check.sh", bad, timeout_s=30)
