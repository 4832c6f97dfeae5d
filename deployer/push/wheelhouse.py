"""The agent's wheels for one device platform, gathered on the controller so devices need no index.

    agent_requirements  what a device installs besides the agent's own wheel (sits-agent, built
                        from agent/pyproject.toml): that wheel's requirements, read from its own
                        metadata, plus the extra of the device's engine (`torch` or `llamacpp`);
                        torch left out when the device brings its own
    PipTarget           a device platform (DevicePlatform, from the facts) as pip's --platform,
                        --python-version, --implementation and --abi options
    controller_pins     the version this controller runs of each distribution those requirements
                        can pull in: the device gets the same releases, as a lock file would give it
    build_wheelhouse    `pip download --only-binary=:all:` of those requirements for that target,
                        held to the controller's pins, cached under <cache>/wheelhouse/<key>: a
                        second run of the same requirements, pins and target is served from there
                        without pip (and without network)

    check_wheel         a wheel fits the target, or SitsError: its platform tag, and every ELF file in
                        it built for the target's CPU (a wheel of the wrong architecture is never sent)

pip runs with the controller's own configuration (its find-links, indexes and cache), so a wheel
that pip finds on the controller's disk is found for the wheelhouse too. A requirement that exists
only as a source distribution (llama-cpp-python compiles llama.cpp) is built into a wheel on the
controller with `pip wheel`, which is only right when the device can run what the controller builds:
same CPU architecture, Python and libc family, a libc no older. For a device that runs the
controller's builds pip also looks in <cache>/llama-cpp/wheels, where scripts/llamacpp.sh leaves the
llama-cpp-python it built with our patches to llama.cpp (the one the controller runs; its local
version label outranks PyPI's). For an aarch64 device, llama-cpp-python is cross-compiled here by
`scripts/llamacpp.sh wheel aarch64` into <cache>/llama-cpp/wheels-aarch64 (`cross_build=True`; a
plan only names it), so the user places nothing by hand. For any other device, a wheel built for it
must lie in one of pip's find-links directories.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from dataclasses import asdict, dataclass
from email.parser import HeaderParser
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from deployer.build.demo_model import cache_root
from deployer.core.hashing import sha256_file
from deployer.errors import SitsError
from deployer.push.facts import DevicePlatform

__all__ = [
    "CROSS_BUILDS",
    "MANIFEST",
    "CrossBuildPending",
    "PipTarget",
    "Wheel",
    "Wheelhouse",
    "agent_requirements",
    "build_wheelhouse",
    "check_wheel",
    "controller_pins",
    "engine_extra",
]

MANIFEST = "wheelhouse.json"  # written last: a folder without it is not a wheelhouse
PIP_TIMEOUT_S = 1800
_OLDEST_GLIBC_MINOR = 17  # manylinux2014, the oldest tag PyPI still takes
_LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
# What pip names when no wheel fits: a requirement alone, or one held by a constraint (then pip
# reports a conflict and lists the distribution on stdout, which --quiet would drop).
_NO_MATCH = re.compile(
    r"No matching distribution found for (\S+)"
    r"|no matching distributions available for your environment:\s+(\S+)"
)
_log = logging.getLogger("sits.deployer")
_lock = threading.Lock()  # devices of one rollout share a wheelhouse: build it once
# Source-only requirements scripts/llamacpp.sh cross-compiles, and for which architectures.
CROSS_BUILDS = {"llama-cpp-python": frozenset({"aarch64"})}
CROSS_BUILD_TIMEOUT_S = 3600
# ELF e_machine of each architecture platform.machine() names (what a wheel's libraries must be).
_ELF_MACHINE = {"x86_64": 62, "aarch64": 183, "armv7l": 40, "i686": 3, "riscv64": 243, "ppc64le": 21}
# The shared libraries check_wheel reads the ELF header of: what the device's loader maps (reading
# every member's head instead took 1.5 s for torch's wheel, at each cached wheelhouse's load).
_LIBRARY = re.compile(r"\.so(\.\d+)*$")


class CrossBuildPending(SitsError):
    """A source-only requirement must be cross-compiled for the target first (build_wheelhouse with
    cross_build=False): a plan names it, apply compiles it."""

    def __init__(self, name: str, target: PipTarget) -> None:
        super().__init__(
            f"no wheel of {name} for the device's platform ({target.describe()}) yet",
            hint="apply cross-compiles it (10-20 minutes, once), or run "
            f"`scripts/llamacpp.sh wheel {target.arch}` now",
        )
        self.name, self.arch = name, target.arch


def engine_extra(engine: str) -> str:
    """sits-agent's extra that carries an engine: `torch`, `llamacpp`."""
    return re.sub(r"[^a-z0-9]", "", engine.lower())


