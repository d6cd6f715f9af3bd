"""Status computation from sample metrics text, pods and Deployment state (pure functions)."""

import datetime

import pytest

from ddtree_operator.api import SpeculativeDeploymentSpec
from ddtree_operator.fit import MemoryCheck
from ddtree_operator.metrics import EngineSample, parse_engine_metrics, window
from ddtree_operator.status import (
    DeploymentView,
    Failure,
    PodView,
    compute_status,
    pod_view,
    set_condition,
    status_patch,
)
from invalid_specs import VALID

T0 = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.timezone.utc)

METRICS = """\
# HELP ddtree_spec_decode_num_drafts_total Draft steps.
# TYPE ddtree_spec_decode_num_drafts_total counter
ddtree_spec_decode_num_drafts_total{model="a"} 100.0
ddtree_spec_decode_num_drafts_total{model="b"} 50.0
# HELP ddtree_spec_decode_num_draft_tokens_total Draft tokens.
# TYPE ddtree_spec_decode_num_draft_tokens_total counter
ddtree_spec_decode_num_draft_tokens_total{model="a"} 3200.0
# HELP ddtree_spec_decode_num_accepted_tokens_total Accepted draft tokens.
# TYPE ddtree_spec_decode_num_accepted_tokens_total counter
ddtree_spec_decode_num_accepted_tokens_total{model="a"} 250.0
ddtree_spec_decode_num_accepted_tokens_total{model="b"} 50.0
# HELP ddtree_generation_tokens_total Generated tokens.
# TYPE ddtree_generation_tokens_total counter
ddtree_generation_tokens_total{model="a"} 1000.0
ddtree_generation_tokens_created{model="a"} 1.7e9
# HELP ddtree_smoke_test_passed Smoke test.
# TYPE ddtree_smoke_test_passed gauge
ddtree_smoke_test_passed{model="a"} 1.0
# HELP ddtree_graph_capture_seconds Capture time.
# TYPE ddtree_graph_capture_seconds gauge
ddtree_graph_capture_seconds{model="a"} 12.5
# HELP ddtree_acceptance_length Accepted per step.
# TYPE ddtree_acceptance_length histogram
ddtree_acceptance_length_bucket{model="a",le="1.0"} 3.0
ddtree_acceptance_length_bucket{model="a",le="+Inf"} 150.0
ddtree_acceptance_length_count{model="a"} 150.0
ddtree_acceptance_length_sum{model="a"} 450.0
"""


def sample(t, drafts, accepted, generated, **gauges):
    return EngineSample(time=t, drafts=drafts, accepted=accepted, generated=generated, **gauges)


def test_parse_engine_metrics_sums_over_models():
    s = parse_engine_metrics(METRICS, time=5.0)
    assert (s.drafts, s.accepted, s.generated) == (150.0, 300.0, 1000.0)
    assert s.smoke_test_passed is True and s.graph_capture_seconds == 12.5 and s.time == 5.0


def test_parse_engine_metrics_names_what_is_missing():
    with pytest.raises(ValueError, match="ddtree_generation_tokens_total"):
        parse_engine_metrics(
            "ddtree_spec_decode_num_drafts_total 1\nddtree_spec_decode_num_accepted_tokens_total 1\n", time=0
        )


def test_window_acceptance_and_throughput_over_replicas():
    before = {"a": sample(10, 100, 200, 1000), "b": sample(11, 10, 10, 100)}
    after = {"a": sample(20, 150, 350, 1500), "b": sample(21, 60, 110, 300)}
    w = window(before, after)
    # accepted: 150 + 100 over drafts 50 + 50 -> 1 + 250/100; tokens/s: 500/10 + 200/10
    assert w.acceptance_length == pytest.approx(3.5)
    assert w.tokens_per_second == pytest.approx(70.0)


