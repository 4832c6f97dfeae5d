"""The README's Quickstart, word for word, in a temporary directory, as a new user would type it.

Each line of the block runs in one bash session (so `source`, `export` and `cd` carry over), with
the virtual environment in use linked as `.venv` (the README's `source .venv/bin/activate`: the very
trap of a controller venv on PATH) and PYTHONPATH naming this checkout. A line's exit status must
be 0, or the N of its `# exits N` comment. Before the last line (`down`) the session waits while
the test asks every device a question through the official `openai` client, then four at once
(init's project must serve them together, not queue half of them), and runs docs/ci.md's drift
check (0 when the fleet matches deploy.yaml, 1 with a device offline under `strategy.offline: fail`);
then `down` runs and no agent answers any more.

The default tier substitutes the seeded tiny checkpoint for SmolLM2 through `SITS_CACHE_DIR`
(`builtin:smollm2-135m-instruct` is read from `$SITS_CACHE_DIR/models/...`), so no line changes;
the `slow` tier runs the same block on the real SmolLM2. Wall times of the steps are printed
(`pytest -s`) and written to `$SITS_QUICKSTART_TIMES` when that is set.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import yaml

from deployer.build.demo_model import SMOLLM2_NAME, make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
EXITS = re.compile(r"#\s*exits (\d+)")
WAIT_MARK = "__QUICKSTART_WAITING__"


def readme_block() -> list[str]:
    """The command lines of the README's Quickstart block, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Quickstart", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "README.md: no ```sh block under ## Quickstart"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def drift_command() -> str:
    """docs/ci.md's drift check, as the doc writes it."""
    text = (ROOT / "docs" / "ci.md").read_text(encoding="utf-8")
    found = re.search(r"The drift\s+check\s+is\s+`([^`]+)`", text)
    assert found, "docs/ci.md: the drift check command is not stated"
    return found.group(1)


def expected_exit(line: str) -> int:
    found = EXITS.search(line)
    return int(found.group(1)) if found else 0


def session_script(lines: list[str], log: Path) -> str:
    """bash: run each line, log `index rc seconds`, and before `down` wait for the test's go."""
    out = []
    for i, line in enumerate(lines):
        if re.match(r"sits-deployer down\b", line):
            out.append(f'echo {WAIT_MARK} "$PWD"; read -r __go')
        out.append(f"__t0=$(date +%s.%N); {line}")
        out.append(f'echo "{i} $? $__t0 $(date +%s.%N)" >> {log}')
    return "\n".join(out) + "\n"


def tiny_cache(base: Path) -> Path:
    """A SITS_CACHE_DIR whose prepared 'SmolLM2' is the seeded tiny checkpoint."""
    model = base / "models" / f"{SMOLLM2_NAME}-v1"
    make_tiny_checkpoint(model, seed=0)
    (model / ".complete").write_text("ok\n")
    return base


def ask_every_device(project: Path) -> dict[str, str]:
    """A chat answer from every inventory device, through the official client."""
    inventory = yaml.safe_load((project / "inventory.yaml").read_text())
    answers = {}
    for device in inventory["devices"]:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{device['agent_port']}/v1", api_key="unused", timeout=300
        )
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8
        )
        answers[device["name"]] = reply.choices[0].message.content or ""
        assert reply.choices[0].finish_reason in {"stop", "length"}
    return answers


def ask_four_at_once(project: Path, port: int) -> None:
    """Four official clients stream at once: each sees its first token before any stream ends.

    With fewer slots than clients, the queued streams' first tokens would come only after an
    earlier stream finished. End-of-sequence is banned so that no stream ends at its first token.
    """
    config = next((project / ".sits/store/artifacts").glob("*/config.json"))
    eos = json.loads(config.read_text())["eos_token_id"]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=300)
    model = client.models.list().data[0].id
    start = threading.Barrier(4)
    firsts: list[float] = []
    ends: list[float] = []

    def stream(i: int) -> None:
        start.wait()
        chunks = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Count to {i + 5}."}],
            max_tokens=24,
            logit_bias={str(eos): -100},
            stream=True,
        )
        tokens = 0
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                tokens += 1
                if tokens == 1:
                    firsts.append(time.monotonic())
        ends.append(time.monotonic())
        assert tokens > 1

    with ThreadPoolExecutor(4) as pool:
        for done in [pool.submit(stream, i) for i in range(4)]:
            done.result(timeout=600)
    assert len(firsts) == len(ends) == 4
    assert max(firsts) < min(ends), "a stream started only after another had finished: it was queued"


def run_drift(project: Path, env: dict[str, str]) -> int:
    return subprocess.run(
        ["bash", "-c", f"source .venv/bin/activate && cd my-fleet && {drift_command()}"],
        cwd=project.parent,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    ).returncode


