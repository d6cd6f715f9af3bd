"""The resource's status as a pure function of what the operator observed (Deployment, pods, metrics)."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any

from .admission import Compatibility
from .api import SpeculativeDeploymentSpec
from .fit import MemoryCheck
from .metrics import EngineSample, Window
from .render import CONFIG_HASH_ANNOTATION, ENGINE_CONTAINER, selector_string


@dataclasses.dataclass(frozen=True)
class Failure:
    """The engine container's last abnormal exit (what the kubelet recorded)."""

    exit_code: int
    reason: str  # kubelet's reason: Error, OOMKilled, ...
    message: str  # the termination message: the engine's one-line reason, or the log tail


@dataclasses.dataclass(frozen=True)
class PodView:
    name: str
    uid: str
    ip: str | None
    ready: bool
    running: bool
    failure: Failure | None  # set only while the engine is not ready again
    config_hash: str | None = None  # the engine configuration it runs (CONFIG_HASH_ANNOTATION)


@dataclasses.dataclass(frozen=True)
class DeploymentView:
    generation: int
    observed_generation: int
    replicas: int  # pods that exist, old and new
    ready_replicas: int
    updated_replicas: int
    progress_deadline_exceeded: bool


def _terminated_abnormally(state: Mapping[str, Any] | None) -> Failure | None:
    terminated = (state or {}).get("terminated")
    if not terminated or terminated.get("exitCode", 0) == 0:
        return None
    return Failure(
        exit_code=int(terminated["exitCode"]),
        reason=terminated.get("reason") or "Error",
        message=(terminated.get("message") or "").strip(),
    )


def pod_view(pod: Mapping[str, Any]) -> PodView:
    status = pod.get("status") or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    engine: Mapping[str, Any] = next(
        (c for c in status.get("containerStatuses") or [] if c.get("name") == ENGINE_CONTAINER), {}
    )
    ready = conditions.get("Ready") == "True"
    failure = None
    if not ready:
        failure = _terminated_abnormally(engine.get("state")) or _terminated_abnormally(engine.get("lastState"))
    return PodView(
        name=pod["metadata"]["name"],
        uid=pod["metadata"]["uid"],
        ip=status.get("podIP"),
        ready=ready and not pod["metadata"].get("deletionTimestamp"),
        running=status.get("phase") == "Running",
        failure=failure,
        config_hash=(pod["metadata"].get("annotations") or {}).get(CONFIG_HASH_ANNOTATION),
    )


def deployment_view(deployment: Mapping[str, Any]) -> DeploymentView:
    status = deployment.get("status") or {}
    progressing: Mapping[str, Any] = next(
        (c for c in status.get("conditions") or [] if c.get("type") == "Progressing"), {}
    )
    return DeploymentView(
        generation=deployment["metadata"].get("generation", 0),
        observed_generation=status.get("observedGeneration", 0),
        replicas=status.get("replicas", 0),
        ready_replicas=status.get("readyReplicas", 0),
        updated_replicas=status.get("updatedReplicas", 0),
        progress_deadline_exceeded=progressing.get("reason") == "ProgressDeadlineExceeded",
    )


def _timestamp(now: datetime.datetime) -> str:
    return now.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    previous: list[Mapping[str, Any]],
    type_: str,
    status: str,
    reason: str,
    message: str,
    generation: int,
    now: datetime.datetime,
) -> dict[str, Any]:
    """A metav1 condition whose lastTransitionTime moves only when its status flips."""
    old = next((c for c in previous if c.get("type") == type_), None)
    since = old["lastTransitionTime"] if old is not None and old.get("status") == status else _timestamp(now)
    return {
        "type": type_,
        "status": status,
        "observedGeneration": generation,
        "lastTransitionTime": since,
        "reason": reason,
        "message": message,
    }


def _failure_text(pod: PodView) -> str:
    assert pod.failure is not None
    detail = pod.failure.message or f"{pod.failure.reason} without a termination message"
    return f"pod {pod.name} exited with code {pod.failure.exit_code}: {detail}"