def test_window_skips_new_and_restarted_pods():
    before = {"a": sample(10, 100, 200, 1000), "restarted": sample(10, 500, 500, 500)}
    after = {"a": sample(20, 110, 220, 1100), "restarted": sample(20, 5, 5, 5), "new": sample(20, 9, 9, 9)}
    w = window(before, after)
    assert w.acceptance_length == pytest.approx(3.0) and w.tokens_per_second == pytest.approx(10.0)


def test_window_without_history_or_drafts():
    assert window({}, {"a": sample(1, 0, 0, 0)}) is None
    idle = window({"a": sample(1, 5, 5, 5)}, {"a": sample(2, 5, 5, 5)})
    assert idle.acceptance_length is None and idle.tokens_per_second == 0.0


# ---- compute_status -------------------------------------------------------------------------


def spec(**overrides):
    return SpeculativeDeploymentSpec.model_validate({**VALID, **overrides})


def deployment(replicas=1, ready=1, updated=None, generation=1, observed=1, deadline=False):
    return DeploymentView(
        generation=generation,
        observed_generation=observed,
        replicas=replicas,
        ready_replicas=ready,
        updated_replicas=replicas if updated is None else updated,
        progress_deadline_exceeded=deadline,
    )


def pod(name="p0", ready=True, running=True, failure=None, ip="127.1.0.5"):
    return PodView(name=name, uid=f"uid-{name}", ip=ip, ready=ready, running=running, failure=failure)


SMOKE_FAILURE = Failure(
    exit_code=3, reason="Error", message="smoke test failed: CUDA graph capture for batch 4 fell back to eager"
)


def status(previous=None, now=T0, **kwargs):
    args = dict(
        name="demo",
        generation=1,
        spec=spec(),
        deployment=deployment(),
        pods=[pod()],
        samples={},
        window=None,
        previous=previous or {},
        now=now,
    )
    args.update(kwargs)
    return compute_status(**args)


def conditions(s):
    return {c["type"]: (c["status"], c["reason"]) for c in s["conditions"]}


def test_all_ready():
    s = status()
    assert s["phase"] == "Ready" and s["readyReplicas"] == 1 and s["replicas"] == 1 and s["observedGeneration"] == 1
    assert s["selector"] == "app.kubernetes.io/name=ddtree-engine,ddtree.dev/speculativedeployment=demo"
    assert conditions(s) == {
        "Ready": ("True", "AllReplicasReady"),
        "Progressing": ("False", "RolloutComplete"),
        "SmokeTestPassed": ("True", "SmokeTestPassed"),
        "Degraded": ("False", "AsExpected"),
    }
    assert s["smokeTest"] == {"result": "Passed", "passedReplicas": 1}
    assert "acceptanceLength" not in s and "throughputTokensPerSecond" not in s


def test_no_deployment_yet_is_pending():
    s = status(deployment=None, pods=[])
    assert s["phase"] == "Pending" and conditions(s)["Ready"] == ("False", "DeploymentMissing")


TOO_BIG = MemoryCheck("DoesNotFit", "needs 557.51 GiB per GPU, 416.51 GiB over the 141.00 GiB of each of 1 GPU(s)")


def test_a_spec_that_does_not_fit_fails_with_the_plans_reason():
    s = status(deployment=None, pods=[], memory=TOO_BIG)
    assert s["phase"] == "Failed"
    assert conditions(s)["Ready"] == ("False", "DoesNotFit")
    assert conditions(s)["Progressing"] == ("False", "DoesNotFit")
    assert conditions(s)["Degraded"] == ("True", "DoesNotFit")
    ready = next(c for c in s["conditions"] if c["type"] == "Ready")
    assert ready["message"] == TOO_BIG.message
    assert s["memoryPlan"] == {"result": "DoesNotFit", "message": TOO_BIG.message}


def test_a_spec_that_does_not_fit_is_not_ready_while_the_previous_pods_still_serve():
    # the operator leaves the Deployment at its last fitting spec; the resource's spec is not served
    s = status(memory=TOO_BIG)
    assert s["phase"] == "Failed" and conditions(s)["Ready"] == ("False", "DoesNotFit")
    assert s["readyReplicas"] == 1