def agent_requirements(wheel: Path, engine: str, *, system_torch: bool = False) -> tuple[str, ...]:
    """The requirements of the agent's `wheel` (sits-agent) and of its engine's extra, read from the
    wheel's METADATA.

    Read from the wheel that is sent, not from the controller's installed metadata, so the device
    gets what that very wheel declares. `system_torch` leaves torch out (the device has its own).
    Raises SitsError when the wheel declares no such extra.
    """
    extra = engine_extra(engine)
    with zipfile.ZipFile(wheel) as zf:
        name = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA")), None)
        if name is None:
            raise SitsError(f"{wheel} has no .dist-info/METADATA", hint="rebuild the wheel with `pip wheel`")
        metadata = HeaderParser().parsestr(zf.read(name).decode("utf-8"))
    if extra not in metadata.get_all("Provides-Extra", []):
        raise SitsError(
            f"{wheel.name} declares no extra {extra}",
            hint="agent.engine names an engine agent/pyproject.toml has no extra for",
        )
    found = []
    for line in metadata.get_all("Requires-Dist", []):
        try:
            req = Requirement(line)
        except InvalidRequirement as exc:
            raise SitsError(f"{wheel.name}: bad Requires-Dist {line!r}: {exc}") from exc
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        if system_torch and canonicalize_name(req.name) == "torch":
            continue
        req.marker = None
        found.append(str(req))
    return tuple(sorted(set(found)))


def controller_pins(requirements: tuple[str, ...]) -> dict[str, str]:
    """The public version (no local label: torch's `+cpu` build pins `torch==2.13.0` for a device
    whose index names it otherwise) that this controller has installed of each distribution
    `requirements` can pull in, by canonical name.

    Found through the installed distributions' own requirements, with their extras; platform
    markers are not evaluated (the device's platform is not this one), so the set may hold more
    than the device installs, which is harmless in constraints. A distribution the controller lacks
    (one installed without the agent's extras) is not pinned and follows the requirement's range.
    """
    pins: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if (name, frozenset(req.extras)) in seen:
            continue
        seen.add((name, frozenset(req.extras)))
        try:
            dist = importlib.metadata.distribution(name)
            pins[name] = Version(dist.version).public
        except (importlib.metadata.PackageNotFoundError, InvalidVersion):
            continue
        for line in dist.requires or ():
            try:
                dep = Requirement(line)
            except InvalidRequirement:
                continue  # that distribution's own metadata is broken; its other requirements still count
            if _pulled_in(dep, req.extras):
                todo.append(dep)
    return pins


def _pulled_in(dep: Requirement, extras: set[str]) -> bool:
    """Whether `dep` comes with its distribution installed with `extras`: a requirement of an extra
    only for those extras; one with platform markers always (they are the device's to decide)."""
    if dep.marker is None or "extra" not in str(dep.marker):
        return True
    return any(dep.marker.evaluate({"extra": extra}) for extra in extras)


