"""The operator (kopf.testing.KopfRunner, with the chart's RBAC) against the real control plane.

kwok runs the pods: they become Running/Ready without a container, on fake nodes with nvidia.com/gpu.
Where a test needs engine behaviour it plays kubelet (pod status patches) or serves /metrics on the pod
IP (127.1.x.y) itself; the real engine is exercised in test_e2e_engine.py.
"""

import datetime
import http.server
import json
import threading
import time

import kubernetes
import pytest
import yaml

from kube_testbed import ENGINE_IMAGE, EXAMPLES, OWNER_LABEL_KEY, wait_for

pytestmark = pytest.mark.usefixtures("operator")


def phase(cluster, namespace, name):
    return cluster.status(namespace, name).get("phase")


def wait_phase(cluster, namespace, name, expected, timeout=60):
    return wait_for(
        lambda: phase(cluster, namespace, name) == expected,
        timeout,
        f"{namespace}/{name} phase {expected} (status: {cluster.status(namespace, name)})",
    )


def owned_by(obj, cr) -> bool:
    refs = obj.metadata.owner_references or []
    return any(r.uid == cr["metadata"]["uid"] and r.controller and r.kind == "SpeculativeDeployment" for r in refs)


@pytest.mark.parametrize(
    "example, name, expected_phase, gpus",
    [
        ("smollm2-cpu.yaml", "smollm2-cpu", "Ready", None),
        ("qwen3-8b-ddtree.yaml", "qwen3-8b", "Ready", "1"),
        # Its model cache PVC does not exist here, so its 8-GPU pod cannot be scheduled.
        ("kimi-ddtree.yaml", "kimi-k2-6", "Pending", "8"),
    ],
)
def test_example_creates_owned_objects(cluster, namespace, example, name, expected_phase, gpus):
    cluster.apply_example(namespace, example)
    cr = cluster.specdeploy(namespace, name)
    deployment = wait_for(lambda: _read(cluster.apps.read_namespaced_deployment, name, namespace), 30, "Deployment")
    service = wait_for(lambda: _read(cluster.core.read_namespaced_service, name, namespace), 30, "Service")
    config_map = wait_for(lambda: _read(cluster.core.read_namespaced_config_map, name, namespace), 30, "ConfigMap")
    assert owned_by(deployment, cr) and owned_by(service, cr) and owned_by(config_map, cr)
    engine = deployment.spec.template.spec.containers[0]
    assert engine.image == ENGINE_IMAGE and engine.command == ["ddtree", "serve"]
    assert (engine.resources.limits or {}).get("nvidia.com/gpu") == gpus
    wait_phase(cluster, namespace, name, expected_phase)
    pods = cluster.engine_pods(namespace, name)
    assert len(pods) == 1
    (replica_set,) = cluster.apps.list_namespaced_replica_set(namespace).items
    assert replica_set.metadata.owner_references[0].uid == deployment.metadata.uid  # the chain GC follows
    if expected_phase == "Ready":
        assert pods[0].status.phase == "Running" and pods[0].status.pod_ip.startswith("127.1.")
        if gpus:
            assert pods[0].spec.node_name == "gpu-node-0"
        status = cluster.status(namespace, name)
        assert status["readyReplicas"] == 1 and status["observedGeneration"] == cr["metadata"]["generation"]
        assert cluster.get_row(namespace, name)["PHASE"] == "Ready"
    else:
        assert pods[0].status.phase == "Pending"
        wait_for(
            lambda: cluster.condition(namespace, name, "Ready").get("reason") == "WaitingForPods",
            30,
            "Ready=False WaitingForPods",
        )


