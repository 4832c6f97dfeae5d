"""The fleet lock and the audit log."""

from __future__ import annotations

import pytest

from deployer.errors import SitsError
from deployer.push.state import FleetLock, append_audit, force_unlock, read_audit, read_lock


def test_second_holder_is_refused_with_the_lock_id(tmp_path):
    with FleetLock(tmp_path, "apply").held() as info:
        with pytest.raises(SitsError) as caught, FleetLock(tmp_path, "rollback").held():
            pass
        assert info.lock_id in caught.value.message
        assert f"--force-unlock {info.lock_id}" in (caught.value.hint or "")
    assert read_lock(tmp_path) is None  # released


def test_force_unlock_needs_the_right_id(tmp_path):
    holder = FleetLock(tmp_path, "apply").held()
    info = holder.__enter__()  # a run that was killed: never exits its block
    with pytest.raises(SitsError, match="does not match"):
        force_unlock(tmp_path, "not-the-id")
    assert read_lock(tmp_path) == info
    assert force_unlock(tmp_path, info.lock_id) == info
    assert read_lock(tmp_path) is None
    with pytest.raises(SitsError, match="not locked"):
        force_unlock(tmp_path, info.lock_id)


def test_audit_log_appends_one_line_per_record(tmp_path):
    append_audit(tmp_path, {"action": "apply", "results": [{"device": "a", "status": "updated"}]})
    first = (tmp_path / "audit.jsonl").read_bytes()
    append_audit(tmp_path, {"action": "rollback", "results": []})
    assert (tmp_path / "audit.jsonl").read_bytes().startswith(first)  # earlier lines untouched
    records = read_audit(tmp_path)
    assert [r["action"] for r in records] == ["apply", "rollback"]
    assert all("at" in r for r in records)