@dataclass(frozen=True)
class PipTarget:
    """What pip needs to pick wheels for a device it does not run on."""

    platforms: tuple[str, ...]  # every platform tag the device accepts, best first
    python_version: str  # "311"
    implementation: str  # "cp"
    abis: tuple[str, ...]

    @classmethod
    def of(cls, device: DevicePlatform) -> PipTarget:
        """The target of a device platform. Raises SitsError for one we cannot name tags for."""
        if device.implementation != "cpython":
            raise SitsError(
                f"the device runs {device.implementation}: device wheelhouses are built for CPython only",
                hint="give the device a CPython interpreter (its `python` in the inventory)",
            )
        arch, version = device.machine, device.libc_version
        match = re.fullmatch(r"(\d+)\.(\d+)", version)
        if device.libc not in ("glibc", "musl") or not match:
            raise SitsError(
                f"the device's libc ({device.libc or 'unknown'} {version}) has no wheel platform tag",
                hint="devices need glibc or musl; Python's platform.libc_ver() reports nothing here",
            )
        major, minor = int(match[1]), int(match[2])
        if device.libc == "glibc":
            tags = []
            for m in range(minor, _OLDEST_GLIBC_MINOR - 1, -1):
                tags.append(f"manylinux_{major}_{m}_{arch}")
                if m in _LEGACY_MANYLINUX:
                    tags.append(f"{_LEGACY_MANYLINUX[m]}_{arch}")
        else:
            tags = [f"musllinux_{major}_{m}_{arch}" for m in range(minor, 0, -1)]
        nodot = device.python.replace(".", "")
        return cls(
            platforms=(*tags, f"linux_{arch}"),
            python_version=nodot,
            implementation="cp",
            abis=(f"cp{nodot}", "abi3", "none"),
        )

    def pip_args(self) -> list[str]:
        """pip download's options for this target."""
        args = [f"--platform={tag}" for tag in self.platforms]
        args += [f"--python-version={self.python_version}", f"--implementation={self.implementation}"]
        return args + [f"--abi={abi}" for abi in self.abis]

    @property
    def arch(self) -> str:
        """The device's CPU architecture, as platform.machine() names it."""
        return self.platforms[-1].removeprefix("linux_")

    def describe(self) -> str:
        """`manylinux_2_36_aarch64, Python 3.11`: the target in messages."""
        return f"{self.platforms[0]}, Python {self.python_version[0]}.{self.python_version[1:]}"

    def runs_controller_builds(self) -> bool:
        """Whether a wheel that pip builds here runs on the device (same arch, Python, libc, no older)."""
        libc, version = platform.libc_ver()
        here = PipTarget.of(
            DevicePlatform(
                python=f"{sys.version_info[0]}.{sys.version_info[1]}",
                implementation=sys.implementation.name,
                machine=platform.machine(),
                libc=libc,
                libc_version=version,
            )
        )
        return (
            here.python_version == self.python_version
            and here.platforms[-1] == self.platforms[-1]  # linux_<arch>
            and here.platforms[0] in self.platforms  # the device's libc is no older
        )


@dataclass(frozen=True)
class Wheel:
    """One wheel of a wheelhouse."""

    path: Path
    sha256: str

    @property
    def pin(self) -> str:
        """`name==version` of the distribution this wheel installs."""
        name, version, _, _ = parse_wheel_filename(self.path.name)
        return f"{name}=={version}"


@dataclass(frozen=True)
class Wheelhouse:
    """A folder of wheels that together install `requirements` on one target, with no index."""

    folder: Path
    requirements: tuple[str, ...]
    wheels: tuple[Wheel, ...]

    @property
    def pins(self) -> list[str]:
        """Every wheel's `name==version`: installing these makes the device match the wheelhouse."""
        return sorted(w.pin for w in self.wheels)