Outcome = tuple[str, str, str]  # condition status, reason, message


def _metrics(window: Window | None, ready: int, previous: Mapping[str, Any], now: datetime.datetime) -> dict[str, Any]:
    """acceptanceLength, throughputTokensPerSecond, lastScrapeTime: rewritten only when the rounded numbers
    move, so an idle resource is not patched every scrape."""
    acceptance = previous.get("acceptanceLength")
    throughput = previous.get("throughputTokensPerSecond")
    scraped_at = previous.get("lastScrapeTime")
    if window is not None:
        new_acceptance = acceptance if window.acceptance_length is None else round(window.acceptance_length, 2)
        new_throughput = round(window.tokens_per_second, 1)
        if (new_acceptance, new_throughput) != (acceptance, throughput):
            acceptance, throughput, scraped_at = new_acceptance, new_throughput, _timestamp(now)
    elif ready == 0 and throughput:
        throughput, scraped_at = 0.0, _timestamp(now)  # nothing serves any more
    fields = {"acceptanceLength": acceptance, "throughputTokensPerSecond": throughput, "lastScrapeTime": scraped_at}
    return {k: v for k, v in fields.items() if v is not None}


def _smoke_test(
    spec: SpeculativeDeploymentSpec,
    pods: list[PodView],
    failing: list[PodView],
    samples: Mapping[str, EngineSample],
    previous: Mapping[str, Any],
) -> tuple[dict[str, Any], Outcome]:
    """The smokeTest summary and the SmokeTestPassed condition. The engine gates /ready on its smoke
    test, so a ready pod has passed it; an engine that exited says why in its termination message."""
    if not spec.readiness.smoke_test:
        return {"result": "Disabled"}, (
            "Unknown",
            "SmokeTestDisabled",
            "spec.readiness.smokeTest is false; readiness follows /health",
        )
    captures = [s.graph_capture_seconds for s in samples.values() if s.graph_capture_seconds is not None]
    capture_seconds = max(captures) if captures else (previous.get("smokeTest") or {}).get("graphCaptureSeconds")
    passed = sum(p.ready for p in pods)
    if failing:
        failure = failing[0].failure
        message = _failure_text(failing[0])
        summary = {"result": "Failed", "passedReplicas": passed, "message": message}
        outcome = ("False", "SmokeTestFailed" if failure.reason == "Error" else failure.reason, message)
    elif passed:
        summary = {"result": "Passed", "passedReplicas": passed}
        detail = f"; graph capture took {capture_seconds:.1f}s" if capture_seconds is not None else ""
        outcome = ("True", "SmokeTestPassed", f"{passed} ready engine(s) passed the smoke test{detail}")
    else:
        summary = {"result": "Pending", "passedReplicas": 0}
        outcome = ("Unknown", "Waiting", "no engine has finished loading yet")
    if capture_seconds is not None:
        summary["graphCaptureSeconds"] = round(capture_seconds, 2)
    return summary, outcome


def _phase(
    spec: SpeculativeDeploymentSpec,
    deployment: DeploymentView | None,
    pods: list[PodView],
    failing: list[PodView],
    rolled_out: bool,
    acceptance: float | None,
) -> tuple[str, str, str]:
    """phase, reason, message."""
    desired = spec.replicas
    ready = deployment.ready_replicas if deployment else 0
    counts = f"{ready}/{desired} replicas ready"
    minimum = spec.readiness.min_acceptance_length
    if deployment is None:
        return "Pending", "DeploymentMissing", "the engine Deployment does not exist yet"
    if deployment.progress_deadline_exceeded:
        return "Failed", "ProgressDeadlineExceeded", f"{counts}; the Deployment made no progress within its deadline"
    if failing:
        failure = _failure_text(failing[0])
        if ready == 0:
            return "Failed", "EngineFailed", failure
        return "Degraded", "EngineFailed", f"{counts}; {failure}"
    if desired == 0:
        return "Pending", "ScaledToZero", "spec.replicas is 0"
    if ready >= desired and rolled_out:
        if minimum is not None and acceptance is not None and acceptance < minimum:
            return (
                "Degraded",
                "LowAcceptance",
                (f"acceptance length {acceptance} is below spec.readiness.minAcceptanceLength {minimum}"),
            )
        return "Ready", "AllReplicasReady", counts
    if any(p.running for p in pods):
        return "Loading", "EnginesLoading", counts
    return "Pending", "WaitingForPods", f"{counts}; no engine pod is running yet"


