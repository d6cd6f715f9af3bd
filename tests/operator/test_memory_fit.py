"""The new spec fields and the fit check, with the operator against the real control plane.

A fake hub on 127.0.0.1 (the operator's HF_ENDPOINT) serves the published Kimi K2.6 config.json: on one
141Gi GPU the model does not fit (Ready=False DoesNotFit, an Event, no objects), on eight it does.
"""

import json
import pathlib
import time

import pytest
import yaml

from ddtree.models.memory import plan_memory
from kube_testbed import FakeHub, environment, wait_for

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "data" / "model_configs"
KIMI = json.loads((CONFIGS / "kimi-k2.6.json").read_text())
KIMI_PATH = "/moonshotai/Kimi-K2.6/resolve/main/config.json"


@pytest.fixture(scope="module", autouse=True)
def hub():
    """Set before the module's operator starts (autouse fixtures come first): it reads HF_ENDPOINT at startup."""
    hub = FakeHub({KIMI_PATH: (KIMI, 0.0)})
    try:
        with environment(HF_ENDPOINT=hub.endpoint):
            yield hub
    finally:
        hub.close()


pytestmark = pytest.mark.usefixtures("operator")


def apply(cluster, namespace, name, spec):
    doc = {"apiVersion": "ddtree.dev/v1alpha1", "kind": "SpeculativeDeployment", "metadata": {"name": name}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps({**doc, "spec": spec}))


def patch(cluster, namespace, name, spec):
    cluster.kubectl("patch", "specdeploy", name, "-n", namespace, "--type=merge", "-p", json.dumps({"spec": spec}))


def read(read_fn, name, namespace):
    import kubernetes

    try:
        return read_fn(name, namespace)
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def deployment(cluster, namespace, name, timeout=30):
    return wait_for(lambda: read(cluster.apps.read_namespaced_deployment, name, namespace), timeout, "Deployment")


def memory_plan(cluster, namespace, name, result, timeout=30):
    return wait_for(
        lambda: (p := cluster.status(namespace, name).get("memoryPlan") or {}).get("result") == result and p,
        timeout,
        f"memoryPlan {result} (status: {cluster.status(namespace, name)})",
    )


def test_new_fields_are_stored_and_rendered(cluster, namespace):
    apply(
        cluster,
        namespace,
        "fields",
        {
            "model": {"uri": "smollm2-135m-instruct", "trustRemoteCode": True},
            "drafter": {"uri": "smollm2-135m-instruct-dflash"},
            "parallelism": {"tensor": 3, "expert": 1},  # 3 divides SmolLM2's heads (the config checks)
            "engine": {"maxSeqLen": 4096},
            "resources": {"gpus": 3, "gpuMemory": "80Gi"},
            "rollout": {"maxSurge": "50%", "maxUnavailable": 0},
        },
    )
    stored = cluster.specdeploy(namespace, "fields")["spec"]
    assert stored["model"]["trustRemoteCode"] is True and stored["parallelism"]["expert"] == 1
    assert stored["resources"]["gpuMemory"] == "80Gi" and stored["rollout"]["maxSurge"] == "50%"
    found = deployment(cluster, namespace, "fields")
    assert found.spec.strategy.rolling_update.max_surge == "50%"
    assert found.spec.strategy.rolling_update.max_unavailable == 0
    config = yaml.safe_load(cluster.core.read_namespaced_config_map("fields", namespace).data["engine.yaml"])
    assert config["model"]["trust_remote_code"] is True
    assert config["parallel"] == {"tensor_parallel": 3, "expert_parallel": 1}
    assert config["serving"]["max_seq_len"] == 4096
    plan = memory_plan(cluster, namespace, "fields", "Skipped")
    assert plan["message"] == "memory plan skipped: smollm2-135m-instruct is a built-in model, not a hub id"


def test_rollout_defaults_follow_the_replica_size(cluster, namespace):
    base = {"model": {"uri": "smollm2-135m-instruct"}, "speculation": {"method": "none"}}
    apply(cluster, namespace, "whole-node", {**base, "resources": {"gpus": 8}})
    apply(cluster, namespace, "one-gpu", {**base, "resources": {"gpus": 1}})
    whole = deployment(cluster, namespace, "whole-node").spec.strategy.rolling_update
    small = deployment(cluster, namespace, "one-gpu").spec.strategy.rolling_update
    assert (whole.max_surge, whole.max_unavailable) == (0, 1)  # no second node-sized hole for a surge pod
    assert (small.max_surge, small.max_unavailable) == (1, 0)  # capacity never drops