def build_wheelhouse(
    requirements: tuple[str, ...],
    target: PipTarget,
    *,
    cache: Path | None = None,
    pins: dict[str, str] | None = None,
    cross_build: bool = True,
) -> Wheelhouse:
    """The wheelhouse for `requirements` on `target`: from the cache, else made with pip and cached.

    Every distribution in `pins` (name -> version; by default controller_pins(requirements)) comes
    at that version, so a device runs the releases its controller runs, whenever and wherever the
    wheelhouse is built; the others take the newest release in range. A cached wheelhouse is used
    only when every wheel still has the hash its manifest recorded and fits the target (check_wheel).
    A source-only requirement of CROSS_BUILDS is cross-compiled for the target when `cross_build`
    (minutes, once), else CrossBuildPending names it and how to build it.
    Raises SitsError when pip cannot find or build a wheel for the target.
    """
    root = (cache or cache_root()) / "wheelhouse"
    ours = _our_builds(target)
    constraints = sorted(
        f"{name}=={version}"
        for name, version in (controller_pins(requirements) if pins is None else pins).items()
    )
    spec = {"requirements": sorted(requirements), "pins": constraints, "target": asdict(target), "v": 1}
    if ours:  # a new build of ours makes a new wheelhouse
        spec["ours"] = sorted(wheel.name for folder in ours for wheel in folder.glob("*.whl"))
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:32]
    folder = root / key
    with _lock:
        cached = _load(folder, target)
        if cached is not None:
            return cached
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{key}.building-", dir=root))
        try:
            _download(requirements, constraints, target, staging, ours, cross_build=cross_build)
            for wheel in sorted(staging.glob("*.whl")):
                check_wheel(wheel, target)
            hashes = {p.name: sha256_file(p) for p in sorted(staging.glob("*.whl"))}
            manifest = {**spec, "wheels": hashes}
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
            shutil.rmtree(folder, ignore_errors=True)  # a stale or tampered one
            staging.replace(folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        loaded = _load(folder, target)
        assert loaded is not None  # just written
        return loaded


def check_wheel(wheel: Path, target: PipTarget) -> None:
    """Raise SitsError unless `wheel` runs on `target`: a platform tag the device accepts (or `any`)
    and, in every shared library it holds, the device's CPU. The tag alone is a name anyone can write
    (a mis-tagged build, a renamed file); the ELF header is what the device's loader reads."""
    if not _tag_fits(wheel, target):
        shown = sorted({tag.platform for tag in parse_wheel_filename(wheel.name)[3]})
        raise SitsError(
            f"{wheel.name} is for {', '.join(shown)}, not the device's {target.arch} ({target.describe()})",
            hint=f"remove it from the find-links folder it came from; a wheel for {target.arch} is needed",
        )
    machine = _ELF_MACHINE.get(target.arch)
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.infolist():
            if not _LIBRARY.search(member.filename):
                continue
            with zf.open(member) as f:
                head = f.read(20)
            if head[:4] != b"\x7fELF" or len(head) < 20:
                continue
            found = int.from_bytes(head[18:20], "little" if head[5] == 1 else "big")
            if found != machine:
                named = {v: k for k, v in _ELF_MACHINE.items()}.get(found, f"ELF machine {found}")
                raise SitsError(
                    f"{wheel.name}: {member.filename} is built for {named}, not the device's {target.arch}",
                    hint="the wheel is mis-tagged: rebuild it for the device "
                    f"(scripts/llamacpp.sh wheel {target.arch} for llama-cpp-python) and remove this one",
                )


def _tag_fits(wheel: Path, target: PipTarget) -> bool:
    """Whether the wheel's platform tag is one the target accepts (or `any`)."""
    return any(tag.platform in {*target.platforms, "any"} for tag in parse_wheel_filename(wheel.name)[3])


def _load(folder: Path, target: PipTarget) -> Wheelhouse | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    wheels = tuple(Wheel(folder / name, digest) for name, digest in sorted(manifest["wheels"].items()))
    for wheel in wheels:
        if not wheel.path.is_file() or sha256_file(wheel.path) != wheel.sha256:
            return None
        check_wheel(wheel.path, target)
    return Wheelhouse(folder, tuple(manifest["requirements"]), wheels)


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=PIP_TIMEOUT_S)


def _our_builds(target: PipTarget) -> list[Path]:
    """The folders of our own builds (scripts/llamacpp.sh's llama-cpp-python) for `target`: those
    cross-compiled for its architecture, and this controller's own when the target runs them."""
    root = cache_root() / "llama-cpp"
    folders = [root / f"wheels-{target.arch}"]
    if target.runs_controller_builds():
        folders.append(root / "wheels")
    return [folder for folder in folders if folder.is_dir()]