def _read(read, name, namespace):
    try:
        return read(name, namespace)
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def test_kubectl_scale(cluster, namespace):
    cluster.apply_example(namespace, "smollm2-cpu.yaml")
    wait_phase(cluster, namespace, "smollm2-cpu", "Ready")
    cluster.kubectl("scale", "specdeploy", "smollm2-cpu", "-n", namespace, "--replicas=3")
    wait_for(lambda: cluster.status(namespace, "smollm2-cpu").get("readyReplicas") == 3, 60, "3 ready replicas")
    wait_phase(cluster, namespace, "smollm2-cpu", "Ready")
    assert cluster.apps.read_namespaced_deployment("smollm2-cpu", namespace).spec.replicas == 3
    assert cluster.get_row(namespace, "smollm2-cpu")["READY"] == "3"
    path = f"/apis/ddtree.dev/v1alpha1/namespaces/{namespace}/speculativedeployments/smollm2-cpu/scale"
    scale = json.loads(cluster.kubectl("get", "--raw", path).stdout)
    assert scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == f"app.kubernetes.io/name=ddtree-engine,{OWNER_LABEL_KEY}=smollm2-cpu"

    cluster.kubectl("scale", "specdeploy", "smollm2-cpu", "-n", namespace, "--replicas=0")
    wait_for(lambda: not cluster.engine_pods(namespace, "smollm2-cpu"), 60, "pods gone after scaling to 0")
    wait_for(
        lambda: cluster.condition(namespace, "smollm2-cpu", "Ready").get("reason") == "ScaledToZero",
        30,
        "Ready=False ScaledToZero",
    )


def test_spec_change_rolls_the_pods(cluster, namespace):
    cluster.apply_example(namespace, "smollm2-cpu.yaml")
    wait_phase(cluster, namespace, "smollm2-cpu", "Ready")
    (old_pod,) = cluster.engine_pods(namespace, "smollm2-cpu")
    cluster.kubectl(
        "patch",
        "specdeploy",
        "smollm2-cpu",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"speculation": {"budget": 16}}}),
    )

    def rolled():
        pods = [p for p in cluster.engine_pods(namespace, "smollm2-cpu") if not p.metadata.deletion_timestamp]
        return len(pods) == 1 and pods[0].metadata.name != old_pod.metadata.name and pods[0]

    wait_for(rolled, 60, "the pod replaced")
    config = yaml.safe_load(cluster.core.read_namespaced_config_map("smollm2-cpu", namespace).data["engine.yaml"])
    assert config["speculation"]["budget"] == 16
    wait_for(
        lambda: (
            cluster.status(namespace, "smollm2-cpu").get("observedGeneration") == 2
            and phase(cluster, namespace, "smollm2-cpu") == "Ready"
        ),
        60,
        "Ready at generation 2",
    )
    assert cluster.get_row(namespace, "smollm2-cpu")["BUDGET"] == "16"


