"""The operator-wide engine defaults (DDTREE_ENGINE_DEFAULTS, set by the Helm chart) against the real control
plane: what they put into the engine pods, the KEDA provider of autoscaling, and a bad value stopping the
operator at start-up with one line."""

import json
import logging
import subprocess

import kubernetes
import pytest

from kube_testbed import operator_environment, start_operator, stop_operator, wait_for

DEFAULTS = {
    "imagePullSecrets": [{"name": "registry"}],
    "serviceAccountName": "engine",
    "podLabels": {"team": "llm"},
    "podAnnotations": {"example.com/owner": "inference"},
    "cache": {"sizeLimit": "100Gi"},
    "autoscalingProvider": "keda",
    "kedaPrometheusAddress": "http://127.0.0.1:9090",
}

SCALED_OBJECT_CRD = {  # just enough of KEDA's CRD to store ScaledObjects
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "scaledobjects.keda.sh"},
    "spec": {
        "group": "keda.sh",
        "scope": "Namespaced",
        "names": {"kind": "ScaledObject", "plural": "scaledobjects", "singular": "scaledobject"},
        "versions": [
            {
                "name": "v1alpha1",
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
            }
        ],
    },
}


@pytest.fixture(scope="module")
def operator_with_defaults(operator_kubeconfig):
    """The operator under kopf's test runner, with the chart's RBAC and DEFAULTS."""
    from kopf.testing import KopfRunner

    logging.getLogger("kopf").setLevel(logging.INFO)
    with pytest.MonkeyPatch.context() as env, operator_environment(operator_kubeconfig):
        env.setenv("DDTREE_ENGINE_DEFAULTS", json.dumps(DEFAULTS))
        with KopfRunner(
            ["run", "--standalone", "--all-namespaces", "-m", "ddtree_operator.handlers"], timeout=60
        ) as runner:
            yield runner
    assert runner.exception is None, f"operator crashed: {runner.exception!r}\n{runner.output[-4000:]}"
    assert "Traceback" not in runner.output, runner.output[-6000:]


def _patch_spec(cluster, namespace, name, patch):
    cluster.kubectl("patch", "specdeploy", name, "-n", namespace, "--type=merge", "-p", json.dumps({"spec": patch}))


@pytest.mark.usefixtures("operator_with_defaults")
def test_engine_defaults_reach_the_engine_pods(cluster, namespace):
    cluster.core.create_namespaced_service_account(namespace, {"metadata": {"name": "engine"}})
    cluster.apply_example(namespace, "smollm2-cpu.yaml")
    (pod,) = wait_for(lambda: cluster.engine_pods(namespace, "smollm2-cpu"), 60, "the engine pod")
    # The ReplicaSet made it, so the API server's admission took the service account and the rest.
    assert pod.spec.service_account_name == "engine"
    assert [s.name for s in pod.spec.image_pull_secrets] == ["registry"]
    assert pod.metadata.labels["team"] == "llm" and pod.metadata.labels["app.kubernetes.io/name"] == "ddtree-engine"
    assert pod.metadata.annotations["example.com/owner"] == "inference"
    (cache,) = [v for v in pod.spec.volumes if v.name == "cache"]
    assert cache.empty_dir.size_limit == "100Gi"
    assert pod.spec.containers[0].resources.requests["ephemeral-storage"] == "100Gi"

    # kwok's nodes declare no ephemeral storage, so the scheduler holds the pod for exactly that request.
    def unschedulable():
        current = cluster.core.read_namespaced_pod(pod.metadata.name, namespace)
        scheduled = next((c for c in current.status.conditions or [] if c.type == "PodScheduled"), None)
        return scheduled is not None and scheduled.status == "False" and scheduled.message

    assert "ephemeral-storage" in wait_for(unschedulable, 30, "the scheduler's verdict")


@pytest.mark.usefixtures("operator_with_defaults")
def test_keda_scaled_object_follows_the_spec(cluster, namespace):
    def scaled_objects():
        try:
            return cluster.custom.list_namespaced_custom_object("keda.sh", "v1alpha1", namespace, "scaledobjects")[
                "items"
            ]
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:  # no such API yet
                return []
            raise

    cluster.core.create_namespaced_service_account(namespace, {"metadata": {"name": "engine"}})
    # Without KEDA's API the engines still get their objects, and an Event says why there is no ScaledObject.
    cluster.apply_example(namespace, "smollm2-cpu.yaml", autoscaling={"maxReplicas": 4})

    def warned():
        events = cluster.core.list_namespaced_event(namespace).items
        return next((e for e in events if e.reason == "ScaledObjectUnavailable"), None)

    event = wait_for(warned, 30, "a ScaledObjectUnavailable Event")
    assert event.type == "Warning" and "keda.sh/v1alpha1" in event.message
    wait_for(lambda: cluster.engine_pods(namespace, "smollm2-cpu"), 30, "the engine pod")

    cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(SCALED_OBJECT_CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/scaledobjects.keda.sh")
    _patch_spec(cluster, namespace, "smollm2-cpu", {"autoscaling": {"maxReplicas": 4, "target": 1.5}})
    (scaled,) = wait_for(scaled_objects, 30, "the ScaledObject")
    assert (
        scaled["metadata"]["ownerReferences"][0]["uid"]
        == cluster.specdeploy(namespace, "smollm2-cpu")["metadata"]["uid"]
    )
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "ddtree.dev/v1alpha1",
        "kind": "SpeculativeDeployment",
        "name": "smollm2-cpu",
    }
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 4)
    (trigger,) = spec["triggers"]
    assert trigger["metadata"]["serverAddress"] == "http://127.0.0.1:9090" and trigger["metadata"]["threshold"] == "1.5"
    assert f'namespace="{namespace}"' in trigger["metadata"]["query"]
    assert not cluster.custom.list_namespaced_custom_object("autoscaling", "v2", namespace, "horizontalpodautoscalers")[
        "items"
    ], "the operator makes no HPA of its own with KEDA (KEDA makes one)"

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
    wait_for(lambda: not scaled_objects(), 30, "the ScaledObject deleted")


def test_bad_engine_defaults_stop_the_operator_with_one_line(cluster, operator_kubeconfig, tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_ENGINE_DEFAULTS", '{"nodeGPUs": 4}')
    log = tmp_path / "operator.log"
    process = start_operator(operator_kubeconfig, log)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        stop_operator(process)
        pytest.fail(f"the operator kept running with bad defaults:\n{log.read_text()[-3000:]}")
    assert process.returncode != 0
    assert "DDTREE_ENGINE_DEFAULTS has unknown keys ['nodeGPUs']; known keys: autoscalingProvider" in log.read_text()
