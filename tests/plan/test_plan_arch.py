"""The planner and each device's CPU architecture: shown in the plan, a re-imaged device
bootstrapped anew, the wheels a bootstrap sends named, and what a device cannot run refused."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deployer.push.plan import (
    DesiredState,
    DeviceFacts,
    DevicePlatform,
    DeviceStatus,
    StepKind,
    SystemTorch,
    plan_device,
)

ARM = DevicePlatform("3.11", "cpython", "aarch64", "glibc", "2.36")
DESIRED = DesiredState(
    version="1.1.0", artifact_sha256="new", artifact_bytes=1000, agent_version="0.1.0", unit_hashes={}
)
RUNNING = DeviceFacts(
    name="orin",
    reachable=True,
    agent_version="0.1.0",
    model_version="1.1.0",
    model_sha256="new",
    free_disk_bytes=10_000,
    ready=True,
    platform=ARM,
    wheels_arch="aarch64",
)


def test_the_plan_carries_each_devices_architecture():
    plan = plan_device(DESIRED, RUNNING)
    assert plan.status is DeviceStatus.UNCHANGED and plan.arch == "aarch64"
    assert plan_device(DESIRED, replace(RUNNING, platform=None)).arch is None  # an older probe


def test_a_device_reimaged_to_another_architecture_gets_the_agent_anew():
    facts = replace(RUNNING, wheels_arch="x86_64")  # its record says x86_64, its python aarch64
    wheels = ("numpy-2.2.6-cp311-cp311-manylinux_2_17_aarch64.whl", "sits_agent-0.1.0-py3-none-any.whl")
    plan = plan_device(replace(DESIRED, wheels=wheels, wheel_bytes=1234), facts)
    assert plan.status is DeviceStatus.CHANGE
    (step,) = plan.steps
    assert step.kind is StepKind.BOOTSTRAP and step.bytes == 1234
    assert step.reason.startswith("re-imaged from x86_64 to aarch64")
    assert wheels[0] in step.reason and plan.wheels == wheels


def test_a_bootstrap_names_the_wheels_it_sends_and_no_other_step_does():
    wheels = tuple(f"w{i}-1.0-py3-none-any.whl" for i in range(10))
    desired = replace(DESIRED, wheels=wheels, wheel_bytes=10)
    plan = plan_device(desired, replace(RUNNING, agent_version=None))
    assert plan.steps[0].kind is StepKind.BOOTSTRAP
    assert "10 wheel(s) to send: w0-1.0" in plan.reason and ", 2 more" in plan.reason
    assert plan.wheels == wheels and plan.bytes_to_send == 10
    assert plan_device(desired, RUNNING).wheels == ()  # nothing to install: none named


@pytest.mark.parametrize(
    ("desired", "facts", "why"),
    [
        (
            dict(system_torch=True),
            dict(torch=SystemTorch(None, error="ModuleNotFoundError: No module named 'torch'")),
            "cannot import torch (ModuleNotFoundError",
        ),
        (
            dict(system_torch=True, cuda=True),
            dict(torch=SystemTorch("2.3.0", cuda=False)),
            "system torch 2.3.0 sees no CUDA device",
        ),
        (dict(cuda=True), {}, "no CUDA for a Jetson's integrated GPU"),
    ],
)
def test_what_the_device_cannot_run_is_refused_before_anything_is_sent(desired, facts, why):
    plan = plan_device(replace(DESIRED, **desired), replace(RUNNING, agent_version=None, **facts))
    assert plan.status is DeviceStatus.BLOCKED and why in plan.reason and plan.steps == ()


def test_a_jetson_whose_system_torch_sees_cuda_may_run_cuda():
    facts = replace(RUNNING, torch=SystemTorch("2.3.0", cuda=True))
    assert plan_device(replace(DESIRED, system_torch=True, cuda=True), facts).status is DeviceStatus.UNCHANGED
    x86 = replace(RUNNING, platform=replace(ARM, machine="x86_64"), wheels_arch="x86_64")
    assert plan_device(replace(DESIRED, cuda=True), x86).status is DeviceStatus.UNCHANGED  # PyPI's has CUDA