def _cross_build(name: str, target: PipTarget) -> Path:
    """Cross-compile source-only `name` for `target` with scripts/llamacpp.sh; the folder it left
    the wheel in. Raises SitsError when it cannot."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "llamacpp.sh"
    if not script.is_file():
        raise SitsError(
            f"no wheel of {name} for {target.describe()}, and {script} (which cross-compiles it) is missing",
            hint="run sits-deployer from its source tree, or put a wheel built for the device into a "
            "pip find-links directory",
        )
    _log.warning(
        "cross-compiling %s for %s devices (10-20 minutes, once; cached in %s)",
        name,
        target.arch,
        cache_root() / "llama-cpp",
    )
    env = {**os.environ, "SITS_VENV": str(Path(sys.executable).parents[1])}
    done = subprocess.run(
        [str(script), "wheel", target.arch],
        capture_output=True,
        text=True,
        env=env,
        timeout=CROSS_BUILD_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise SitsError(
            f"cross-compiling {name} for {target.arch} failed: {done.stderr.strip()[-600:]}",
            hint=f"run `scripts/llamacpp.sh wheel {target.arch}` to see why",
        )
    return Path(done.stdout.strip()).parent


def _pins_named(stderr: str, constraints: list[str]) -> str:
    """`; held to the controller's X==1.0, ...` for the pinned distributions pip's error names (its
    errors say which requirement failed, not which pin held it)."""
    named = {canonicalize_name(word) for word in re.findall(r"[A-Za-z0-9][A-Za-z0-9._-]*", stderr)}
    held = [pin for pin in constraints if canonicalize_name(pin.split("==")[0]) in named]
    return f"; held to the controller's {', '.join(held)}" if held else ""


def _download(
    requirements: tuple[str, ...],
    constraints: list[str],
    target: PipTarget,
    dest: Path,
    ours: list[Path],
    *,
    cross_build: bool,
) -> None:
    """pip download every wheel into `dest`, held to `constraints` and looking in `ours` too; a
    source-only requirement is built here (or cross-compiled) when it may be."""
    built = dest / "built"
    pinned = dest / "constraints.txt"  # stays in the wheelhouse: what it was held to
    pinned.write_text("".join(f"{line}\n" for line in constraints))
    links = [f"--find-links={folder}" for folder in ours]
    for _ in range(len(requirements) + 1):  # each round builds one more source-only requirement
        done = _pip("download", "--progress-bar=off", "--only-binary=:all:", "--dest", str(dest),
                    f"--constraint={pinned}", *links, *target.pip_args(), *requirements)  # fmt: skip
        if done.returncode == 0:
            break
        match = _NO_MATCH.search(done.stderr + done.stdout)
        if match is None:
            raise SitsError(
                f"pip download of the agent's wheels for {target.describe()} failed: "
                f"{done.stderr.strip()[-600:]}" + _pins_named(done.stderr, constraints),
                hint="check pip's sources on the controller (`pip config list`: its indexes and "
                "find-links); the device gets the versions this controller runs (`pip freeze`)",
            )
        lacking = match[1] or match[2]
        name = canonicalize_name(Requirement(lacking).name)
        if target.arch in CROSS_BUILDS.get(name, frozenset()) and not target.runs_controller_builds():
            if not cross_build:
                raise CrossBuildPending(name, target)
            folder = _cross_build(name, target)
            cross = sorted(folder.glob("*.whl"))
            if not any(_tag_fits(wheel, target) for wheel in cross):
                # Tagged by the newest glibc its libraries need (scripts/llamacpp.sh): not this one.
                raise SitsError(
                    f"{name} cross-compiled here ({', '.join(w.name for w in cross)}) needs a newer "
                    f"glibc than the device's ({target.describe()})",
                    hint=f"build {name} on a device of that class (pip wheel --no-deps {lacking}) and "
                    "put the wheel into a pip find-links directory (pip config set global.find-links DIR)",
                )
            links.append(f"--find-links={folder}")
            continue
        if not target.runs_controller_builds():
            held = _pins_named(done.stderr, constraints)
            raise SitsError(
                f"no wheel of {name} for the device's platform ({target.describe()}), and it cannot "
                f"be built here for {target.arch}" + held,
                hint=f"put a wheel of {lacking} built for {target.platforms[-1]} into a pip find-links "
                "directory (pip config set global.find-links DIR)"
                + (
                    ", or install other versions on the controller (the device gets the versions "
                    "this controller runs: `pip freeze` lists them)"
                    if held
                    else ""
                )
                + ", and retry",
            )
        made = _pip(
            "wheel", "--quiet", "--no-deps", f"--constraint={pinned}", "--wheel-dir", str(built), lacking
        )
        if made.returncode != 0:
            raise SitsError(
                f"building a wheel of {lacking} (no binary wheel on the index) failed: "
                f"{made.stderr.strip()[-600:]}" + _pins_named(made.stderr + made.stdout, constraints),
                hint=f"run `pip wheel --no-deps '{lacking}'` to see why",
            )
        links.append(f"--find-links={built}")
    else:
        raise SitsError(f"pip download for {target.platforms[0]} kept failing after building wheels")
    for wheel in built.glob("*.whl") if built.is_dir() else ():
        wheel.replace(dest / wheel.name)  # pip download copied it already; keep one copy
    shutil.rmtree(built, ignore_errors=True)
