"""The local transport (a device under a root prefix) and the shared put/get logic it exercises."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deployer.core.hashing import sha256_file
from deployer.errors import TransportError, UnsafePathError
from deployer.transport.local import LocalTransport

STAGED = "/var/lib/sits/staging/model.bin"


@pytest.fixture
def device(tmp_path: Path) -> LocalTransport:
    (tmp_path / "device").mkdir()
    return LocalTransport(tmp_path / "device", label="demo1")


@pytest.fixture
def blob(tmp_path: Path) -> Path:
    path = tmp_path / "model.bin"
    path.write_bytes(os.urandom(2 * 1024 * 1024 + 123))
    return path


def test_run_executes_in_the_root_with_sits_root_set(device):
    result = device.run('pwd; printf "%s" "$SITS_ROOT"; echo warn >&2; exit 5')
    assert result.rc == 5
    assert result.stdout == f"{device.root}\n{device.root}"
    assert result.stderr == "warn\n"


def test_stream_passes_output_on_as_it_comes_and_returns_the_exit_status(device):
    seen: list[str] = []
    # The second line is written only once the first has arrived here: a buffered copy would hang.
    fifo = device.root / "go"
    os.mkfifo(fifo)

    def write(text: str) -> None:
        seen.append(text)
        if text == "first\n":
            fifo.write_text("x\n")

    rc = device.stream('echo first; read _ < go; echo "$SITS_ROOT" >&2; exit 4', write)
    assert (rc, seen) == (4, ["first\n", f"{device.root}\n"])


def test_run_quotes_an_argv(device):
    assert device.run(["printf", "%s|", "a b", "$HOME"]).stdout == "a b|$HOME|"


def test_run_past_its_timeout_raises(device):
    with pytest.raises(TransportError, match=r"did not finish within 0\.2 s"):
        device.run("sleep 10", timeout=0.2)


def test_check_names_the_failed_step(device):
    with pytest.raises(TransportError, match="install failed with exit code 2: boom"):
        device.run("echo boom >&2; exit 2").check("install")


def test_put_lands_under_the_root_verified_and_without_a_part_file(device, blob):
    result = device.put(blob, STAGED)
    landed = device.root / STAGED.lstrip("/")
    assert landed.read_bytes() == blob.read_bytes()
    assert result.sha256 == sha256_file(blob)
    assert (result.bytes_sent, result.resumed_from, result.unchanged) == (blob.stat().st_size, 0, False)
    assert not landed.with_name("model.bin.part").exists()


def test_put_resumes_from_a_matching_partial_file(device, blob):
    part = device.root / (STAGED.lstrip("/") + ".part")
    part.parent.mkdir(parents=True)
    part.write_bytes(blob.read_bytes()[:1_000_000])
    seen: list[tuple[int, int]] = []

    result = device.put(blob, STAGED, progress=lambda done, total: seen.append((done, total)))

    size = blob.stat().st_size
    assert (result.resumed_from, result.bytes_sent) == (1_000_000, size - 1_000_000)
    assert (device.root / STAGED.lstrip("/")).read_bytes() == blob.read_bytes()
    assert seen[-1] == (size, size) and seen[0][0] > 1_000_000


@pytest.mark.parametrize(
    "partial",
    [b"\0" * 1000, os.urandom(3 * 1024 * 1024)],
    ids=["foreign-prefix", "longer-than-the-file"],
)
def test_put_starts_over_when_the_partial_file_is_not_our_prefix(device, blob, partial):
    part = device.root / (STAGED.lstrip("/") + ".part")
    part.parent.mkdir(parents=True)
    part.write_bytes(partial)
    result = device.put(blob, STAGED)
    assert (result.resumed_from, result.bytes_sent) == (0, blob.stat().st_size)
    assert sha256_file(device.root / STAGED.lstrip("/")) == result.sha256


def test_put_without_resume_ignores_a_matching_partial(device, blob):
    part = device.root / (STAGED.lstrip("/") + ".part")
    part.parent.mkdir(parents=True)
    part.write_bytes(blob.read_bytes()[:1000])
    assert device.put(blob, STAGED, resume=False).resumed_from == 0


def test_put_of_content_already_there_sends_nothing(device, blob):
    device.put(blob, STAGED)
    again = device.put(blob, STAGED)
    assert again.unchanged and again.bytes_sent == 0


def test_put_replaces_different_content(device, blob, tmp_path):
    device.put(blob, STAGED)
    other = tmp_path / "other.bin"
    other.write_bytes(b"v2")
    assert not device.put(other, STAGED).unchanged
    assert (device.root / STAGED.lstrip("/")).read_bytes() == b"v2"


def test_get_round_trip(device, blob, tmp_path):
    device.put(blob, STAGED)
    digest = device.get(STAGED, tmp_path / "out" / "copy.bin")
    assert digest == sha256_file(blob)
    assert (tmp_path / "out" / "copy.bin").read_bytes() == blob.read_bytes()
    assert not (tmp_path / "out" / "copy.bin.part").exists()


def test_get_of_a_missing_file_names_it(device, tmp_path):
    with pytest.raises(TransportError, match="/etc/sits/nope does not exist on the device"):
        device.get("/etc/sits/nope", tmp_path / "x")


@pytest.mark.parametrize("path", ["../escape", "/var/../../etc/passwd", "relative/path"])
def test_paths_outside_the_device_root_are_refused(device, path):
    with pytest.raises(UnsafePathError):
        device.path(path)


def test_a_file_where_a_directory_is_needed_is_a_transport_error(device, blob):
    (device.root / "var").write_text("not a directory")
    with pytest.raises(TransportError, match="demo1"):
        device.put(blob, STAGED)
