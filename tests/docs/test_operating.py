"""docs/operating.md's command blocks, run as written, in order, on a fleet like the one the doc
describes: an `init` project whose two local devices are named kiosk-01 (site=hall-a) and
kiosk-02 (site=hall-b), which has released 1.0.0 and then 1.1.0 (so `.sits/audit.jsonl`, patches
and rollback targets exist).

`sits-deployer` lines run in the project directory. `sits-agent` lines run "on the device"
kiosk-01: in its directory with SITS_ROOT set to it (what `--root` sets, as the doc says for a
device that lives in a directory). `$USB`, the air-gapped site's stick, is a directory both see;
the bundle installed from it must move kiosk-01 (rolled back to 1.0.0 just before) to 1.1.0. A
`--follow` line streams until Ctrl-C: it must print a line of the log while it runs, then SIGINT
ends it with 130. The lock block is about a lock left by a killed apply: the test leaves one with
the doc's lock id first. Every other line must exit 0. The seeded tiny checkpoint stands in for
SmolLM2: deploy.yaml's `model.source` names its directory rather than the builtin, since validate
checks an adapter of a builtin base against the real SmolLM2's shape.

"LoRA adapters" has the reader add its yaml block under deploy.yaml's `model:`: the test does so
before the section's first line, as written, with a real PEFT adapter of the model (made by peft)
in the block's `source`, and saves a second fine-tune there before the section's `sed` line (the
doc's "save the new fine-tune"). `$ADAPTER` is the adapter artifact the last build made.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import yaml

from deployer.agent.ota.adapters import AdapterStore
from deployer.agent.ota.store import DeviceStore
from deployer.build.demo_model import SMOLLM2_NAME
from tests.agent.lora_helpers import make_peft_adapter
from tests.quickstart.test_quickstart import tiny_cache
from tests.signals import default_sigint

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "operating.md"
FENCE = re.compile(r"^ *```sh\n(.*?)^ *```", re.M | re.S)  # also the indented blocks of a list
ADAPTERS = "## LoRA adapters"
LOCK_ID = re.compile(r"--force-unlock (\w+)")
PASSPHRASE = "a long enough passphrase"


def doc_lines() -> list[tuple[str, str]]:
    """Every command line of the doc's ```sh blocks, in order (comments stripped), each with its
    section's heading."""
    text = DOC.read_text(encoding="utf-8")
    lines = []
    for block in FENCE.finditer(text):
        heading = re.findall(r"^## .*$", text[: block.start()], re.M)[-1]
        for raw in block.group(1).splitlines():
            line = raw.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                lines.append((heading, line))
    return lines


def _adapters_block() -> str:
    """The adapters section's yaml block, as the reader adds it to deploy.yaml."""
    section = DOC.read_text(encoding="utf-8").split(f"{ADAPTERS}\n", 1)[1].split("\n## ", 1)[0]
    [block] = re.findall(r"^```yaml\n(.*?)^```", section, re.M | re.S)
    return block


def _fine_tune(model: Path, dest: Path, seed: int) -> None:
    """A real PEFT adapter of `model` at `dest` (in place of an earlier one)."""
    shutil.rmtree(dest, ignore_errors=True)
    make_peft_adapter(model, dest, seed=seed)


def _declare_adapters(project: Path, model: Path) -> list[Path]:
    """The block added at the end of deploy.yaml's `model:` mapping, and a fine-tune in each
    adapter's source; those sources."""
    block = _adapters_block()
    deploy = project / "deploy.yaml"
    lines = deploy.read_text().splitlines(keepends=True)
    start = lines.index("model:\n") + 1
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith(" "))
    body = block.split("model:\n", 1)[1]
    deploy.write_text("".join([*lines[:end], body, *lines[end:]]))
    sources = [project / a["source"] for a in yaml.safe_load(block)["model"]["adapters"]]
    for source in sources:
        _fine_tune(model, source, seed=1)
    return sources


