"""The release commands end to end, as an operator runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from deployer.cli.main import cli
from tests.release.helpers import tree

PASS = {"SITS_SIGNING_PASSPHRASE": "a long test passphrase"}


def _run(*args: str, code: int = 0) -> dict | None:
    result = CliRunner().invoke(cli, list(args), env=PASS, catch_exceptions=False)
    assert result.exit_code == code, result.output + result.stderr
    return json.loads(result.stdout) if "--output" in args and code == 0 else None


@pytest.fixture
def keys(tmp_path) -> tuple[Path, Path]:
    info = _run("keygen", "-o", str(tmp_path / "k1"), "--output", "json")
    assert info is not None and len(info["keyid"]) == 16
    _run("keygen", "-o", str(tmp_path / "k2"))
    return tmp_path / "k1", tmp_path / "k2"


def test_delta_release_sign_verify_apply(fleet, keys, tmp_path):
    k1, k2 = keys
    patch, rel, out = tmp_path / "p.patch", tmp_path / "release.json", tmp_path / "staging"
    made = _run("delta", "--from", str(fleet.v1), "--to", str(fleet.v2), "-o", str(patch), "--output", "json")
    assert made is not None and made["size"] == patch.stat().st_size
    _run(
        "release",
        str(fleet.v2),
        "--counter",
        "3",
        "--base",
        str(fleet.v1),
        "--patch",
        str(patch),
        "--key",
        f"{k1}.key",
        "-o",
        str(rel),
    )
    signed = _run("sign", str(rel), "--key", f"{k2}.key", "--output", "json")
    assert signed is not None and len(signed["signatures"]) == 2
    ok = _run(
        "verify",
        str(rel),
        "--trusted-key",
        f"{k1}.pub",
        "--trusted-key",
        f"{k2}.pub",
        "--threshold",
        "2",
        "--installed",
        str(fleet.v1),
        "--patch",
        str(patch),
        "--artifact",
        str(fleet.v2),
        "--output",
        "json",
    )
    assert ok is not None and ok["ok"] and ok["counter"] == 3
    applied = _run(
        "patch-apply",
        "--base",
        str(fleet.v1),
        "--patch",
        str(patch),
        "-o",
        str(out),
        "--manifest",
        str(rel),
        "--trusted-key",
        f"{k1}.pub",
        "--installed-counter",
        "2",
        "--output",
        "json",
    )
    assert applied is not None and applied["verified_release"]
    assert tree(out) == tree(fleet.v2)


def test_verify_refuses_replay_and_untrusted_keys(fleet, keys, tmp_path):
    k1, k2 = keys
    rel = tmp_path / "release.json"
    _run("release", str(fleet.v2), "--counter", "3", "--key", f"{k1}.key", "-o", str(rel))
    result = CliRunner().invoke(
        cli, ["verify", str(rel), "--trusted-key", f"{k1}.pub", "--installed-counter", "3"]
    )
    assert result.exit_code == 1
    assert "not above the installed 3" in result.stderr
    result = CliRunner().invoke(cli, ["verify", str(rel), "--trusted-key", f"{k2}.pub"])
    assert result.exit_code == 1
    assert "unknown key id" in result.stderr


def test_patch_apply_failure_leaves_staging_empty(fleet, keys, tmp_path):
    k1, _ = keys
    rel, out = tmp_path / "release.json", tmp_path / "staging"
    _run(
        "release",
        str(fleet.v2),
        "--counter",
        "3",
        "--base",
        str(fleet.v1),
        "--patch",
        str(fleet.patch),
        "--key",
        f"{k1}.key",
        "-o",
        str(rel),
    )
    result = CliRunner().invoke(
        cli,
        [
            "patch-apply",
            "--base",
            str(fleet.v2),
            "--patch",
            str(fleet.patch),
            "-o",
            str(out),
            "--manifest",
            str(rel),
            "--trusted-key",
            f"{k1}.pub",
        ],
    )
    assert result.exit_code == 1
    assert "the patch is for base 1.0.0" in result.stderr
    assert not out.exists() or not any(out.iterdir())


def test_keygen_without_passphrase_or_flag_fails(tmp_path):
    result = CliRunner().invoke(
        cli, ["keygen", "-o", str(tmp_path / "k")], env={"SITS_SIGNING_PASSPHRASE": None}
    )
    assert result.exit_code == 1
    assert "no passphrase" in result.stderr
    assert not (tmp_path / "k.key").exists()
    _run("keygen", "-o", str(tmp_path / "u"), "--unencrypted")
    assert b"ENCRYPTED" not in (tmp_path / "u.key").read_bytes()


def test_secrets_are_never_printed(tmp_path):
    result = CliRunner().invoke(cli, ["keygen", "-o", str(tmp_path / "k")], env=PASS)
    key = (tmp_path / "k.key").read_text()
    assert PASS["SITS_SIGNING_PASSPHRASE"] not in result.output + result.stderr
    assert key.splitlines()[1] not in result.output + result.stderr
