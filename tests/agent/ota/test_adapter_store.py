"""deployer/agent/ota/adapters.py: installed adapters, current/previous, counters that never go down."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deployer.agent.ota.adapters import AdapterStore
from deployer.errors import AgentError, UnsafePathError


def artifact(tmp_path: Path, label: str) -> Path:
    src = tmp_path / f"src-{label}"
    src.mkdir()
    (src / "adapter.json").write_text(json.dumps({"label": label}))
    return src


def test_install_rollback_remove(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "base")
    assert store.installed() == {} and store.record("summarise") is None
    one = store.install("summarise", artifact(tmp_path, "1"), "sha256:aa", "1.0", counter=1)
    assert json.loads((one.path / "adapter.json").read_text()) == {"label": "1"}
    two = store.install("summarise", artifact(tmp_path, "2"), "sha256:bb", "2.0", counter=2)
    assert store.installed() == {"summarise": two}
    state = json.loads((tmp_path / "base/adapters/summarise/state.json").read_text())
    assert (state["current"], state["previous"], state["version"], state["counter"]) == (
        "sha256:bb",
        "sha256:aa",
        "2.0",
        2,
    )
    back = store.rollback("summarise")
    assert back is not None and (back.artifact_id, back.version, back.path) == ("sha256:aa", "1.0", one.path)
    assert store.state("summarise").counter == 2  # a rollback never lowers the counter
    store.remove("summarise")
    assert store.record("summarise") is None and not one.path.exists()
    assert store.rollback("summarise") is None


def test_a_lower_counter_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    store.install("x", artifact(tmp_path, "1"), "id2", "2", counter=5)
    with pytest.raises(AgentError, match="counter 4 is below the installed 5"):
        store.install("x", artifact(tmp_path, "0"), "id1", "1", counter=4)
    record = store.record("x")
    assert record is not None and record.version == "2"
    store.remove("x")
    with pytest.raises(AgentError, match="below the installed 5"):  # remove keeps the counter
        store.install("x", artifact(tmp_path, "old"), "id1", "1", counter=3)


@pytest.mark.parametrize("name, artifact_id", [("../x", "id"), ("x", "../../etc"), ("x", "a/b")])
def test_names_that_escape_the_store_are_refused(tmp_path: Path, name: str, artifact_id: str) -> None:
    with pytest.raises(UnsafePathError):
        AdapterStore(tmp_path).install(name, artifact(tmp_path, "1"), artifact_id, "1", counter=1)
