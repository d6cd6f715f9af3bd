"""The drafter canary (docs/operator.md, "Drafter canary"), as pure functions.

A change of `spec.drafter` is first tried on a few pods (the canary Deployment, NAME-canary) while the others
keep the drafter they run (the stable one, recorded in `status.drafterCanary.stable`). Once both drafters ran
`minRounds` verify rounds over `windowSeconds`, the new one is promoted to every pod if its acceptance length
is at least (1 - tolerance) times the old one's, else rolled back. DDTree is lossless (greedy answers are the
target's token for token, sampled ones have its distribution, whatever the drafter): the decision is only about
speed.

- `plan` and `render`: the drafters the Deployments run for a spec and canary state, and the children.
- `measure`: a drafter's figures from its pods' counters since each one's first scrape in the canary.
- `step`: the next canary state from the spec, the pods and the latest scrapes (handlers.py keeps the
  baselines between ticks and writes the state into the status).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Mapping
from typing import Any

from .api import (
    GROUP,
    DrafterCanarySpec,
    DrafterCanaryStatus,
    DrafterMeasurement,
    DrafterSpec,
    SpeculativeDeploymentSpec,
)
from .metrics import EngineSample
from .render import (
    CONFIG_MOUNT,
    EngineDefaults,
    Owner,
    engine_config_hash,
    engine_config_text,
    render_children,
    render_deployment,
)
from .status import DeploymentView, PodView, set_condition

TRACK_LABEL = f"{GROUP}/track"  # on the canary Deployment, its selector and its pods
CANARY_TRACK = "canary"
CANARY_CONFIG_FILE = "engine-canary.yaml"  # the candidate's configuration, next to CONFIG_FILE in the ConfigMap
CONDITION = "DrafterCanary"


def canary_name(name: str) -> str:
    return f"{name}-canary"


def describe(drafter: DrafterSpec) -> str:
    return f"{drafter.uri}@{drafter.revision}" if drafter.revision else drafter.uri


def canary_replicas(spec: SpeculativeDeploymentSpec) -> int:
    """Pods of the candidate: spec.drafterCanary.replicas (a percentage of replicas is rounded up), at least 1
    and at most replicas - 1, so that the stable drafter keeps a pod to compare with."""
    wanted = spec.drafter_canary.replicas
    count = math.ceil(spec.replicas * int(wanted[:-1]) / 100) if isinstance(wanted, str) else wanted
    return max(1, min(count, spec.replicas - 1))


@dataclasses.dataclass(frozen=True)
class Plan:
    """The drafters the Deployments run: the engine Deployment's, and the canary Deployment's (on
    `canary_replicas` of the spec's replicas) while a canary runs."""

    drafter: DrafterSpec | None
    candidate: DrafterSpec | None = None
    canary_replicas: int = 0


def plan(spec: SpeculativeDeploymentSpec, state: DrafterCanaryStatus | None) -> Plan:
    """Until `step` has decided about a new spec.drafter (start a canary, or roll it out directly), the
    engine Deployment keeps the stable drafter; a rolled-back candidate stays off until spec.drafter changes."""
    if state is None or spec.drafter is None or not spec.drafter_canary.enabled:
        return Plan(spec.drafter)
    if state.phase == "Progressing" and state.candidate == spec.drafter and spec.replicas >= 2:
        return Plan(state.stable, spec.drafter, canary_replicas(spec))
    return Plan(state.stable)


def _with_drafter(spec: SpeculativeDeploymentSpec, drafter: DrafterSpec | None) -> SpeculativeDeploymentSpec:
    return spec.model_copy(update={"drafter": drafter})


def render_canary_deployment(
    owner: Owner, candidate: SpeculativeDeploymentSpec, replicas: int, defaults: EngineDefaults
) -> dict[str, Any]:
    """The engine Deployment of the candidate's spec, as NAME-canary: its own selector (the track label; the
    engine Deployment's selector, immutable, also matches these pods, but a ReplicaSet only takes pods that no
    other controller owns), the candidate's configuration file, and the canary's replicas. Its pods carry the
    resource's selector labels, so the Service sends them their share of the traffic."""
    deployment = render_deployment(owner, candidate, defaults)
    deployment["metadata"]["name"] = canary_name(owner.name)
    template = deployment["spec"]["template"]
    for labels in (deployment["metadata"]["labels"], deployment["spec"]["selector"]["matchLabels"]):
        labels[TRACK_LABEL] = CANARY_TRACK
    template["metadata"]["labels"][TRACK_LABEL] = CANARY_TRACK
    deployment["spec"]["replicas"] = replicas
    container = template["spec"]["containers"][0]
    container["args"] = ["--config", f"{CONFIG_MOUNT}/{CANARY_CONFIG_FILE}", *candidate.engine.args]
    return deployment


def render(
    owner: Owner, spec: SpeculativeDeploymentSpec, state: DrafterCanaryStatus | None, defaults: EngineDefaults
) -> list[dict[str, Any]]:
    """Every child (render_children) with the engine Deployment on the plan's drafter; while a canary runs,
    also the canary Deployment, whose pods the engine Deployment gives up (the total stays spec.replicas),
    and the candidate's configuration in the ConfigMap."""
    running = plan(spec, state)
    children = render_children(owner, _with_drafter(spec, running.drafter), defaults)
    if running.candidate is None:
        return children
    candidate = _with_drafter(spec, running.candidate)
    for child in children:
        if child["kind"] == "ConfigMap":
            child["data"][CANARY_CONFIG_FILE] = engine_config_text(candidate)
        elif child["kind"] == "Deployment":
            child["spec"]["replicas"] = spec.replicas - running.canary_replicas
    canary = render_canary_deployment(owner, candidate, running.canary_replicas, defaults)
    index = next(i for i, child in enumerate(children) if child["kind"] == "Deployment")
    return [*children[: index + 1], canary, *children[index + 1 :]]


def combined(main: DeploymentView | None, canary: DeploymentView | None) -> DeploymentView | None:
    """The engine and canary Deployments as one, for the resource's replica counts and phase."""
    if main is None or canary is None:
        return main
    caught_up = canary.observed_generation >= canary.generation
    return DeploymentView(
        generation=main.generation,
        observed_generation=main.observed_generation if caught_up else main.generation - 1,
        replicas=main.replicas + canary.replicas,
        ready_replicas=main.ready_replicas + canary.ready_replicas,
        updated_replicas=main.updated_replicas + canary.updated_replicas,
        progress_deadline_exceeded=main.progress_deadline_exceeded or canary.progress_deadline_exceeded,
    )


# ---- measuring ------------------------------------------------------------------------------------


def _restarted(before: EngineSample, now: EngineSample) -> bool:
    return now.drafts < before.drafts or now.accepted < before.accepted or now.generated < before.generated


def rebaselined(
    baselines: Mapping[str, EngineSample], latest: Mapping[str, EngineSample], uids: set[str]
) -> dict[str, EngineSample]:
    """The first sample of each of these pods in the canary (its latest one after an engine restart); pods
    that are gone or not scraped now drop out."""
    out = {}
    for uid in uids & latest.keys():
        before = baselines.get(uid)
        out[uid] = latest[uid] if before is None or _restarted(before, latest[uid]) else before
    return out


def measure(
    uids: set[str], baselines: Mapping[str, EngineSample], latest: Mapping[str, EngineSample]
) -> DrafterMeasurement:
    """Acceptance length (1 + Σ Δaccepted / Σ Δdrafts), rounds (Σ Δdrafts) and tokens/s per pod of these pods
    since their baselines."""
    drafts = accepted = 0.0
    rates: list[float] = []
    seconds = 0.0
    for uid in uids & baselines.keys() & latest.keys():
        before, now = baselines[uid], latest[uid]
        drafts += now.drafts - before.drafts
        accepted += now.accepted - before.accepted
        if now.time > before.time:
            rates.append((now.generated - before.generated) / (now.time - before.time))
            seconds = max(seconds, now.time - before.time)
    return DrafterMeasurement(
        pods=len(uids),
        rounds=int(drafts),
        seconds=round(seconds, 1),
        acceptance_length=round(1.0 + accepted / drafts, 3) if drafts > 0 else None,
        tokens_per_second=round(sum(rates) / len(rates), 1) if rates else None,
    )


# ---- deciding -------------------------------------------------------------------------------------

Event = tuple[str, str, str]  # type (Normal, Warning), reason, message


@dataclasses.dataclass(frozen=True)
class Step:
    state: DrafterCanaryStatus | None
    baselines: dict[str, EngineSample]
    event: Event | None = None  # when the canary started or ended


def _figures(name: str, m: DrafterMeasurement) -> str:
    acceptance = "n/a" if m.acceptance_length is None else f"{m.acceptance_length:.2f}"
    tokens = "n/a" if m.tokens_per_second is None else f"{m.tokens_per_second:.1f}"
    return f"{name}: acceptance length {acceptance}, {tokens} tokens/s per pod, {m.rounds} rounds on {m.pods} pod(s)"


def _rolled_back(state: DrafterCanaryStatus, why: str, **figures: DrafterMeasurement) -> Step:
    assert state.candidate is not None
    message = (
        f"rolled back to {describe(state.stable)}: {why}. The engines keep {describe(state.stable)} until "
        "spec.drafter changes (a new revision is tried again; spec.drafterCanary.enabled false rolls a drafter "
        "out without a canary)"
    )
    ended = state.model_copy(update={"phase": "RolledBack", "message": message, **figures})
    return Step(ended, {}, ("Warning", "RolledBack", message))


def _direct(spec: SpeculativeDeploymentSpec, stable_ready: int, name_taken: bool) -> str | None:
    """Why a new drafter rolls out without a canary, or None when a canary can run."""
    if not spec.drafter_canary.enabled:
        return "spec.drafterCanary.enabled is false"
    if spec.replicas < 2:
        return f"spec.replicas is {spec.replicas}; a canary needs 2, one pod for each drafter"
    if stable_ready == 0:
        return "no pod of the old drafter is ready to compare with"
    if name_taken:
        return "a Deployment of the canary's name belongs to another resource"
    return None


def step(
    *,
    spec: SpeculativeDeploymentSpec,
    state: DrafterCanaryStatus | None,
    pods: list[PodView],
    latest: Mapping[str, EngineSample],
    baselines: Mapping[str, EngineSample],
    now: datetime.datetime,
    name_taken: bool = False,
) -> Step:
    """The canary state after this tick. `pods` are the resource's engine pods (both Deployments), `latest`
    the last scrape of each ready pod (by UID), `baselines` what the previous step returned, `name_taken`
    whether another resource's engine Deployment is called NAME-canary."""
    drafter = spec.drafter
    if drafter is None:  # method none: nothing to compare
        return Step(None, {})
    if state is None:  # a new resource (or one from before the canary existed) runs spec.drafter
        return Step(DrafterCanaryStatus(stable=drafter), {})
    progressing = state.phase == "Progressing"
    if drafter == state.stable:
        if not progressing:
            return Step(state, {})
        message = f"cancelled: spec.drafter is {describe(drafter)} again"
        cancelled = state.model_copy(update={"phase": "Cancelled", "message": message})
        return Step(cancelled, {}, ("Normal", "Cancelled", message))
    if state.phase == "RolledBack" and state.candidate == drafter:
        return Step(state, {})  # until spec.drafter changes
    candidate_hash = engine_config_hash(_with_drafter(spec, drafter))
    if progressing and state.candidate == drafter and spec.drafter_canary.enabled:
        return _judge(spec, state, pods, latest, baselines, now, candidate_hash)
    stable_ready = sum(p.ready and p.config_hash != candidate_hash for p in pods)
    if why := _direct(spec, stable_ready, name_taken):
        message = f"rolling out drafter {describe(drafter)} without a canary: {why}"
        return Step(DrafterCanaryStatus(stable=drafter), {}, ("Normal", "DrafterRolledOut", message))
    started = DrafterCanaryStatus(
        stable=state.stable,
        phase="Progressing",
        candidate=drafter,
        started_at=now.replace(microsecond=0),
        message=_waiting_for_pods(spec, drafter),
    )
    return Step(started, {}, ("Normal", "DrafterCanaryStarted", f"{started.message}; old: {describe(state.stable)}"))


def _waiting_for_pods(spec: SpeculativeDeploymentSpec, drafter: DrafterSpec) -> str:
    return f"trying {describe(drafter)} on {canary_replicas(spec)} pod(s): waiting for them to be ready"


def _progress(settings: DrafterCanarySpec, stable: DrafterMeasurement, candidate: DrafterMeasurement) -> str:
    return (
        f"rounds {candidate.rounds} (new) and {stable.rounds} (old) of minRounds {settings.min_rounds}, "
        f"{min(candidate.seconds, stable.seconds):.0f}s of windowSeconds {settings.window_seconds}"
    )


def _judge(
    spec: SpeculativeDeploymentSpec,
    state: DrafterCanaryStatus,
    pods: list[PodView],
    latest: Mapping[str, EngineSample],
    baselines: Mapping[str, EngineSample],
    now: datetime.datetime,
    candidate_hash: str,
) -> Step:
    """A running canary: measure both drafters, then promote, roll back, or keep measuring. Pods are told
    apart by the configuration they run, so pods of an older spec count for neither drafter."""
    settings = spec.drafter_canary
    new, old = state.candidate, state.stable
    assert new is not None and state.started_at is not None
    if spec.replicas < 2:
        return _rolled_back(state, f"spec.replicas is {spec.replicas}; a canary needs 2, one pod for each drafter")
    if failed := sorted((p for p in pods if p.config_hash == candidate_hash and p.failure), key=lambda p: p.name):
        failure = failed[0].failure
        assert failure is not None
        why = f"pod {failed[0].name} of the new drafter exited with code {failure.exit_code}: "
        return _rolled_back(state, why + (failure.message or failure.reason))
    stable_hash = engine_config_hash(_with_drafter(spec, old))
    stable_pods = {p.uid for p in pods if p.ready and p.config_hash == stable_hash}
    candidate_pods = {p.uid for p in pods if p.ready and p.config_hash == candidate_hash}
    fresh = rebaselined(baselines, latest, stable_pods | candidate_pods)
    stable, candidate = measure(stable_pods, fresh, latest), measure(candidate_pods, fresh, latest)
    figures = {"stable_measurement": stable, "candidate_measurement": candidate}
    enough_rounds = min(stable.rounds, candidate.rounds) >= settings.min_rounds
    if enough_rounds and min(stable.seconds, candidate.seconds) >= settings.window_seconds:
        assert stable.acceptance_length is not None and candidate.acceptance_length is not None
        threshold = f"(1 - {settings.tolerance:g}) x {stable.acceptance_length:.2f}"
        comparison = f"{_figures(describe(new), candidate)}; {_figures(describe(old), stable)}"
        if candidate.acceptance_length < stable.acceptance_length * (1.0 - settings.tolerance):
            why = f"the acceptance length of {describe(new)}, {candidate.acceptance_length:.2f}, is below {threshold}"
            return _rolled_back(state, f"{why} ({comparison})", **figures)
        message = (
            f"promoted {describe(new)}: its acceptance length {candidate.acceptance_length:.2f} is at least "
            f"{threshold} of {describe(old)} ({comparison})"
        )
        promoted = state.model_copy(update={"stable": new, "phase": "Promoted", "message": message, **figures})
        return Step(promoted, {}, ("Normal", "Promoted", message))
    if (now - state.started_at).total_seconds() >= settings.deadline_seconds:
        why = "its pods never became ready" if not candidate_pods else _progress(settings, stable, candidate)
        return _rolled_back(state, f"no decision within {settings.deadline_seconds}s: {why}", **figures)
    if candidate_pods:
        message = f"measuring {describe(new)} against {describe(old)}: {_progress(settings, stable, candidate)}"
    else:
        message = _waiting_for_pods(spec, new)
    return Step(state.model_copy(update={"message": message, **figures}), fresh)


def condition(
    state: DrafterCanaryStatus | None, previous: list[Mapping[str, Any]], generation: int, now: datetime.datetime
) -> dict[str, Any] | None:
    """The DrafterCanary condition: True while a canary runs, False once it ended; reason = the phase."""
    if state is None or state.phase is None:
        return None
    status = "True" if state.phase == "Progressing" else "False"
    return set_condition(previous, CONDITION, status, state.phase, state.message, generation, now)


def status_value(state: DrafterCanaryStatus | None) -> dict[str, Any] | None:
    """`status.drafterCanary` as the API server stores it (so an unchanged state is no patch)."""
    if state is None:
        return None
    value = state.model_dump(mode="json", by_alias=True, exclude_none=True)
    if state.started_at is not None:
        value["startedAt"] = state.started_at.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return value