def test_a_skipped_or_passed_fit_check_only_reports_itself():
    skipped = MemoryCheck("Skipped", "memory plan skipped: spec.resources.gpuMemory is not set")
    fits = MemoryCheck("Fits", "75.06 GiB of 141.00 GiB per GPU", {"kv_cache": 1, "reserve": 2}, 127878)
    assert status(memory=skipped)["memoryPlan"] == {"result": "Skipped", "message": skipped.message}
    s = status(memory=fits)
    assert s["phase"] == "Ready" and conditions(s)["Ready"] == ("True", "AllReplicasReady")
    assert s["memoryPlan"] == {
        "result": "Fits",
        "message": fits.message,
        "perRankBytes": {"kv_cache": 1, "reserve": 2},
        "maxContextThatFits": 127878,
    }
    assert "memoryPlan" not in status()


def test_loading_while_engines_start():
    s = status(deployment=deployment(ready=0), pods=[pod(ready=False)])
    assert s["phase"] == "Loading"
    assert conditions(s)["Ready"] == ("False", "EnginesLoading")
    assert conditions(s)["Progressing"][0] == "True"
    assert conditions(s)["SmokeTestPassed"] == ("Unknown", "Waiting")


def test_unscheduled_pods_are_pending():
    s = status(deployment=deployment(ready=0), pods=[pod(ready=False, running=False, ip=None)])
    assert s["phase"] == "Pending" and conditions(s)["Ready"] == ("False", "WaitingForPods")


def test_smoke_test_failure_without_ready_replicas_fails_with_the_engines_reason():
    s = status(deployment=deployment(ready=0), pods=[pod(ready=False, failure=SMOKE_FAILURE)])
    assert s["phase"] == "Failed"
    smoke = next(c for c in s["conditions"] if c["type"] == "SmokeTestPassed")
    assert (smoke["status"], smoke["reason"]) == ("False", "SmokeTestFailed")
    assert "CUDA graph capture for batch 4 fell back to eager" in smoke["message"] and "p0" in smoke["message"]
    assert s["smokeTest"]["result"] == "Failed" and s["smokeTest"]["message"] == smoke["message"]
    assert conditions(s)["Degraded"] == ("True", "EngineFailed")


def test_one_failing_replica_of_two_is_degraded():
    s = status(
        spec=spec(replicas=2),
        deployment=deployment(replicas=2, ready=1),
        pods=[pod("p0"), pod("p1", ready=False, failure=Failure(137, "OOMKilled", ""))],
    )
    assert s["phase"] == "Degraded"
    assert conditions(s)["SmokeTestPassed"] == ("False", "OOMKilled")
    assert "OOMKilled without a termination message" in s["smokeTest"]["message"]


def test_progress_deadline_exceeded_fails():
    s = status(deployment=deployment(ready=0, deadline=True), pods=[pod(ready=False)])
    assert s["phase"] == "Failed"
    assert conditions(s)["Progressing"] == ("False", "ProgressDeadlineExceeded")


def test_rollout_in_progress_keeps_serving_but_progresses():
    s = status(
        spec=spec(replicas=1),
        generation=2,
        deployment=deployment(replicas=2, ready=1, updated=1),
        pods=[pod("old"), pod("new", ready=False)],
    )
    assert s["phase"] == "Loading" and s["observedGeneration"] == 2
    assert conditions(s)["Ready"][0] == "True"  # the old replica still serves
    assert conditions(s)["Progressing"] == ("True", "RollingOut")


def test_scaled_to_zero():
    s = status(spec=spec(replicas=0), deployment=deployment(replicas=0, ready=0), pods=[])
    assert s["phase"] == "Pending" and conditions(s)["Ready"] == ("False", "ScaledToZero")


