"""The drafter canary's pure functions: what runs (plan, render), what is measured, and what is decided
(docs/operator.md, "Drafter canary"). tests/operator/test_canary.py runs it against real engines."""

import datetime

import pytest
import yaml

from ddtree_operator import canary
from ddtree_operator.api import DrafterCanaryStatus, DrafterSpec, SpeculativeDeploymentSpec
from ddtree_operator.metrics import EngineSample
from ddtree_operator.render import (
    CONFIG_HASH_ANNOTATION,
    EngineDefaults,
    Owner,
    engine_config_hash,
    selector_labels,
)
from ddtree_operator.status import DeploymentView, Failure, PodView, pod_view
from invalid_specs import VALID

OWNER = Owner(name="demo", namespace="llm", uid="1f6a4a8e-0000-4000-8000-000000000001")
DEFAULTS = EngineDefaults(image="ddtree-engine:9.9", image_pull_policy="IfNotPresent")
T0 = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.timezone.utc)
OLD = DrafterSpec(uri="smollm2-135m-instruct-dflash")
NEW = DrafterSpec(uri="random:1")
# Short settings, so the scenarios below need few samples.
CANARY = {"windowSeconds": 60, "minRounds": 100, "tolerance": 0.05, "deadlineSeconds": 600}


def spec(drafter=NEW, replicas=4, **overrides) -> SpeculativeDeploymentSpec:
    return SpeculativeDeploymentSpec.model_validate(
        {
            **VALID,
            "drafter": drafter.model_dump(exclude_none=True),
            "replicas": replicas,
            "drafterCanary": CANARY,
            **overrides,
        }
    )


def progressing(candidate=NEW, started_at=T0) -> DrafterCanaryStatus:
    return DrafterCanaryStatus(stable=OLD, phase="Progressing", candidate=candidate, started_at=started_at)


def config_hash(s: SpeculativeDeploymentSpec, drafter: DrafterSpec) -> str:
    return engine_config_hash(s.model_copy(update={"drafter": drafter}))


def pods(s: SpeculativeDeploymentSpec, stable=3, candidate=1, ready=True) -> list[PodView]:
    """`stable` pods on the old drafter, `candidate` on the new one, under spec `s`."""
    out = []
    for side, drafter, count in (("old", OLD, stable), ("new", NEW, candidate)):
        for i in range(count):
            out.append(
                PodView(f"{side}-{i}", f"uid-{side}-{i}", "127.1.0.5", ready, True, None, config_hash(s, drafter))
            )
    return out


def sample(t: float, rounds: float, acceptance_length: float, tokens_per_second: float = 10.0) -> EngineSample:
    return EngineSample(
        time=t, drafts=rounds, accepted=rounds * (acceptance_length - 1.0), generated=t * tokens_per_second
    )


def scrape(
    running: list[PodView], t: float, rounds: float, old_acceptance: float, new_acceptance: float
) -> dict[str, EngineSample]:
    """Every pod `t` s into the canary, each having run `rounds` rounds at its drafter's acceptance length."""
    return {p.uid: sample(t, rounds, new_acceptance if p.name.startswith("new") else old_acceptance) for p in running}


def run(s, state, running, old_acceptance, new_acceptance, seconds=(0, 30, 61), rounds_per_second=3.0):
    """Ticks at `seconds` after T0, each with a scrape; returns the last step."""
    baselines: dict[str, EngineSample] = {}
    result = None
    for t in seconds:
        latest = scrape(running, t, rounds_per_second * t, old_acceptance, new_acceptance)
        now = T0 + datetime.timedelta(seconds=t)
        result = canary.step(spec=s, state=state, pods=running, latest=latest, baselines=baselines, now=now)
        state, baselines = result.state, result.baselines
    return result


# ---- what runs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "wanted, replicas, expected",
    [(1, 4, 1), (2, 4, 2), (9, 4, 3), ("25%", 4, 1), ("30%", 4, 2), ("50%", 2, 1), ("100%", 3, 2)],
)
def test_canary_replicas_leave_the_old_drafter_a_pod(wanted, replicas, expected):
    s = spec(replicas=replicas, drafterCanary={**CANARY, "replicas": wanted})
    assert canary.canary_replicas(s) == expected