def kubelet_reports_crash(cluster, namespace, pod_name, message):
    """What the kubelet writes after the engine exited non-zero with `message` in its termination log."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    cluster.core.patch_namespaced_pod_status(
        pod_name,
        namespace,
        {
            "status": {
                "conditions": [
                    {"type": "Ready", "status": "False", "lastTransitionTime": now},
                    {"type": "ContainersReady", "status": "False", "lastTransitionTime": now},
                ],
                "containerStatuses": [
                    {
                        "name": "engine",
                        "ready": False,
                        "restartCount": 1,
                        "image": ENGINE_IMAGE,
                        "imageID": "",
                        "started": False,
                        "state": {
                            "running": None,
                            "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"},
                        },
                        "lastState": {
                            "terminated": {
                                "exitCode": 3,
                                "reason": "Error",
                                "message": message,
                                "startedAt": now,
                                "finishedAt": now,
                            }
                        },
                    }
                ],
            }
        },
    )


def test_smoke_test_failure_surfaces_as_condition_and_event(cluster, namespace):
    reason = "smoke test failed: speculative output differs from the target at token 17"
    cluster.apply_example(namespace, "smollm2-cpu.yaml")
    wait_phase(cluster, namespace, "smollm2-cpu", "Ready")
    (pod,) = cluster.engine_pods(namespace, "smollm2-cpu")
    kubelet_reports_crash(cluster, namespace, pod.metadata.name, reason + "\n")

    condition = wait_for(
        lambda: (c := cluster.condition(namespace, "smollm2-cpu", "SmokeTestPassed")).get("status") == "False" and c,
        30,
        "SmokeTestPassed=False",
    )
    assert condition["reason"] == "SmokeTestFailed"
    assert condition["message"] == f"pod {pod.metadata.name} exited with code 3: {reason}"
    wait_phase(cluster, namespace, "smollm2-cpu", "Failed")
    status = cluster.status(namespace, "smollm2-cpu")
    assert status["smokeTest"]["result"] == "Failed" and reason in status["smokeTest"]["message"]

    def event():
        events = cluster.core.list_namespaced_event(namespace).items
        return next(
            (e for e in events if e.involved_object.kind == "SpeculativeDeployment" and e.reason == "SmokeTestFailed"),
            None,
        )

    found = wait_for(event, 30, "a SmokeTestFailed Event")
    assert found.type == "Warning" and reason in found.message and found.involved_object.name == "smollm2-cpu"


def test_deleting_the_resource_removes_everything(cluster, namespace):
    cluster.apply_example(namespace, "smollm2-cpu.yaml", replicas=2)
    wait_phase(cluster, namespace, "smollm2-cpu", "Ready")
    cluster.kubectl("delete", "specdeploy", "smollm2-cpu", "-n", namespace, "--timeout=60s")

    def all_gone():
        return not (
            cluster.apps.list_namespaced_deployment(namespace).items
            or cluster.apps.list_namespaced_replica_set(namespace).items
            or cluster.engine_pods(namespace, "smollm2-cpu")
            or [s for s in cluster.core.list_namespaced_service(namespace).items]
        )

    wait_for(all_gone, 90, "Deployment, ReplicaSets, pods and Service garbage-collected")


def test_a_deleted_child_is_recreated(cluster, namespace):
    cluster.apply_example(namespace, "smollm2-cpu.yaml")
    wait_phase(cluster, namespace, "smollm2-cpu", "Ready")
    old_uid = cluster.apps.read_namespaced_deployment("smollm2-cpu", namespace).metadata.uid
    cluster.kubectl("delete", "deployment", "smollm2-cpu", "-n", namespace)
    recreated = wait_for(
        lambda: (
            (d := _read(cluster.apps.read_namespaced_deployment, "smollm2-cpu", namespace))
            and d.metadata.uid != old_uid
            and d
        ),
        30,
        "the Deployment recreated",
    )
    assert owned_by(recreated, cluster.specdeploy(namespace, "smollm2-cpu"))
    wait_phase(cluster, namespace, "smollm2-cpu", "Ready")


def test_status_is_not_rewritten_when_nothing_changes(cluster, namespace):
    cluster.apply_example(namespace, "smollm2-cpu.yaml")
    wait_phase(cluster, namespace, "smollm2-cpu", "Ready")
    time.sleep(6)  # let the last transitions settle
    before = cluster.specdeploy(namespace, "smollm2-cpu")["metadata"]["resourceVersion"]
    time.sleep(12)  # more than two status ticks
    assert cluster.specdeploy(namespace, "smollm2-cpu")["metadata"]["resourceVersion"] == before


class FakeEngineMetrics:
    """Serves engine-shaped /metrics on a pod IP: per second 10 drafts, 25 accepted, 35 generated tokens."""

    def __init__(self, ip: str, port: int):
        started = time.monotonic()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's naming)
                t = time.monotonic() - started
                body = (
                    f'ddtree_spec_decode_num_drafts_total{{model="m"}} {10 * t}\n'
                    f'ddtree_spec_decode_num_accepted_tokens_total{{model="m"}} {25 * t}\n'
                    f'ddtree_generation_tokens_total{{model="m"}} {35 * t}\n'
                    f'ddtree_smoke_test_passed{{model="m"}} 1\n'
                    f'ddtree_graph_capture_seconds{{model="m"}} 3.5\n'
                ).encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer((ip, port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_scraped_metrics_fill_acceptance_and_throughput(cluster, namespace):
    cluster.apply_example(namespace, "smollm2-cpu.yaml", replicas=2)
    wait_for(lambda: cluster.status(namespace, "smollm2-cpu").get("readyReplicas") == 2, 60, "2 ready replicas")
    servers = [FakeEngineMetrics(p.status.pod_ip, 8000) for p in cluster.engine_pods(namespace, "smollm2-cpu")]
    try:
        status = wait_for(
            lambda: (s := cluster.status(namespace, "smollm2-cpu")).get("throughputTokensPerSecond") and s,
            60,
            "throughput in status",
        )
        assert status["acceptanceLength"] == pytest.approx(3.5, abs=0.05)  # 1 + 25/10
        assert status["throughputTokensPerSecond"] == pytest.approx(70, rel=0.1)  # 35 tok/s x 2 replicas
        assert status["smokeTest"]["graphCaptureSeconds"] == 3.5
        row = cluster.get_row(namespace, "smollm2-cpu")
        assert float(row["ACCLEN"]) == pytest.approx(3.5, abs=0.05)
        assert float(row["TOK/S"]) == pytest.approx(70, rel=0.1)
    finally:
        for server in servers:
            server.close()


POD_MONITOR_CRD = {  # just enough of the Prometheus operator's CRD to store PodMonitors
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "podmonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {
            "kind": "PodMonitor",
            "plural": "podmonitors",
            "singular": "podmonitor",
            "listKind": "PodMonitorList",
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
            }
        ],
    },
}


def test_pod_monitor_follows_the_spec(cluster, namespace):
    def pod_monitors():
        return cluster.custom.list_namespaced_custom_object("monitoring.coreos.com", "v1", namespace, "podmonitors")[
            "items"
        ]

    def set_pod_monitor(enabled: bool):
        cluster.kubectl(
            "patch",
            "specdeploy",
            "smollm2-cpu",
            "-n",
            namespace,
            "--type=merge",
            "-p",
            json.dumps({"spec": {"metrics": {"podMonitor": enabled}}}),
        )

    # Without the Prometheus operator's API the engines still run, and an Event says why there is none.
    cluster.apply_example(namespace, "smollm2-cpu.yaml")
    set_pod_monitor(True)

    def warned():
        return any(e.reason == "PodMonitorUnavailable" for e in cluster.core.list_namespaced_event(namespace).items)

    wait_for(warned, 30, "a PodMonitorUnavailable Event")
    wait_phase(cluster, namespace, "smollm2-cpu", "Ready")

    cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(POD_MONITOR_CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/podmonitors.monitoring.coreos.com")
    cluster.kubectl(
        "patch",
        "specdeploy",
        "smollm2-cpu",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"metrics": {"scrapeIntervalSeconds": 10}}}),
    )
    (monitor,) = wait_for(pod_monitors, 30, "the PodMonitor")
    owner_uid = cluster.specdeploy(namespace, "smollm2-cpu")["metadata"]["uid"]
    assert monitor["metadata"]["ownerReferences"][0]["uid"] == owner_uid
    assert monitor["spec"]["podMetricsEndpoints"] == [{"port": "http", "path": "/metrics", "interval": "10s"}]

    set_pod_monitor(False)
    wait_for(lambda: not pod_monitors(), 30, "the PodMonitor deleted")


def test_applying_into_a_namespace_that_is_gone_is_a_temporary_error(cluster):
    """A status tick can run after the resource's namespace is deleted and before the watch sees it: the
    apply then gets 404 for the namespace. That is a temporary error (logged in one line, retried, then
    dropped with the resource), not a crash with a traceback in the operator's log."""
    import kopf

    from ddtree_operator import api, handlers
    from ddtree_operator.render import EngineDefaults, Owner

    spec = yaml.safe_load((EXAMPLES / "smollm2-cpu.yaml").read_text())["spec"]
    memo = kopf.Memo(api=cluster.api, defaults=EngineDefaults(image=ENGINE_IMAGE, image_pull_policy="IfNotPresent"))
    owner = Owner("smollm2-cpu", "t-gone-0000", "0")
    with pytest.raises(kopf.TemporaryError, match="namespace t-gone-0000 is gone"):
        handlers.apply_children(memo, owner, api.SpeculativeDeploymentSpec.model_validate(spec), None, body={})


