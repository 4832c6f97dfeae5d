"""Adapters in the plan (issue #41): each adapter that moves gets its own steps, after the base,
and its own line in `plan`'s table; an adapter already current gets none."""

from __future__ import annotations

import re
from dataclasses import replace

from rich.console import Console

from deployer.cli.fleet_cmds import _plan_table
from deployer.config.models import Strategy
from deployer.push.cost import rollout_cost
from deployer.push.plan import (
    AdapterChange,
    AdapterTarget,
    DeviceStatus,
    InstalledAdapter,
    StepKind,
    make_plan,
    plan_device,
)
from deployer.push.rollout import make_waves
from tests.plan.test_plan import CURRENT, DESIRED, DeviceFacts

K = StepKind
SUMMARISE = AdapterTarget("summarise", "1.1.0", "s2", 900, patches={"s1": 80})
EXTRACT = AdapterTarget("extract", "2.0.0", "e2", 700)
WITH_ADAPTERS = replace(DESIRED, adapters=(SUMMARISE, EXTRACT))
UP_TO_DATE = dict(CURRENT, model_version="1.1.0", model_sha256="new")


def _facts(**adapters: tuple[str, str]) -> DeviceFacts:
    installed = {n: InstalledAdapter(v, sha) for n, (v, sha) in adapters.items()}
    return DeviceFacts(name="dev-1", **UP_TO_DATE, adapters=installed)


def test_only_the_adapters_that_moved_get_steps_and_the_base_is_untouched():
    plan = plan_device(WITH_ADAPTERS, _facts(summarise=("1.0.0", "s1"), extract=("2.0.0", "e2")))
    assert plan.status is DeviceStatus.CHANGE
    assert [s.kind for s in plan.steps] == [K.SEND_ADAPTER_PATCH, K.INSTALL_ADAPTER]
    assert plan.steps_of() == ()  # nothing of the base or the device: no hooks, no reload
    assert plan.adapters == (AdapterChange("summarise", "1.0.0", "1.1.0"),)
    assert (plan.bytes_to_send, plan.reason) == (80, "adapter summarise 1.0.0 -> 1.1.0: patch")


def test_a_device_without_the_adapter_gets_it_whole_after_the_base_moves():
    facts = DeviceFacts(name="dev-1", **CURRENT)
    plan = plan_device(WITH_ADAPTERS, facts)
    kinds = [s.kind for s in plan.steps]
    assert kinds.index(K.HEALTH_GATE) < kinds.index(K.SEND_ADAPTER) < kinds.index(K.POST_DEPLOY_HOOK)
    assert [s.bytes for s in plan.steps_of("extract")] == [700, 0]
    assert [c.name for c in plan.adapters] == ["summarise", "extract"]
    assert plan.reason == "patch 1.0.0 -> 1.1.0"  # the headline stays the base's


def test_adapters_already_current_change_nothing():
    plan = plan_device(WITH_ADAPTERS, _facts(summarise=("1.1.0", "s2"), extract=("2.0.0", "e2")))
    assert (plan.status, plan.steps, plan.adapters) == (DeviceStatus.UNCHANGED, (), ())


def test_an_installed_adapter_changes_the_facts_digest():
    one = make_plan(WITH_ADAPTERS, [_facts(summarise=("1.0.0", "s1"))])
    other = make_plan(WITH_ADAPTERS, [_facts(summarise=("1.1.0", "s2"))])
    assert one.facts_digest != other.facts_digest


def test_plan_shows_each_adapter_on_a_line_of_its_own():
    plan = make_plan(WITH_ADAPTERS, [_facts(summarise=("1.0.0", "s1"))])
    cost = rollout_cost(plan, make_waves(Strategy(), ["dev-1"]), parallel=1)
    console = Console(record=True, width=200)
    console.print(_plan_table(plan, cost))
    rows = [re.sub(r"\s*│\s*", "|", line).strip("|") for line in console.export_text().splitlines()]
    assert "dev-1|-|change|1.1.0|1.1.0|-|0|-|adapters only" in rows
    assert (
        "dev-1 adapter summarise|-|change|1.0.0|1.1.0|send-adapter-patch, install-adapter|80||"
        "adapter summarise 1.0.0 -> 1.1.0: patch"
    ) in rows
    assert (
        "dev-1 adapter extract|-|change|-|2.0.0|send-adapter, install-adapter|700||"
        "adapter extract none -> 2.0.0: full adapter artifact"
    ) in rows


def test_the_facts_probe_reads_each_adapters_current_version(tmp_path):
    import sys

    from deployer.agent.ota.adapters import AdapterStore
    from deployer.push.facts import DeviceSite, gather_facts
    from deployer.transport import LocalTransport

    store = AdapterStore(tmp_path / "var" / "lib" / "sits")
    payload = tmp_path / "payload"
    payload.mkdir()
    (payload / "adapter.json").write_text("{}")
    store.install("summarise", payload, "s1", "1.0.0", counter=1)
    store.install("extract", payload, "e1", "2.0.0", counter=1)
    store.remove("extract")  # uninstalled: no current version, so not a fact
    site = DeviceSite("d", "localhost", str(tmp_path), True, 1, sys.executable, sys.executable)
    facts = gather_facts(site, LocalTransport(tmp_path))
    assert facts.reachable, facts.error
    assert facts.adapters == {"summarise": InstalledAdapter("1.0.0", "s1", counter=1)}


def test_an_adapter_not_built_for_the_target_base_is_a_pending_build():
    desired = replace(DESIRED, adapters=(AdapterTarget("summarise", "1.1.0", "", 0),))
    plan = plan_device(desired, _facts(summarise=("1.0.0", "s1")))
    [step] = plan.steps
    assert (step.kind, step.adapter) == (K.BUILD, "summarise")
    assert (
        step.reason == "adapter summarise 1.0.0 -> 1.1.0: not built for this base: run `sits-deployer build`"
    )