def compute_status(
    *,
    name: str,
    generation: int,
    spec: SpeculativeDeploymentSpec,
    deployment: DeploymentView | None,
    pods: list[PodView],
    samples: Mapping[str, EngineSample],
    window: Window | None,
    previous: Mapping[str, Any],
    now: datetime.datetime,
    memory: MemoryCheck | None = None,
    compatibility: Compatibility | None = None,
) -> dict[str, Any]:
    """The whole status. `samples` is this tick's scrape of ready pods (by UID, maybe empty), `window`
    the rates since the previous scrape (None when there was no scrape or no earlier sample), `memory` the
    fit check of the current spec and `compatibility` its config checks (the Compatible condition; a spec
    that fails either is Failed whatever still runs: the operator applies nothing of it)."""
    desired = spec.replicas
    ready = deployment.ready_replicas if deployment else 0
    updated = deployment.updated_replicas if deployment else 0
    failing = sorted((p for p in pods if p.failure is not None), key=lambda p: p.name)
    rolled_out = (
        deployment is not None
        and deployment.observed_generation >= deployment.generation
        and updated >= desired
        and deployment.replicas == desired
    )
    metrics = _metrics(window, ready, previous, now)
    smoke_summary, smoke = _smoke_test(spec, pods, failing, samples, previous)
    phase, reason, message = _phase(spec, deployment, pods, failing, rolled_out, metrics.get("acceptanceLength"))
    if memory is not None and memory.blocks:
        phase, reason, message = "Failed", "DoesNotFit", memory.message
    if compatibility is not None and compatibility.blocks:
        phase, reason, message = "Failed", "Incompatible", compatibility.message
    blocked = reason in ("DoesNotFit", "Incompatible")
    counts = f"{ready}/{desired} replicas ready"

    if desired > 0 and ready >= desired and not blocked:
        serving: Outcome = ("True", "AllReplicasReady", counts)
    else:
        serving = ("False", reason, message)
    if blocked:
        progressing: Outcome = ("False", reason, message)
    elif deployment is not None and deployment.progress_deadline_exceeded:
        progressing = ("False", "ProgressDeadlineExceeded", message)
    elif rolled_out and ready >= desired:
        progressing = ("False", "RolloutComplete", counts)
    else:
        progressing = ("True", "RollingOut", f"{counts}; {updated} of {desired} run the current spec")
    if phase in ("Degraded", "Failed"):
        degraded: Outcome = ("True", reason, message)
    else:
        degraded = ("False", "AsExpected", counts)

    outcomes = [("Ready", serving), ("Progressing", progressing), ("SmokeTestPassed", smoke), ("Degraded", degraded)]
    if compatibility is not None:
        outcomes.append(("Compatible", compatibility.condition()))
    previous_conditions = previous.get("conditions") or []
    conditions = [set_condition(previous_conditions, type_, *outcome, generation, now) for type_, outcome in outcomes]
    return {
        "observedGeneration": generation,
        "phase": phase,
        "replicas": deployment.replicas if deployment else 0,
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "selector": selector_string(name),
        **metrics,
        "smokeTest": smoke_summary,
        **({"memoryPlan": memory.status()} if memory is not None else {}),
        "conditions": conditions,
    }


def status_patch(current: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """Top-level status keys whose value changed (None deletes a key in a merge patch); {} = no patch."""
    patch = {k: v for k, v in desired.items() if current.get(k) != v}
    patch.update({k: None for k in current if k not in desired and current[k] is not None})
    return patch
