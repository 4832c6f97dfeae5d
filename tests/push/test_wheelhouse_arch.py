"""A wheelhouse per CPU architecture: only wheels built for the device's are ever gathered (by tag,
and by the ELF files inside), ours cross-compiled for it are found, and a platform no wheel can be
had for fails naming the package and the platform. pip sees local folders only (no index)."""

from __future__ import annotations

import pytest

from deployer.config.models import Profile
from deployer.errors import SitsError
from deployer.push import bootstrap, wheelhouse
from deployer.push.facts import DevicePlatform
from deployer.push.wheelhouse import PipTarget, build_wheelhouse, check_wheel
from tests.push.simulator import SimFleet
from tests.push.wheels import fake_wheel

ARM = PipTarget.of(DevicePlatform("3.11", "cpython", "aarch64", "glibc", "2.36"))
X86 = PipTarget.of(DevicePlatform("3.11", "cpython", "x86_64", "glibc", "2.36"))


def test_a_wheel_of_another_architecture_in_find_links_is_never_gathered(links, tmp_path):
    fake_wheel(links, "fastpart", "2.0", "py3-none-linux_x86_64", "x86_64")  # newer, but for x86-64
    fake_wheel(links, "fastpart", "1.0", "py3-none-manylinux_2_17_aarch64", "aarch64")
    house = build_wheelhouse(("fastpart",), ARM, cache=tmp_path, pins={})
    assert [w.path.name for w in house.wheels] == ["fastpart-1.0-py3-none-manylinux_2_17_aarch64.whl"]
    assert build_wheelhouse(("fastpart",), X86, cache=tmp_path, pins={}).pins == ["fastpart==2.0"]


def test_no_wheel_for_the_platform_names_the_package_and_the_platform(links, tmp_path):
    fake_wheel(links, "fastpart", "2.0", "py3-none-linux_x86_64", "x86_64")
    with pytest.raises(SitsError) as caught:
        build_wheelhouse(("fastpart>=1",), ARM, cache=tmp_path, pins={})
    assert "no wheel of fastpart for the device's platform (manylinux_2_36_aarch64, Python 3.11)" in str(
        caught.value
    )
    assert "linux_aarch64" in (caught.value.hint or "") and "find-links" in (caught.value.hint or "")


def test_llama_cpp_python_for_aarch64_is_named_for_a_cross_build_when_a_plan_may_not_compile(links, tmp_path):
    with pytest.raises(SitsError, match=r"no wheel of llama-cpp-python .*aarch64.* yet") as caught:
        build_wheelhouse(("llama-cpp-python",), ARM, cache=tmp_path, pins={}, cross_build=False)
    assert "scripts/llamacpp.sh wheel aarch64" in (caught.value.hint or "")


def test_our_cross_built_wheels_are_found_for_their_architecture_only(links, tmp_path):
    ours = tmp_path / "cache" / "llama-cpp" / "wheels-aarch64"
    ours.mkdir(parents=True)
    built = fake_wheel(ours, "llama_cpp_python", "0.3.36+sits.0", "py3-none-linux_aarch64", "aarch64")
    house = build_wheelhouse(("llama-cpp-python",), ARM, cache=tmp_path, pins={}, cross_build=False)
    assert [w.path.name for w in house.wheels] == [built.name]
    with pytest.raises(SitsError, match="llama-cpp-python"):  # an x86-64 device is not offered it
        build_wheelhouse(("llama-cpp-python",), X86, cache=tmp_path / "x86", pins={}, cross_build=False)


def test_a_mis_tagged_wheel_is_refused_by_the_libraries_it_holds(links, tmp_path):
    lying = fake_wheel(links, "fastpart", "1.0", "py3-none-linux_aarch64", "x86_64")  # x86 code, arm tag
    with pytest.raises(SitsError, match=r"fastpart/lib/libfastpart\.so is built for x86_64, not .* aarch64"):
        check_wheel(lying, ARM)
    with pytest.raises(SitsError, match="built for x86_64"):  # never gathered, so never sent
        build_wheelhouse(("fastpart",), ARM, cache=tmp_path, pins={})
    assert not list((tmp_path / "wheelhouse").glob("*/wheelhouse.json"))
    check_wheel(fake_wheel(tmp_path, "pure", "1.0", "py3-none-any"), ARM)  # no library: any platform
    with pytest.raises(SitsError, match="is for linux_x86_64, not the device's aarch64"):
        check_wheel(fake_wheel(tmp_path, "other", "1.0", "py3-none-linux_x86_64"), ARM)


def test_a_bundle_carries_the_agent_and_its_wheels_for_the_class_without_a_system_torch(
    links, tmp_path, monkeypatch
):
    requires = 'Requires-Dist: fastpart\nProvides-Extra: torch\nRequires-Dist: torch; extra == "torch"\n'
    agent = fake_wheel(tmp_path, "sits_agent", "0.1.0", "py3-none-any", requires=requires)
    monkeypatch.setattr(bootstrap, "build_agent_wheel", lambda project, out: agent)
    fake_wheel(links, "fastpart", "1.0", "py3-none-manylinux_2_17_aarch64", "aarch64")
    fake_wheel(links, "fastpart", "1.0", "py3-none-linux_x86_64", "x86_64")
    arm = DevicePlatform("3.11", "cpython", "aarch64", "glibc", "2.31")
    config = SimFleet(tmp_path, size=1).config
    profiles = {
        "orin": Profile.model_validate({"memory": "8Gi", "torch": "system"}),
        "pi5": Profile.model_validate({"memory": "8Gi"}),
    }
    config = config.model_copy(update={"profiles": profiles})
    wheels = bootstrap.bundle_wheels(config, "orin", arm, tmp_path, tmp_path / "made")
    assert [w.name for w in wheels] == [agent.name, "fastpart-1.0-py3-none-manylinux_2_17_aarch64.whl"]
    with pytest.raises(SitsError, match="no wheel of torch for the device's platform"):  # torch sent
        bootstrap.bundle_wheels(config, "pi5", arm, tmp_path, tmp_path / "made")


def test_a_cross_build_for_a_newer_glibc_than_the_devices_is_refused_naming_both(
    links, tmp_path, monkeypatch
):
    made = tmp_path / "made"
    made.mkdir()
    fake_wheel(made, "llama_cpp_python", "0.3.36+sits.0", "py3-none-manylinux_2_34_aarch64", "aarch64")
    monkeypatch.setattr(wheelhouse, "_cross_build", lambda name, target: made)
    jetpack5 = PipTarget.of(DevicePlatform("3.8", "cpython", "aarch64", "glibc", "2.31"))
    with pytest.raises(
        SitsError, match=r"manylinux_2_34_aarch64\.whl\) needs a newer glibc than the device's "
    ):
        build_wheelhouse(("llama-cpp-python",), jetpack5, cache=tmp_path, pins={})
    house = build_wheelhouse(("llama-cpp-python",), ARM, cache=tmp_path, pins={})  # glibc 2.36: it fits
    assert [w.path.name for w in house.wheels] == [
        "llama_cpp_python-0.3.36+sits.0-py3-none-manylinux_2_34_aarch64.whl"
    ]
