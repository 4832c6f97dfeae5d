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

pip runs with the controller's own configuration (its find-links, indexes and cache), so a wheel
that pip finds on the controller's disk is found for the wheelhouse too. A requirement that exists
only as a source distribution (llama-cpp-python compiles llama.cpp) is built into a wheel on the
controller with `pip wheel`, which is only right when the device can run what the controller builds:
same CPU architecture, Python and libc family, a libc no older. For any other device, a wheel built
for it must lie in one of pip's find-links directories. For a device that runs the controller's
builds pip also looks in <cache>/llama-cpp/wheels, where scripts/llamacpp.sh leaves the
llama-cpp-python it built with our patches to llama.cpp (the one the controller runs; its local
version label outranks PyPI's).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
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
    "MANIFEST",
    "PipTarget",
    "Wheel",
    "Wheelhouse",
    "agent_requirements",
    "build_wheelhouse",
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
_lock = threading.Lock()  # devices of one rollout share a wheelhouse: build it once


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
) -> Wheelhouse:
    """The wheelhouse for `requirements` on `target`: from the cache, else made with pip and cached.

    Every distribution in `pins` (name -> version; by default controller_pins(requirements)) comes
    at that version, so a device runs the releases its controller runs, whenever and wherever the
    wheelhouse is built; the others take the newest release in range. A cached wheelhouse is used
    only when every wheel still has the hash its manifest recorded.
    Raises SitsError when pip cannot find or build a wheel for the target.
    """
    root = (cache or cache_root()) / "wheelhouse"
    ours = _our_builds(target)
    constraints = sorted(
        f"{name}=={version}"
        for name, version in (controller_pins(requirements) if pins is None else pins).items()
    )
    spec = {"requirements": sorted(requirements), "pins": constraints, "target": asdict(target), "v": 1}
    if ours is not None:  # a new build of ours makes a new wheelhouse
        spec["ours"] = sorted(wheel.name for wheel in ours.glob("*.whl"))
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:32]
    folder = root / key
    with _lock:
        cached = _load(folder)
        if cached is not None:
            return cached
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{key}.building-", dir=root))
        try:
            _download(requirements, constraints, target, staging, ours)
            hashes = {p.name: sha256_file(p) for p in sorted(staging.glob("*.whl"))}
            manifest = {**spec, "wheels": hashes}
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
            shutil.rmtree(folder, ignore_errors=True)  # a stale or tampered one
            staging.replace(folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        loaded = _load(folder)
        assert loaded is not None  # just written
        return loaded


def _load(folder: Path) -> Wheelhouse | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    wheels = tuple(Wheel(folder / name, digest) for name, digest in sorted(manifest["wheels"].items()))
    for wheel in wheels:
        if not wheel.path.is_file() or sha256_file(wheel.path) != wheel.sha256:
            return None
    return Wheelhouse(folder, tuple(manifest["requirements"]), wheels)


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=PIP_TIMEOUT_S)


def _our_builds(target: PipTarget) -> Path | None:
    """The folder of our own builds (scripts/llamacpp.sh's llama-cpp-python), when there is one and
    `target` runs what this controller builds."""
    ours = cache_root() / "llama-cpp" / "wheels"
    return ours if ours.is_dir() and target.runs_controller_builds() else None


def _pins_named(stderr: str, constraints: list[str]) -> str:
    """`; held to the controller's X==1.0, ...` for the pinned distributions pip's error names (its
    errors say which requirement failed, not which pin held it)."""
    named = {canonicalize_name(word) for word in re.findall(r"[A-Za-z0-9][A-Za-z0-9._-]*", stderr)}
    held = [pin for pin in constraints if canonicalize_name(pin.split("==")[0]) in named]
    return f"; held to the controller's {', '.join(held)}" if held else ""


def _download(
    requirements: tuple[str, ...], constraints: list[str], target: PipTarget, dest: Path, ours: Path | None
) -> None:
    """pip download every wheel into `dest`, held to `constraints` and looking in `ours` too; a
    source-only requirement is built here when it may be."""
    built = dest / "built"
    pinned = dest / "constraints.txt"  # stays in the wheelhouse: what it was held to
    pinned.write_text("".join(f"{line}\n" for line in constraints))
    links = [] if ours is None else [f"--find-links={ours}"]
    for _ in range(len(requirements) + 1):  # each round builds one more source-only requirement
        done = _pip("download", "--progress-bar=off", "--only-binary=:all:", "--dest", str(dest),
                    f"--constraint={pinned}", *links, *target.pip_args(), *requirements)  # fmt: skip
        if done.returncode == 0:
            break
        match = _NO_MATCH.search(done.stderr + done.stdout)
        lacking = None if match is None else match[1] or match[2]
        if lacking is None or not target.runs_controller_builds():
            raise SitsError(
                f"pip download of the agent's wheels for {target.platforms[0]} "
                f"(Python {target.python_version}) failed: {done.stderr.strip()[-600:]}"
                + _pins_named(done.stderr, constraints),
                hint="the device gets the versions this controller runs (`pip freeze` lists them): put "
                "wheels of those built for that device into a pip find-links directory (pip config "
                "set global.find-links DIR), or install other versions on the controller, and retry",
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