def test_several_replicas_get_a_pod_disruption_budget(cluster, namespace):
    policy = kubernetes.client.PolicyV1Api(cluster.api)

    def budget():
        return _read(policy.read_namespaced_pod_disruption_budget, "smollm2-cpu", namespace)

    cluster.apply_example(namespace, "smollm2-cpu.yaml", replicas=2)
    wait_for(lambda: cluster.status(namespace, "smollm2-cpu").get("readyReplicas") == 2, 60, "2 ready replicas")
    created = wait_for(budget, 30, "the PodDisruptionBudget")
    assert owned_by(created, cluster.specdeploy(namespace, "smollm2-cpu"))
    assert created.spec.max_unavailable == 1
    # the disruption controller finds the engine pods through its selector: one of two may be evicted
    found = wait_for(
        lambda: (b := budget()).status and b.status.expected_pods == 2 and b.status.disruptions_allowed == 1 and b,
        60,
        "the budget to cover both engine pods",
    )
    assert found.status.current_healthy == 2

    cluster.kubectl("scale", "specdeploy", "smollm2-cpu", "-n", namespace, "--replicas=1")
    wait_for(lambda: budget() is None, 30, "the PodDisruptionBudget deleted at one replica")


def test_autoscaling_drives_the_resource_through_its_scale_subresource(cluster, namespace):
    autoscaling = kubernetes.client.AutoscalingV2Api(cluster.api)

    def hpa():
        return _read(autoscaling.read_namespaced_horizontal_pod_autoscaler, "smollm2-cpu", namespace)

    cluster.apply_example(namespace, "smollm2-cpu.yaml", autoscaling={"minReplicas": 1, "maxReplicas": 3})
    created = wait_for(hpa, 30, "the HorizontalPodAutoscaler")
    assert owned_by(created, cluster.specdeploy(namespace, "smollm2-cpu"))
    ref = created.spec.scale_target_ref
    assert (ref.api_version, ref.kind, ref.name) == ("ddtree.dev/v1alpha1", "SpeculativeDeployment", "smollm2-cpu")
    assert (created.spec.min_replicas, created.spec.max_replicas) == (1, 3)
    (metric,) = created.spec.metrics
    assert metric.pods.metric.name == "ddtree_load" and metric.pods.target.average_value == "800m"
    wait_phase(cluster, namespace, "smollm2-cpu", "Ready")
    path = f"/apis/ddtree.dev/v1alpha1/namespaces/{namespace}/speculativedeployments/smollm2-cpu/scale"
    scale = json.loads(cluster.kubectl("get", "--raw", path).stdout)
    assert scale["spec"]["replicas"] == 1 and scale["status"]["selector"].endswith("=smollm2-cpu")

    # The controller-manager's HPA controller read the resource's scale (AbleToScale); without a custom
    # metrics API here it then cannot get ddtree_load, and says so.
    def conditions():
        current = hpa()
        return {c.type: c for c in (current.status.conditions or [])} if current and current.status else {}

    able = wait_for(lambda: conditions().get("AbleToScale"), 60, "the HPA's AbleToScale condition")
    assert (able.status, able.reason) == ("True", "SucceededGetScale"), able
    active = wait_for(lambda: conditions().get("ScalingActive"), 60, "the HPA's ScalingActive condition")
    assert active.status == "False" and "ddtree_load" in active.message, active

    # What the HPA does when it scales: write spec.replicas through the scale subresource; the operator
    # renders the Deployment (and, above one replica, a PodDisruptionBudget) from it.
    cluster.kubectl("scale", "specdeploy", "smollm2-cpu", "-n", namespace, "--replicas=2")
    wait_for(lambda: cluster.status(namespace, "smollm2-cpu").get("readyReplicas") == 2, 60, "2 ready replicas")
    assert cluster.apps.read_namespaced_deployment("smollm2-cpu", namespace).spec.replicas == 2

    cluster.kubectl(
        "patch",
        "specdeploy",
        "smollm2-cpu",
        "-n",
        namespace,
        "--type=json",
        "-p",
        json.dumps([{"op": "remove", "path": "/spec/autoscaling"}]),
    )
    wait_for(lambda: hpa() is None, 30, "the HorizontalPodAutoscaler deleted")


def test_an_hpa_the_resource_does_not_own_is_left_alone(cluster, namespace):
    """Before spec.autoscaling, users pointed their own HPA at the scale subresource, often under the
    resource's name: the operator deletes only the HPA it made itself."""
    autoscaling = kubernetes.client.AutoscalingV2Api(cluster.api)
    ref = {"apiVersion": "ddtree.dev/v1alpha1", "kind": "SpeculativeDeployment", "name": "smollm2-cpu"}
    autoscaling.create_namespaced_horizontal_pod_autoscaler(
        namespace,
        {
            "metadata": {"name": "smollm2-cpu"},
            "spec": {
                "scaleTargetRef": ref,
                "maxReplicas": 2,
                "metrics": [
                    {
                        "type": "Resource",
                        "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}},
                    }
                ],
            },
        },
    )
    cluster.apply_example(namespace, "smollm2-cpu.yaml")
    wait_phase(cluster, namespace, "smollm2-cpu", "Ready")  # applied and pruned long before
    kept = autoscaling.read_namespaced_horizontal_pod_autoscaler("smollm2-cpu", namespace)
    assert kept.spec.metrics[0].resource.name == "cpu" and not kept.metadata.owner_references