def _built_adapter(project: Path, env: dict[str, str]) -> str:
    """The artifact directory of deploy.yaml's adapter, as `build` names it (a cache hit)."""
    done = subprocess.run(
        [sys.executable, "-m", "deployer", "build", "--output", "json"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    [adapter] = json.loads(done.stdout)["adapters"]
    return str(adapter["artifact_dir"])


def _project(tmp_path: Path, env: dict[str, str], model: Path) -> Path:
    """An init project of `model` with the doc's device names, after releasing 1.0.0 and then
    1.1.0."""
    project = tmp_path / "fleet"

    def sits(*args: str) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "deployer", *args], cwd=project, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, f"{args}: {done.stderr[-3000:]}"

    subprocess.run([sys.executable, "-m", "deployer", "init", str(project)], env=env, check=True)
    inventory = project / "inventory.yaml"
    doc = yaml.safe_load(inventory.read_text())
    names = [("kiosk-01", "hall-a"), ("kiosk-02", "hall-b")]
    for device, (name, site) in zip(doc["devices"], names, strict=True):
        device["name"], device["labels"] = name, {"site": site}
    inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    sits("keygen", "-o", "keys/release")
    deploy = project / "deploy.yaml"
    deploy.write_text(re.sub(r"(?m)^  source: builtin:\S+", f"  source: {model}", deploy.read_text()))
    for version in ("1.0.0", "1.1.0"):
        deploy.write_text(re.sub(r"(?m)^  version: .*$", f"  version: {version}", deploy.read_text()))
        sits("build", "-q")
        sits("apply", "-q")
    return project


def _leave_a_lock(project: Path, lock_id: str) -> None:
    """A lock as a killed apply leaves it (its pid is gone)."""
    lock = {
        "lock_id": lock_id,
        "command": "apply",
        "pid": 2**22 + 1,
        "host": "ci",
        "started": "2026-01-01T00:00:00Z",
    }
    (project / ".sits" / "lock.json").write_text(json.dumps(lock) + "\n")


def _follow(line: str, cwd: Path, env: dict[str, str], log: Path) -> int:
    """Run a --follow line until it printed a line written while it ran, then Ctrl-C it."""
    with subprocess.Popen(
        ["bash", "-c", f"exec {line}"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    ) as proc:
        assert proc.stdout is not None
        printed: queue.Queue[str | None] = queue.Queue()
        reader = threading.Thread(target=lambda: [*map(printed.put, proc.stdout), printed.put(None)])
        reader.start()
        marker = f"operating.md test {os.getpid()}\n"
        # tail -F can miss a line appended while it starts watching the file (it sees it with the
        # next one), so the marker is appended again each time two seconds pass without it.
        for _ in range(30):
            with log.open("a") as out:
                out.write(marker)
            try:
                while (got := printed.get(timeout=2)) != marker:
                    if got is None:
                        raise AssertionError(f"{line}: ended before it printed the new line")
                break
            except queue.Empty:
                continue
        else:
            raise AssertionError(f"{line}: never printed the lines appended to {log}")
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
        reader.join(60)
        return code


def test_operating_md_blocks_run_as_written(tmp_path: Path) -> None:
    lines = doc_lines()
    assert any(line.startswith("sits-agent ") for _, line in lines)
    assert any(LOCK_ID.search(line) for _, line in lines)
    assert any(heading == ADAPTERS for heading, _ in lines)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SITS_")}
    env |= {
        "PYTHONPATH": str(ROOT),
        "PATH": f"{Path(sys.executable).parent}:{env['PATH']}",
        "SITS_CACHE_DIR": str(tiny_cache(tmp_path / "cache")),
        "SITS_SIGNING_PASSPHRASE": PASSPHRASE,
        "COLUMNS": "200",
        "NO_COLOR": "1",
        "USB": str(tmp_path / "usb"),  # "Air-gapped sites": where the stick is mounted
    }
    (tmp_path / "usb").mkdir()
    model = tmp_path / "cache" / "models" / f"{SMOLLM2_NAME}-v1"
    project = _project(tmp_path, env, model)
    device = project / ".sits" / "fleet" / "dev1"  # kiosk-01's directory
    adapter_sources: list[Path] = []
    try:
        for heading, line in lines:
            if heading == ADAPTERS and not adapter_sources:
                adapter_sources = _declare_adapters(project, model)
            if heading == ADAPTERS and line.startswith("sed -i"):
                for source in adapter_sources:
                    _fine_tune(model, source, seed=2)
            if "$ADAPTER" in line:
                env["ADAPTER"] = _built_adapter(project, env)
            on_device = line.startswith("sits-agent ")
            cwd, line_env = (device, {**env, "SITS_ROOT": str(device)}) if on_device else (project, env)
            if found := LOCK_ID.search(line):
                _leave_a_lock(project, found.group(1))
            if "--follow" in line:
                assert _follow(line, cwd, line_env, device / "var" / "log" / "sits-agent.log") == 130, line
                continue
            done = subprocess.run(["bash", "-c", line], cwd=cwd, env=line_env, capture_output=True, text=True)
            assert done.returncode == 0, (
                f"{line}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
            )
            if "install --from" in line:
                assert (device / "var/lib/sits/current").readlink().name == "1.1.0", done.stderr
        status = subprocess.run(
            ["bash", "-c", "sits-deployer status -f deploy.yaml --output json"],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        # The last block's apply (after --force-unlock) brought every device back to deploy.yaml's 1.1.0.
        assert {row["device"]: row["version"] for row in json.loads(status.stdout)} == {
            "kiosk-01": "1.1.0",
            "kiosk-02": "1.1.0",
        }
        assert not (project / ".sits" / "lock.json").exists()
        # kiosk-02 was rolled back to summarise 1.0.0 by the fleet; kiosk-01 took 1.1.0 by hand,
        # then went back to 1.0.0 by itself; neither adapter rollback touched the base (above).
        for root in (device, project / ".sits" / "fleet" / "dev2"):
            store = AdapterStore(DeviceStore(root).base)
            assert (store.record("summarise").version, store.state("summarise").previous_version) == (
                "1.0.0",
                "1.1.0",
            )
    finally:
        subprocess.run(
            [sys.executable, "-m", "deployer", "down", "-q", "-f", str(project / "deploy.yaml")],
            env=env,
            capture_output=True,
            check=False,
            timeout=300,
        )