def test_metrics_window_fills_status_and_low_acceptance_degrades():
    from ddtree_operator.metrics import Window

    s = status(
        spec=spec(readiness={"minAcceptanceLength": 2.5}),
        window=Window(acceptance_length=2.3456, tokens_per_second=123.456),
        samples={"uid-p0": sample(1, 0, 0, 0, smoke_test_passed=True, graph_capture_seconds=7.25)},
    )
    assert (s["acceptanceLength"], s["throughputTokensPerSecond"]) == (2.35, 123.5)
    assert s["lastScrapeTime"] == "2026-01-01T12:00:00Z"
    assert s["smokeTest"]["graphCaptureSeconds"] == 7.25
    assert s["phase"] == "Degraded" and conditions(s)["Degraded"] == ("True", "LowAcceptance")


def test_idle_window_keeps_the_last_acceptance_length():
    from ddtree_operator.metrics import Window

    first = status(window=Window(acceptance_length=3.0, tokens_per_second=50.0))
    later = status(
        previous=first,
        now=T0 + datetime.timedelta(seconds=30),
        window=Window(acceptance_length=None, tokens_per_second=0.0),
    )
    assert later["acceptanceLength"] == 3.0 and later["throughputTokensPerSecond"] == 0.0
    assert later["lastScrapeTime"] == "2026-01-01T12:00:30Z"


def test_unchanged_world_means_no_patch():
    from ddtree_operator.metrics import Window

    first = status(window=Window(acceptance_length=3.0, tokens_per_second=50.0))
    again = status(
        previous=first,
        now=T0 + datetime.timedelta(minutes=5),
        window=Window(acceptance_length=3.0, tokens_per_second=50.0),
    )
    assert status_patch(first, again) == {}
    assert status_patch(first, status(previous=first, now=T0 + datetime.timedelta(minutes=5))) == {}


def test_throughput_drops_to_zero_when_nothing_is_ready():
    from ddtree_operator.metrics import Window

    first = status(window=Window(acceptance_length=3.0, tokens_per_second=50.0))
    gone = status(previous=first, deployment=deployment(ready=0), pods=[pod(ready=False)])
    assert gone["throughputTokensPerSecond"] == 0.0 and gone["acceptanceLength"] == 3.0


def test_smoke_test_disabled():
    s = status(spec=spec(readiness={"smokeTest": False}))
    assert s["smokeTest"] == {"result": "Disabled"}
    assert conditions(s)["SmokeTestPassed"] == ("Unknown", "SmokeTestDisabled")


def test_last_transition_time_moves_only_when_status_flips():
    first = set_condition([], "Ready", "False", "EnginesLoading", "0/1", 1, T0)
    same = set_condition([first], "Ready", "False", "WaitingForPods", "0/1", 1, T0 + datetime.timedelta(minutes=1))
    flipped = set_condition([same], "Ready", "True", "AllReplicasReady", "1/1", 1, T0 + datetime.timedelta(minutes=2))
    assert same["lastTransitionTime"] == first["lastTransitionTime"] == "2026-01-01T12:00:00Z"
    assert flipped["lastTransitionTime"] == "2026-01-01T12:02:00Z"


def test_status_patch_only_changed_keys_and_deletions():
    assert status_patch({"a": 1, "b": 2, "gone": 3}, {"a": 1, "b": 5}) == {"b": 5, "gone": None}


def test_pod_view_reads_kubelet_state():
    crashed = {
        "metadata": {"name": "p", "uid": "u"},
        "status": {
            "phase": "Running",
            "podIP": "127.1.0.9",
            "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [
                {
                    "name": "engine",
                    "ready": False,
                    "restartCount": 2,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {
                        "terminated": {
                            "exitCode": 3,
                            "reason": "Error",
                            "message": "smoke test failed: output differs from target\n",
                        }
                    },
                }
            ],
        },
    }
    view = pod_view(crashed)
    assert (view.ip, view.ready, view.running) == ("127.1.0.9", False, True)
    assert view.failure == Failure(3, "Error", "smoke test failed: output differs from target")
    recovered = {**crashed, "status": {**crashed["status"], "conditions": [{"type": "Ready", "status": "True"}]}}
    assert pod_view(recovered).failure is None and pod_view(recovered).ready
