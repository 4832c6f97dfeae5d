"""The agent's distribution, its requirements, a device platform's pip tags, and the wheelhouse cache.

The cache tests point pip at a local folder of wheels only (PIP_NO_INDEX, PIP_FIND_LINKS): no
index is reached. Their seed is our own agent wheelhouse in the shared cache, built (once per
machine, with the controller's pip configuration) by `agent_house`.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.metadata
import platform
import shutil
import subprocess
import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from deployer import __version__
from deployer.errors import SitsError
from deployer.push.bootstrap import build_agent_wheel
from deployer.push.facts import DevicePlatform
from deployer.push.wheelhouse import PipTarget, agent_requirements, build_wheelhouse, controller_pins
from tests.fleet.agent_packages import CONTROLLER_ONLY, canonical

PROJECT = Path(__file__).resolve().parents[2]
HERE = DevicePlatform(
    python=f"{sys.version_info[0]}.{sys.version_info[1]}",
    implementation=sys.implementation.name,
    machine=platform.machine(),
    libc=platform.libc_ver()[0],
    libc_version=platform.libc_ver()[1],
)
# All a device gets of deployer/: the package's version, the errors, core/ and the agent.
AGENT_FILES = ("deployer/__init__.py", "deployer/errors.py", "deployer/core/", "deployer/agent/")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_agent_wheel(PROJECT, tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def controller_wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("controller-wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(PROJECT)],
        check=True,
        capture_output=True,
    )
    return next(out.glob("sits_deployer-*.whl"))


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return HeaderParser().parsestr(zf.read(name).decode())


def _packaged(wheel: Path) -> list[str]:
    """The files `wheel` installs, its .dist-info left out."""
    with zipfile.ZipFile(wheel) as zf:
        return [n for n in zf.namelist() if not n.split("/", 1)[0].endswith(".dist-info")]


def test_the_agent_wheel_holds_the_agent_and_nothing_of_the_controller(wheel):
    files = _packaged(wheel)
    assert {"deployer/__init__.py", "deployer/errors.py", "deployer/agent/cli.py"} <= set(files)
    assert "deployer/agent/engines/torch/cpu_kernels.cpp" in files  # built on the device
    assert [f for f in files if not f.startswith(AGENT_FILES)] == []  # no cli/, push/, _data/, ...
    with zipfile.ZipFile(wheel) as zf:
        entry_points = zf.read(next(n for n in zf.namelist() if n.endswith("entry_points.txt"))).decode()
    assert "sits-agent = deployer.agent.cli:main" in entry_points


def _imports(wheel: Path) -> set[str]:
    """Every module the wheel's Python files import (lazy imports too)."""
    found = set()
    with zipfile.ZipFile(wheel) as zf:
        for name in (n for n in zf.namelist() if n.endswith(".py")):
            for node in ast.walk(ast.parse(zf.read(name), filename=name)):
                if isinstance(node, ast.Import):
                    found |= {alias.name for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    found.add(node.module)
    return found


def test_the_agent_wheel_imports_only_its_own_modules_and_no_controller_package(wheel):
    ours = {m for m in _imports(wheel) if m.split(".")[0] == "deployer"}
    others = {m.split(".")[0] for m in _imports(wheel)} - {"deployer"}
    modules = {
        name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for name in _packaged(wheel)
        if name.endswith(".py")
    }
    assert sorted(ours - modules) == []  # e.g. deployer.config would be missing on a device
    providers = importlib.metadata.packages_distributions()
    assert {"paramiko", "rich", "gguf"} <= providers.keys()  # installed here: the check below can fail
    controller_only = {canonical(p) for p in CONTROLLER_ONLY}
    assert sorted(m for m in others if controller_only & {canonical(d) for d in providers.get(m, ())}) == []


def test_the_controller_wheel_leaves_the_agents_files_to_sits_agent_at_its_own_version(
    wheel, controller_wheel
):
    assert set(_packaged(wheel)).isdisjoint(_packaged(controller_wheel))  # no file installed twice
    assert "deployer/cli/main.py" in _packaged(controller_wheel)
    agent = [
        Requirement(r)
        for r in _metadata(controller_wheel).get_all("Requires-Dist", [])
        if canonicalize_name(Requirement(r).name) == "sits-agent"
    ]
    assert agent and all(str(r.specifier) == f"=={__version__}" for r in agent), agent
    assert _metadata(wheel)["Version"] == __version__


@pytest.mark.parametrize(
    ("engine", "system_torch", "has", "lacks"),
    [
        ("torch", False, {"torch", "tuf", "jinja2", "click"}, {"llama-cpp-python", "paramiko", "rich"}),
        ("llama.cpp", False, {"llama-cpp-python", "tuf"}, {"torch", "paramiko"}),
        ("torch", True, {"tokenizers"}, {"torch", "llama-cpp-python"}),
    ],
)
def test_requirements_come_from_the_wheels_own_metadata(wheel, engine, system_torch, has, lacks):
    names = {
        canonical(Requirement(r).name) for r in agent_requirements(wheel, engine, system_torch=system_torch)
    }
    assert has <= names and not (lacks & names)
    assert not names & {canonical(p) for p in CONTROLLER_ONLY}


def test_an_engine_without_an_extra_is_refused(wheel):
    with pytest.raises(SitsError, match="no extra onnx"):
        agent_requirements(wheel, "onnx")


def test_pip_target_names_every_tag_the_device_accepts():
    target = PipTarget.of(DevicePlatform("3.10", "cpython", "aarch64", "glibc", "2.35"))
    assert target.platforms[0] == "manylinux_2_35_aarch64"
    assert {"manylinux_2_17_aarch64", "manylinux2014_aarch64", "linux_aarch64"} <= set(target.platforms)
    assert (
        "manylinux_2_36_aarch64" not in target.platforms and "manylinux_2_16_aarch64" not in target.platforms
    )
    assert target.python_version == "310" and target.abis == ("cp310", "abi3", "none")
    assert not target.runs_controller_builds()  # another CPU: a wheel built here would not run there
    musl = PipTarget.of(DevicePlatform("3.11", "cpython", "x86_64", "musl", "1.2"))
    assert musl.platforms == ("musllinux_1_2_x86_64", "musllinux_1_1_x86_64", "linux_x86_64")
    assert PipTarget.of(HERE).runs_controller_builds()


@pytest.mark.parametrize(
    ("device", "match"),
    [
        (DevicePlatform("3.10", "pypy", "x86_64", "glibc", "2.36"), "CPython only"),
        (DevicePlatform("3.11", "cpython", "x86_64", "", ""), "no wheel platform tag"),
    ],
)
def test_a_platform_without_tags_is_refused(device, match):
    with pytest.raises(SitsError, match=match):
        PipTarget.of(device)


@pytest.fixture(scope="module")
def agent_house(wheel):
    return build_wheelhouse(agent_requirements(wheel, "torch"), PipTarget.of(HERE))


def _public(version: str) -> str:
    return version.split("+")[0]


def test_the_agent_wheelhouse_holds_the_releases_this_controller_runs(agent_house):
    pins = {canonical(name): version for name, version in (pin.split("==") for pin in agent_house.pins)}
    assert not set(pins) & {canonical(p) for p in CONTROLLER_ONLY}  # what a device gets, bar sits-agent
    # Every wheel, torch and what the agent's dependencies pull in included (anyio through
    # starlette, h11 through uvicorn), is the version installed here.
    assert {"torch", "starlette", "anyio", "uvicorn", "h11", "pydantic-core"} <= set(pins)
    for name, version in pins.items():
        assert _public(version) == _public(importlib.metadata.version(name)), name


def test_controller_pins_follow_installed_metadata_and_skip_what_is_not_installed():
    pins = controller_pins(("uvicorn>=0.30", "no-such-distribution-here>=1"))
    assert pins["uvicorn"] == importlib.metadata.version("uvicorn")
    assert pins["h11"] == importlib.metadata.version("h11")  # uvicorn's own requirement
    assert "no-such-distribution-here" not in pins  # not installed: it follows its range
    assert "+" not in controller_pins(("torch",))["torch"]  # torch's local label (+cpu) dropped


def _fake_wheel(folder: Path, name: str, version: str) -> Path:
    """A wheel that installs nothing, enough for pip to resolve and download it."""
    info = f"{name}-{version}.dist-info"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{info}/RECORD", "")
    return path


def test_pins_hold_the_wheelhouse_to_a_version_when_a_newer_one_is_offered(
    agent_house, tmp_path, monkeypatch
):
    links = tmp_path / "links"
    links.mkdir()
    real = Path(shutil.copy(next(agent_house.folder.glob("click-*.whl")), links))
    _fake_wheel(links, "click", "99.0")
    version = parse_wheel_filename(real.name)[1]
    target = PipTarget.of(HERE)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))  # local wheels only
    held = build_wheelhouse(("click>=8.1",), target, cache=tmp_path, pins={"click": str(version)})
    assert held.pins == [f"click=={version}"]
    assert (held.folder / "constraints.txt").read_text() == f"click=={version}\n"
    free = build_wheelhouse(("click>=8.1",), target, cache=tmp_path, pins={})
    assert free.pins == ["click==99.0"] and free.folder != held.folder
    older = PipTarget.of(dataclasses.replace(HERE, libc_version="2.17"))  # one that may not build here
    with pytest.raises(SitsError, match=r"held to the controller's click==98\.0") as caught:
        build_wheelhouse(("click>=8.1",), older, cache=tmp_path, pins={"click": "98.0"})
    assert "versions this controller runs" in (caught.value.hint or "")


