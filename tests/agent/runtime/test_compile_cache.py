"""inductor's, Triton's and our CPU kernels' caches under the agent's store: set before an engine
loads, made without write access for others, and never over an operator's own value."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from deployer.agent.runtime.compile_cache import CACHE_VARIABLES, use_store_caches
from deployer.agent.settings import AgentSettings


@pytest.fixture(autouse=True)
def _no_cache_variables(monkeypatch):
    # The test process may have compiled already (torch then sets TORCHINDUCTOR_CACHE_DIR itself);
    # monkeypatch restores whatever was there.
    for variable in CACHE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)


def test_every_cache_goes_under_the_store(tmp_path):
    state_dir = AgentSettings(root=tmp_path / "root").state_dir
    state_dir.mkdir(parents=True)
    state_dir.chmod(0o770)  # group write on the store is not passed on: the caches hold code
    assert use_store_caches(state_dir) == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "root/var/lib/sits/cache/inductor"),
        "TRITON_CACHE_DIR": str(tmp_path / "root/var/lib/sits/cache/triton"),
        "SITS_KERNEL_CACHE_DIR": str(tmp_path / "root/var/lib/sits/cache/kernels"),
    }
    for variable, name in CACHE_VARIABLES.items():
        path = state_dir / "cache" / name
        assert os.environ[variable] == str(path) and path.is_dir()
        assert stat.S_IMODE(path.stat().st_mode) & 0o022 == 0
    assert use_store_caches(state_dir)["TRITON_CACHE_DIR"] == str(state_dir / "cache/triton")  # again: same


def test_an_operators_value_wins(tmp_path, monkeypatch):
    state_dir = tmp_path / "var/lib/sits"
    monkeypatch.setenv("TRITON_CACHE_DIR", "/srv/triton-cache")
    caches = use_store_caches(state_dir)
    assert caches == {
        "TORCHINDUCTOR_CACHE_DIR": str(state_dir / "cache/inductor"),
        "TRITON_CACHE_DIR": "/srv/triton-cache",
        "SITS_KERNEL_CACHE_DIR": str(state_dir / "cache/kernels"),
    }
    assert not (state_dir / "cache/triton").exists()


def test_a_store_that_cannot_hold_them_leaves_torchs_default(tmp_path, caplog):
    state_dir = tmp_path / "var/lib/sits"
    state_dir.parent.mkdir(parents=True)
    state_dir.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="sits.agent"):
        assert use_store_caches(state_dir) == {}
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        f"cannot make the inductor cache under {state_dir}",
        f"cannot make the triton cache under {state_dir}",
        f"cannot make the kernels cache under {state_dir}",
    ]