def kimi(tensor: int) -> dict:
    return {
        "model": {"uri": "hf://moonshotai/Kimi-K2.6", "trustRemoteCode": True},
        "speculation": {"method": "none"},
        "parallelism": {"tensor": tensor},
        "resources": {"gpus": tensor, "gpuMemory": "141Gi"},
    }


def test_kimi_does_not_fit_one_h200_and_gets_no_pods_then_fits_eight(cluster, namespace, hub):
    expected = plan_memory(KIMI, gpus=1, gpu_memory=141 << 30, max_context=2048, max_batch=8)
    assert not expected.fits
    apply(cluster, namespace, "kimi", kimi(1))

    ready = wait_for(
        lambda: (c := cluster.condition(namespace, "kimi", "Ready")).get("reason") == "DoesNotFit" and c,
        30,
        "Ready=False DoesNotFit",
    )
    assert ready["status"] == "False" and ready["message"] == expected.reason
    status = cluster.status(namespace, "kimi")
    assert status["phase"] == "Failed"
    assert status["memoryPlan"]["result"] == "DoesNotFit" and status["memoryPlan"]["message"] == expected.reason
    assert status["memoryPlan"]["perRankBytes"] == expected.per_rank_bytes

    def event():
        events = cluster.core.list_namespaced_event(namespace).items
        return next((e for e in events if e.reason == "DoesNotFit" and e.involved_object.name == "kimi"), None)

    found = wait_for(event, 30, "a DoesNotFit Event")
    assert found.type == "Warning" and found.message == expected.reason

    time.sleep(11)  # two status ticks: still nothing created, and the config fetched once
    assert read(cluster.apps.read_namespaced_deployment, "kimi", namespace) is None
    assert read(cluster.core.read_namespaced_config_map, "kimi", namespace) is None
    assert not cluster.engine_pods(namespace, "kimi")
    assert hub.requests.count(KIMI_PATH) == 1

    # Eight GPUs: the same model fits, the objects are created.
    patch(cluster, namespace, "kimi", kimi(8))
    created = deployment(cluster, namespace, "kimi")
    assert created.spec.template.spec.containers[0].resources.limits["nvidia.com/gpu"] == "8"
    plan = memory_plan(cluster, namespace, "kimi", "Fits")
    assert plan["message"] == plan_memory(KIMI, gpus=8, gpu_memory=141 << 30, max_context=2048, max_batch=8).reason
    wait_for(
        lambda: cluster.condition(namespace, "kimi", "Ready").get("reason") != "DoesNotFit",
        30,
        "Ready no longer DoesNotFit",
    )

    # Back to one GPU: refused again, and the running Deployment keeps its last fitting spec.
    patch(cluster, namespace, "kimi", kimi(1))
    memory_plan(cluster, namespace, "kimi", "DoesNotFit")
    time.sleep(6)
    kept = cluster.apps.read_namespaced_deployment("kimi", namespace)
    assert kept.metadata.generation == created.metadata.generation
    assert kept.spec.template.spec.containers[0].resources.limits["nvidia.com/gpu"] == "8"
    assert cluster.condition(namespace, "kimi", "Ready")["reason"] == "DoesNotFit"


def test_a_config_that_cannot_be_fetched_skips_the_check_and_never_blocks(cluster, namespace, hub):
    spec = kimi(8)
    spec["speculation"] = {"method": "ddtree"}
    spec["drafter"] = {"uri": "z-lab/Kimi-K2.6-DFlash"}  # not on the fake hub: 404
    apply(cluster, namespace, "no-drafter-config", spec)
    plan = memory_plan(cluster, namespace, "no-drafter-config", "Skipped")
    assert plan["message"].startswith("memory plan skipped: cannot get the config of z-lab/Kimi-K2.6-DFlash: HTTP 404")
    assert "the target alone fits" in plan["message"]
    deployment(cluster, namespace, "no-drafter-config")

    apply(cluster, namespace, "unknown-model", {**kimi(1), "model": {"uri": "org/not-on-the-hub"}})
    plan = memory_plan(cluster, namespace, "unknown-model", "Skipped")
    assert plan["message"].startswith("memory plan skipped: cannot get the config of org/not-on-the-hub: HTTP 404")
    deployment(cluster, namespace, "unknown-model")