def test_a_second_build_is_served_from_the_cache_and_a_tampered_one_is_rebuilt(
    agent_house, tmp_path, monkeypatch
):
    target = PipTarget.of(HERE)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(agent_house.folder))  # local wheels only
    first = build_wheelhouse(("click>=8.1",), target, cache=tmp_path)
    assert [w.pin.split("==")[0] for w in first.wheels] == ["click"]
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nothing-here"))  # pip would fail now
    again = build_wheelhouse(("click>=8.1",), target, cache=tmp_path)
    assert again == first
    first.wheels[0].path.write_bytes(b"tampered")
    with pytest.raises(SitsError, match="building a wheel of click"):  # rebuilt: pip finds nothing
        build_wheelhouse(("click>=8.1",), target, cache=tmp_path)


def _our_builds_only(agent_house, tmp_path, monkeypatch) -> tuple[Path, Path]:
    """scripts/llamacpp.sh's folder of our own builds, holding a click wheel as a stand-in for its
    llama-cpp-python, in a cache of its own; pip itself is pointed at an empty folder. (our builds
    folder, the click wheel)"""
    ours = tmp_path / "cache" / "llama-cpp" / "wheels"
    ours.mkdir(parents=True)
    click = Path(shutil.copy(next(agent_house.folder.glob("click-*.whl")), ours))
    monkeypatch.setenv("SITS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nothing-here"))
    return ours, click


def test_our_own_builds_are_found_for_a_device_that_runs_them(agent_house, tmp_path, monkeypatch):
    ours, click = _our_builds_only(agent_house, tmp_path, monkeypatch)
    target = PipTarget.of(HERE)
    house = build_wheelhouse(("click>=8.1",), target, cache=tmp_path)
    assert [w.path.name for w in house.wheels] == [click.name]
    (ours / "llama_cpp_python-0.3.36+sits.0-py3-none-linux_x86_64.whl").write_bytes(b"")
    assert build_wheelhouse(("click>=8.1",), target, cache=tmp_path).folder != house.folder  # a new build


def test_our_own_builds_are_not_offered_to_a_device_that_may_not_run_them(agent_house, tmp_path, monkeypatch):
    _our_builds_only(agent_house, tmp_path, monkeypatch)
    older = PipTarget.of(dataclasses.replace(HERE, libc_version="2.17"))  # an older glibc than ours
    assert not older.runs_controller_builds()
    with pytest.raises(
        SitsError, match=r"no wheel of click for the device's platform \(manylinux_2_17_x86_64"
    ):
        build_wheelhouse(("click>=8.1",), older, cache=tmp_path, pins={})