def run_quickstart(tmp_path: Path, cache: Path | None) -> None:
    lines = readme_block()
    work = tmp_path / "work"
    work.mkdir()
    (work / ".venv").symlink_to(sys.prefix)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SITS_")}
    env |= {"PYTHONPATH": str(ROOT), "COLUMNS": "200", "NO_COLOR": "1"}
    if cache is not None:
        env["SITS_CACHE_DIR"] = str(cache)
    log = tmp_path / "steps.log"
    script = tmp_path / "quickstart.sh"
    script.write_text(session_script(lines, log))
    output = tmp_path / "session.out"
    project = work / "my-fleet"
    with output.open("w") as out:
        session = subprocess.Popen(
            ["bash", str(script)],
            cwd=work,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=out,
            text=True,
        )
    try:
        assert session.stdout is not None and session.stdin is not None
        waiting = next((line for line in session.stdout if line.startswith(WAIT_MARK)), None)
        assert waiting is not None, f"the session ended early:\n{output.read_text()[-4000:]}"
        steps = _steps(log, lines)
        failed = [(line, rc) for line, rc, _ in steps if rc != expected_exit(line)]
        assert not failed, f"{failed}\n{output.read_text()[-6000:]}"
        answers = ask_every_device(project)
        assert set(answers) == {"dev1", "dev2"}
        inventory = yaml.safe_load((project / "inventory.yaml").read_text())
        ask_four_at_once(project, inventory["devices"][0]["agent_port"])
        audit = [json.loads(line) for line in (project / ".sits/audit.jsonl").read_text().splitlines()]
        rollback = next(r for r in reversed(audit) if r["action"] == "rollback")
        manifest = max(p.stat().st_size for p in (project / ".sits/releases").glob("[0-9]*.json"))
        # 1.0.0 was still on the devices: the rollback sent its signed manifest and nothing else.
        assert all(0 < r["bytes_sent"] <= manifest for r in rollback["results"]), rollback
        drift_env = env  # no SITS_* variable: the drift check needs no passphrase
        deploy = project / "deploy.yaml"
        deploy.write_text(deploy.read_text().replace("version: 1.1.0", "version: 1.0.0"))
        assert run_drift(project, drift_env) == 0  # the fleet runs 1.0.0 again: no drift
        root = project / ".sits/fleet/dev2"
        root.rename(root.with_name("dev2.away"))
        try:
            assert run_drift(project, drift_env) == 1  # offline under strategy.offline: fail
        finally:
            root.with_name("dev2.away").rename(root)
        session.stdin.write("go\n")
        session.stdin.close()
        assert session.wait(timeout=300) == 0
        steps = _steps(log, lines)
        assert [rc for _, rc, _ in steps] == [expected_exit(line) for line in lines]
        ports = [d["agent_port"] for d in yaml.safe_load((project / "inventory.yaml").read_text())["devices"]]
        for port in ports:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
        _report(steps)
    finally:
        if session.poll() is None:
            session.kill()
        if project.is_dir():  # stop whatever agents an early failure left running
            subprocess.run(
                [sys.executable, "-m", "deployer", "down", "-q", "-f", str(project / "deploy.yaml")],
                env=env,
                capture_output=True,
                check=False,
                timeout=300,
            )


def _steps(log: Path, lines: list[str]) -> list[tuple[str, int, float]]:
    rows = [entry.split() for entry in log.read_text().splitlines()] if log.is_file() else []
    return [(lines[int(i)], int(rc), float(t1) - float(t0)) for i, rc, t0, t1 in rows]


def _report(steps: list[tuple[str, int, float]]) -> None:
    table = [
        {"step": line.split("  #")[0].strip(), "rc": rc, "seconds": round(s, 1)} for line, rc, s in steps
    ]
    for row in table:
        print(f"{row['seconds']:8.1f}s  rc={row['rc']}  {row['step']}")
    if target := os.environ.get("SITS_QUICKSTART_TIMES"):
        Path(target).write_text(json.dumps(table, indent=2) + "\n")


def test_readme_quickstart_word_for_word_tiny_model(tmp_path: Path) -> None:
    run_quickstart(tmp_path, tiny_cache(tmp_path / "cache"))


@pytest.mark.slow
def test_readme_quickstart_word_for_word_smollm2(tmp_path: Path) -> None:
    run_quickstart(tmp_path, None)


def test_readme_quickstart_lines_are_what_the_test_expects() -> None:
    """The block starts from the venv, makes a fresh project, and ends by stopping the fleet."""
    lines = readme_block()
    assert lines[0].startswith("source .venv/bin/activate")
    assert any(re.match(r"sits-deployer init my-fleet\b", line) for line in lines)
    assert re.match(r"sits-deployer down\b", lines[-1])
