"""The device store on a real filesystem: pointers, promotion, state.json, recovery and gc."""

from __future__ import annotations

import stat

import pytest

from deployer.agent.ota.store import (
    HISTORY_LIMIT,
    DeviceState,
    DeviceStore,
    HistoryEntry,
    PointerSwitch,
    check_version_name,
    utc_now,
)
from deployer.errors import AgentError, UnsafePathError


def test_empty_store_has_no_version(store):
    assert store.current_version() is None
    assert store.current_version_dir() is None
    assert store.previous_version() is None
    assert store.installed_versions() == []
    assert store.read_state() == DeviceState()


def test_promote_makes_an_immutable_version_and_pointers_are_relative(store, add_version):
    add_version("1.0.0")
    store.set_pointer("current", "1.0.0")
    assert store.current_version() == "1.0.0"
    assert store.current_version_dir() == store.versions_dir / "1.0.0"
    assert str((store.base / "current").readlink()) == "versions/1.0.0"
    weights = store.version_dir("1.0.0") / "model.safetensors"
    assert weights.read_bytes() == b"weights of 1.0.0"
    assert stat.S_IMODE(weights.stat().st_mode) == 0o444
    assert list(store.staging_dir.iterdir()) == []


def test_promoting_an_existing_version_is_refused(store, add_version):
    add_version("1.0.0")
    with pytest.raises(AgentError, match="already on disk"):
        add_version("1.0.0", b"other bytes")
    assert (store.version_dir("1.0.0") / "model.safetensors").read_bytes() == b"weights of 1.0.0"


@pytest.mark.parametrize("name", ["", ".", "..", "../etc", "a/b", "/abs", "-x", "a" * 129, "v 1"])
def test_unsafe_version_names_are_refused(store, name):
    with pytest.raises(UnsafePathError, match="cannot name a directory"):
        check_version_name(name)
    with pytest.raises(UnsafePathError):
        store.version_dir(name)


def test_pointer_swap_keeps_both_and_removal_works(store, add_version):
    add_version("1.0.0")
    add_version("1.1.0")
    store.set_pointer("current", "1.0.0")
    store.set_pointer("previous", "1.0.0")
    store.set_pointer("current", "1.1.0")
    assert (store.current_version(), store.previous_version()) == ("1.1.0", "1.0.0")
    store.set_pointer("previous", None)
    assert store.previous_version() is None
    with pytest.raises(AgentError, match="no such version"):
        store.set_pointer("current", "9.9.9")
    assert store.current_version() == "1.1.0"


def test_dangling_pointer_reads_as_absent(store):
    (store.base / "current").symlink_to("versions/gone")
    assert store.current_version() is None


def test_state_round_trips_and_history_is_bounded(store, record):
    state = DeviceState(
        installed_version="1.0.0",
        artifact_sha256="ab" * 32,
        release_counter=3,
        versions={"1.0.0": record("1.0.0", "ab" * 32, 3, utc_now())},
    )
    for i in range(HISTORY_LIMIT + 5):
        state = state.with_event(HistoryEntry(at=utc_now(), action="reload", result="ok", reason=str(i)))
    store.write_state(state)
    loaded = store.read_state()
    assert loaded == state
    assert len(loaded.history) == HISTORY_LIMIT
    assert loaded.history[-1].reason == str(HISTORY_LIMIT + 4)
    assert [p.name for p in store.base.iterdir() if ".tmp-" in p.name] == []


@pytest.mark.parametrize("content", [b"{not json", b'{"surprise": 1}', b'{"release_counter": -1}'])
def test_corrupt_state_is_a_clear_error(store, content):
    store.state_path.write_bytes(content)
    with pytest.raises(AgentError, match=r"state\.json: not a valid state file"):
        store.read_state()