def test_plan_keeps_the_stable_drafter_until_a_canary_decides():
    s = spec()
    assert canary.plan(s, None) == canary.Plan(NEW)  # a new resource runs what it asks for
    assert canary.plan(s, DrafterCanaryStatus(stable=NEW)) == canary.Plan(NEW)
    assert canary.plan(s, DrafterCanaryStatus(stable=OLD)) == canary.Plan(OLD)  # not decided yet
    assert canary.plan(s, progressing()) == canary.Plan(OLD, NEW, 1)
    rolled_back = progressing().model_copy(update={"phase": "RolledBack"})
    assert canary.plan(s, rolled_back) == canary.Plan(OLD)
    # a canary of an earlier drafter does not run the current one
    assert canary.plan(s, progressing(candidate=DrafterSpec(uri="random:2"))) == canary.Plan(OLD)
    assert canary.plan(spec(drafterCanary={"enabled": False}), progressing()) == canary.Plan(NEW)
    assert canary.plan(spec(replicas=1), progressing()) == canary.Plan(OLD)


def by_kind(children):
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def test_render_during_a_canary_splits_the_replicas_between_two_deployments():
    s = spec(replicas=4, drafterCanary={**CANARY, "replicas": "50%"})
    children = by_kind(canary.render(OWNER, s, progressing(), DEFAULTS))
    main, test = children[("Deployment", "demo")], children[("Deployment", "demo-canary")]
    assert (main["spec"]["replicas"], test["spec"]["replicas"]) == (2, 2)
    files = children[("ConfigMap", "demo")]["data"]
    assert yaml.safe_load(files["engine.yaml"])["model"]["drafter"] == OLD.uri
    assert yaml.safe_load(files[canary.CANARY_CONFIG_FILE])["model"]["drafter"] == NEW.uri
    engine = test["spec"]["template"]["spec"]["containers"][0]
    assert engine["args"] == ["--config", f"/etc/ddtree/{canary.CANARY_CONFIG_FILE}"]
    template = test["spec"]["template"]["metadata"]
    assert template["annotations"][CONFIG_HASH_ANNOTATION] == config_hash(s, NEW)
    assert main["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] == config_hash(s, OLD)
    # its own selector, but the Service's: the canary pods get their share of the traffic
    assert test["spec"]["selector"]["matchLabels"] == {**selector_labels("demo"), canary.TRACK_LABEL: "canary"}
    assert children[("Service", "demo")]["spec"]["selector"].items() <= template["labels"].items()
    assert test["metadata"]["ownerReferences"] == main["metadata"]["ownerReferences"]
    # the disruption budget covers all 4 pods, as without a canary
    assert ("PodDisruptionBudget", "demo") in children


def test_render_without_a_canary_is_render_children():
    for state in (None, DrafterCanaryStatus(stable=NEW), progressing().model_copy(update={"phase": "Promoted"})):
        children = by_kind(canary.render(OWNER, spec(), state, DEFAULTS))
        assert ("Deployment", "demo-canary") not in children
        assert list(children[("ConfigMap", "demo")]["data"]) == ["engine.yaml"]
        assert children[("Deployment", "demo")]["spec"]["replicas"] == 4


def test_combined_deployments_count_both():
    main = DeploymentView(2, 2, 3, 3, 3, False)
    test = DeploymentView(1, 1, 1, 0, 1, False)
    assert canary.combined(main, test) == DeploymentView(2, 2, 4, 3, 4, False)
    assert canary.combined(main, DeploymentView(2, 1, 1, 1, 1, False)).observed_generation == 1  # not caught up
    assert canary.combined(main, None) is main


def test_pods_are_told_apart_by_the_configuration_they_run():
    s = spec()
    rendered = by_kind(canary.render(OWNER, s, progressing(), DEFAULTS))[("Deployment", "demo-canary")]
    pod = {"metadata": {"name": "demo-canary-x", "uid": "u", **rendered["spec"]["template"]["metadata"]}}
    assert pod_view(pod).config_hash == config_hash(s, NEW) != config_hash(s, OLD)


# ---- measuring ----------------------------------------------------------------------------------


def test_measure_from_baselines():
    baselines = {"a": sample(10, 100, 3.0, 20), "b": sample(10, 0, 1.0, 20)}
    latest = {"a": sample(20, 200, 3.0, 20), "b": sample(30, 300, 1.0, 20), "other": sample(30, 999, 9.0)}
    m = canary.measure({"a", "b"}, baselines, latest)
    # rounds 100 + 300; accepted 200 + 0 → 1 + 200/400; tokens/s: each pod's 20, averaged
    assert (m.pods, m.rounds, m.acceptance_length, m.tokens_per_second, m.seconds) == (2, 400, 1.5, 20.0, 20.0)
    assert canary.measure(set(), baselines, latest).acceptance_length is None


def test_rebaselined_keeps_first_samples_and_restarts_after_an_engine_restart():
    baselines = {"a": sample(10, 100, 2.0), "restarted": sample(10, 500, 2.0), "gone": sample(10, 1, 2.0)}
    latest = {"a": sample(20, 150, 2.0), "restarted": sample(20, 5, 2.0), "new": sample(20, 7, 2.0)}
    fresh = canary.rebaselined(baselines, latest, {"a", "restarted", "new", "gone"})
    assert fresh == {"a": baselines["a"], "restarted": latest["restarted"], "new": latest["new"]}


# ---- deciding -----------------------------------------------------------------------------------


def test_a_new_resource_records_its_drafter_as_stable():
    result = canary.step(spec=spec(), state=None, pods=[], latest={}, baselines={}, now=T0)
    assert result.state == DrafterCanaryStatus(stable=NEW) and result.event is None
    method_none = SpeculativeDeploymentSpec.model_validate({"model": VALID["model"], "speculation": {"method": "none"}})
    assert canary.step(spec=method_none, state=None, pods=[], latest={}, baselines={}, now=T0).state is None


def test_a_changed_drafter_starts_a_canary_while_old_pods_serve():
    s = spec()
    running = [p for p in pods(s, stable=4, candidate=0)]
    result = canary.step(spec=s, state=DrafterCanaryStatus(stable=OLD), pods=running, latest={}, baselines={}, now=T0)
    assert result.state.phase == "Progressing" and result.state.candidate == NEW and result.state.stable == OLD
    assert result.state.started_at == T0
    assert result.event[:2] == ("Normal", "DrafterCanaryStarted")
    assert "random:1 on 1 pod(s)" in result.event[2] and "smollm2-135m-instruct-dflash" in result.event[2]


@pytest.mark.parametrize(
    "overrides, ready, why",
    [
        ({}, False, "no pod of the old drafter is ready"),
        ({"replicas": 1}, True, "spec.replicas is 1; a canary needs 2"),
        ({"drafterCanary": {"enabled": False}}, True, "spec.drafterCanary.enabled is false"),
    ],
)
def test_a_changed_drafter_rolls_out_directly_when_no_canary_can_run(overrides, ready, why):
    s = spec(**overrides)
    running = pods(s, stable=1, candidate=0, ready=ready)
    result = canary.step(spec=s, state=DrafterCanaryStatus(stable=OLD), pods=running, latest={}, baselines={}, now=T0)
    assert result.state == DrafterCanaryStatus(stable=NEW)
    assert result.event[:2] == ("Normal", "DrafterRolledOut") and why in result.event[2]
    assert canary.plan(s, result.state) == canary.Plan(NEW)


def test_a_canary_name_of_another_resource_skips_the_canary():
    s = spec()
    result = canary.step(
        spec=s, state=DrafterCanaryStatus(stable=OLD), pods=pods(s), latest={}, baselines={}, now=T0, name_taken=True
    )
    assert result.state == DrafterCanaryStatus(stable=NEW) and "belongs to another resource" in result.event[2]


def test_a_better_drafter_is_promoted_with_both_figures():
    s = spec()
    result = run(s, progressing(), pods(s), old_acceptance=1.2, new_acceptance=3.0)
    state = result.state
    assert (state.phase, state.stable, state.candidate) == ("Promoted", NEW, NEW)
    assert state.candidate_measurement.acceptance_length == 3.0 and state.stable_measurement.acceptance_length == 1.2
    assert state.candidate_measurement.pods == 1 and state.stable_measurement.pods == 3
    assert result.event[:2] == ("Normal", "Promoted")
    assert "acceptance length 3.00" in state.message and "acceptance length 1.20" in state.message
    assert canary.plan(s, state) == canary.Plan(NEW)


def test_a_worse_drafter_is_rolled_back_and_stays_off():
    s = spec()
    result = run(s, progressing(), pods(s), old_acceptance=3.0, new_acceptance=1.2)
    state = result.state
    assert (state.phase, state.stable, state.candidate) == ("RolledBack", OLD, NEW)
    assert result.event[:2] == ("Warning", "RolledBack")
    assert "1.20, is below (1 - 0.05) x 3.00" in state.message
    assert "until spec.drafter changes" in state.message
    assert canary.plan(s, state) == canary.Plan(OLD)
    later = canary.step(spec=s, state=state, pods=pods(s, candidate=0), latest={}, baselines={}, now=T0)
    assert later.state == state and later.event is None
    # a new revision of the drafter is a new candidate
    retrained = DrafterSpec(uri="random:1", revision="v2")
    again = canary.step(
        spec=spec(drafter=retrained), state=state, pods=pods(s, candidate=0), latest={}, baselines={}, now=T0
    )
    assert again.state.phase == "Progressing" and again.state.candidate == retrained


@pytest.mark.parametrize("new_acceptance, phase", [(2.86, "Promoted"), (2.84, "RolledBack")])
def test_tolerance_is_the_line_between_promoted_and_rolled_back(new_acceptance, phase):
    s = spec()  # tolerance 0.05 of 3.0: the line is at 2.85
    assert run(s, progressing(), pods(s), old_acceptance=3.0, new_acceptance=new_acceptance).state.phase == phase


def test_no_decision_before_the_window_and_the_rounds():
    s = spec()
    early = run(s, progressing(), pods(s), 1.2, 3.0, seconds=(0, 59))  # enough rounds, window not over
    assert early.state.phase == "Progressing" and early.event is None
    assert "of windowSeconds 60" in early.state.message and early.baselines
    slow = run(s, progressing(), pods(s), 1.2, 3.0, seconds=(0, 61), rounds_per_second=1.0)  # 61 < 100 rounds
    assert slow.state.phase == "Progressing" and "rounds 61 (new) and 183 (old) of minRounds 100" in slow.state.message


def test_pods_of_another_configuration_count_for_neither_drafter():
    s = spec()
    older = spec(speculation={"budget": 7})  # the pods of a spec before this one
    result = run(s, progressing(), pods(older), 1.2, 3.0)
    assert result.state.phase == "Progressing"
    assert (result.state.stable_measurement.pods, result.state.candidate_measurement.pods) == (0, 0)
    assert "waiting for them to be ready" in result.state.message


def test_a_canary_whose_pods_never_get_ready_is_rolled_back_at_the_deadline():
    s = spec()
    running = pods(s, candidate=0)
    result = run(s, progressing(), running, 1.2, 3.0, seconds=(0, 599))
    assert result.state.phase == "Progressing"
    result = run(s, progressing(), running, 1.2, 3.0, seconds=(0, 600))
    assert result.state.phase == "RolledBack" and "no decision within 600s: its pods never became ready" in (
        result.state.message
    )


def test_a_failing_canary_pod_rolls_back_with_its_reason():
    s = spec()
    crashed = PodView(
        "new-0", "uid-new-0", None, False, False, Failure(1, "Error", "drafter config mismatch"), config_hash(s, NEW)
    )
    result = canary.step(
        spec=s, state=progressing(), pods=[*pods(s, candidate=0), crashed], latest={}, baselines={}, now=T0
    )
    assert result.state.phase == "RolledBack"
    assert "pod new-0 of the new drafter exited with code 1: drafter config mismatch" in result.state.message


def test_setting_the_old_drafter_back_cancels_the_canary():
    s = spec(drafter=OLD)
    result = canary.step(spec=s, state=progressing(), pods=pods(s), latest={}, baselines={}, now=T0)
    assert (result.state.phase, result.state.stable) == ("Cancelled", OLD)
    assert result.event[:2] == ("Normal", "Cancelled") and canary.plan(s, result.state) == canary.Plan(OLD)


def test_too_few_replicas_during_a_canary_roll_it_back():
    s = spec(replicas=1)
    result = canary.step(spec=s, state=progressing(), pods=pods(s, stable=1), latest={}, baselines={}, now=T0)
    assert result.state.phase == "RolledBack" and "spec.replicas is 1" in result.state.message


def test_condition_and_status_value():
    assert canary.condition(DrafterCanaryStatus(stable=OLD), [], 1, T0) is None
    running = progressing().model_copy(update={"message": "measuring"})
    c = canary.condition(running, [], 3, T0)
    assert (c["type"], c["status"], c["reason"], c["message"], c["observedGeneration"]) == (
        "DrafterCanary",
        "True",
        "Progressing",
        "measuring",
        3,
    )
    ended = canary.condition(running.model_copy(update={"phase": "RolledBack"}), [c], 3, T0)
    assert (ended["status"], ended["reason"]) == ("False", "RolledBack")
    # what the API server stores parses back to the same value: an unchanged state is no patch
    value = canary.status_value(running)
    assert value["startedAt"] == "2026-01-01T12:00:00Z"
    assert canary.status_value(DrafterCanaryStatus.model_validate(value)) == value