def test_recover_cleans_debris_and_finishes_a_pending_switch(store, add_version, record):
    old_id, new_id = add_version("1.0.0"), add_version("1.1.0")
    store.set_pointer("current", "1.0.0")
    event = HistoryEntry(at=utc_now(), action="install", result="ok", version="1.1.0", reason="r")
    change = PointerSwitch(current="1.1.0", previous="1.0.0", event=event)
    versions = {
        "1.0.0": record("1.0.0", old_id, 1, utc_now()),
        "1.1.0": record("1.1.0", new_id, 2, utc_now()),
    }
    store.write_state(DeviceState(installed_version="1.0.0", versions=versions, pending=change))
    store.set_pointer("previous", "1.0.0")  # killed between the two pointer renames
    leftover = store.new_staging_dir("install-2.0.0")
    (leftover / "model.safetensors").write_bytes(b"half a file")
    (store.base / "state.json.tmp-abc").write_bytes(b"{")
    (store.base / ".current.tmp-123").symlink_to("versions/1.0.0")

    report = store.recover()

    assert report.finished == change
    assert len(report.removed) == 3
    assert list(store.staging_dir.iterdir()) == []
    assert not (store.base / ".current.tmp-123").is_symlink()
    assert (store.current_version(), store.previous_version()) == ("1.1.0", "1.0.0")
    state = store.read_state()
    assert (state.installed_version, state.artifact_sha256, state.pending) == ("1.1.0", new_id, None)
    assert state.history[-1].reason.endswith("(finished by recovery after an interruption)")
    assert store.recover().finished is None


def test_a_pending_switch_to_a_vanished_version_is_dropped(store, add_version, record):
    add_version("1.0.0")
    store.set_pointer("current", "1.0.0")
    event = HistoryEntry(at=utc_now(), action="rollback", result="ok", version="0.9.0")
    change = PointerSwitch(current="0.9.0", previous="1.0.0", event=event)
    store.write_state(DeviceState(installed_version="1.0.0", pending=change))
    assert store.recover().finished is None
    assert store.current_version() == "1.0.0"
    assert store.read_state().pending is None


def test_gc_keeps_current_previous_and_newest(store, add_version, record):
    records = {}
    for i, version in enumerate(["1.0.0", "1.1.0", "1.2.0", "1.3.0", "1.4.0"]):
        at = f"2026-01-0{i + 1}T00:00:00+00:00"
        records[version] = record(version, add_version(version), i + 1, at)
    store.write_state(DeviceState(installed_version="1.2.0", versions=records))
    store.set_pointer("previous", "1.0.0")
    store.set_pointer("current", "1.2.0")

    removed = store.collect_garbage(keep=3)

    assert removed == ["1.1.0", "1.3.0"]
    assert store.installed_versions() == ["1.0.0", "1.2.0", "1.4.0"]
    state = store.read_state()
    assert sorted(state.versions) == ["1.0.0", "1.2.0", "1.4.0"]
    assert state.history[-1].action == "gc"
    assert list(store.staging_dir.iterdir()) == []
    assert store.collect_garbage(keep=1) == ["1.4.0"]
    assert store.installed_versions() == ["1.0.0", "1.2.0"]


def test_gc_refuses_keep_zero_and_in_use_versions(store, add_version):
    add_version("1.0.0")
    store.set_pointer("current", "1.0.0")
    with pytest.raises(AgentError, match="at least 1"):
        store.collect_garbage(keep=0)
    with pytest.raises(AgentError, match="in use"):
        store.remove_version("1.0.0")
    assert store.installed_versions() == ["1.0.0"]


def test_second_writer_is_refused_while_the_lock_is_held(store):
    with store.locked(), pytest.raises(AgentError, match="holds the store lock"), store.locked():
        pass
    with store.locked():  # released again
        pass


def test_trusted_keys_are_the_pub_files(store):
    (store.keys_dir / "b.pub").write_text("x")
    (store.keys_dir / "a.pub").write_text("x")
    (store.keys_dir / "notes.txt").write_text("x")
    assert [p.name for p in store.trusted_key_files()] == ["a.pub", "b.pub"]
    assert DeviceStore(store.root / "elsewhere").trusted_key_files() == []


@pytest.mark.parametrize(("content", "expected"), [(None, 1), ("2\n", 2), ("0", None), ("two", None)])
def test_signature_threshold_lives_beside_the_keys(store, content, expected):
    if content is not None:
        (store.keys_dir / "threshold").write_text(content)
    if expected is None:
        with pytest.raises(AgentError, match="whole number of at least 1"):
            store.signature_threshold()
    else:
        assert store.signature_threshold() == expected
