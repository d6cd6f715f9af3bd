"""Killing the operator (SIGKILL, a real process) in the middle of reconciling, changing things while
it is down, and starting it again converges: no duplicate or orphaned objects, every change applied."""

import json
import signal

import pytest
import yaml

from kube_testbed import OWNER_LABEL_KEY, start_operator, stop_operator, wait_for

NAMES = ("alpha", "beta", "gamma")


def spec(budget=8, replicas=1):
    return {
        "model": {"uri": "smollm2-135m-instruct"},
        "drafter": {"uri": "smollm2-135m-instruct-dflash"},
        "speculation": {"budget": budget},
        "replicas": replicas,
        "metrics": {"scrapeIntervalSeconds": 5},
    }


def apply(cluster, namespace, name, body):
    doc = {
        "apiVersion": "ddtree.dev/v1alpha1",
        "kind": "SpeculativeDeployment",
        "metadata": {"name": name},
        "spec": body,
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(doc))


def test_kill_and_restart_mid_reconcile_converges(cluster, operator_kubeconfig, namespace, tmp_path):
    log = tmp_path / "operator.log"
    first = start_operator(operator_kubeconfig, log)
    try:
        for name in NAMES:
            apply(cluster, namespace, name, spec())
        # Kill it the moment the first child exists: the others are still being reconciled.
        wait_for(
            lambda: cluster.apps.list_namespaced_deployment(namespace).items, 60, "a first Deployment", interval=0.05
        )
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    at_kill = {
        "deployments": sorted(d.metadata.name for d in cluster.apps.list_namespaced_deployment(namespace).items),
        "services": sorted(s.metadata.name for s in cluster.core.list_namespaced_service(namespace).items),
    }
    print(f"state when killed: {at_kill}")

    # While it is down: a spec change, a scale, a deletion (held by the finalizer if it got one).
    apply(cluster, namespace, "alpha", spec(budget=16))
    cluster.kubectl("scale", "specdeploy", "beta", "-n", namespace, "--replicas=2")
    cluster.kubectl("delete", "specdeploy", "gamma", "-n", namespace, "--wait=false")

    second = start_operator(operator_kubeconfig, log)
    try:

        def converged():
            crs = {n: cluster.specdeploy(namespace, n) for n in ("alpha", "beta")}
            if any(
                (cr.get("status") or {}).get("observedGeneration") != cr["metadata"]["generation"]
                or cr["status"].get("phase") != "Ready"
                for cr in crs.values()
            ):
                return False
            pods = [p for p in cluster.core.list_namespaced_pod(namespace).items if not p.metadata.deletion_timestamp]
            by_owner = {n: [p for p in pods if p.metadata.labels.get(OWNER_LABEL_KEY) == n] for n in NAMES}
            return (
                len(by_owner["alpha"]) == 1
                and len(by_owner["beta"]) == 2
                and not by_owner["gamma"]
                and len(pods) == 3
                and crs
            )

        crs = wait_for(converged, 120, "alpha and beta Ready with their changes, gamma gone")
        config = cluster.core.read_namespaced_config_map("alpha", namespace).data["engine.yaml"]
        assert yaml.safe_load(config)["speculation"]["budget"] == 16

        # Exactly one Deployment and one Service per resource, each owned by a resource that exists.
        uids = {cr["metadata"]["uid"]: name for name, cr in crs.items()}
        wait_for(
            lambda: (
                sorted(d.metadata.name for d in cluster.apps.list_namespaced_deployment(namespace).items)
                == ["alpha", "beta"]
            ),
            60,
            "gamma's Deployment garbage-collected",
        )
        for listing in (
            cluster.apps.list_namespaced_deployment,
            cluster.core.list_namespaced_service,
            cluster.core.list_namespaced_config_map,
        ):
            # every namespace also gets the control plane's own kube-root-ca.crt ConfigMap
            objects = [o for o in listing(namespace).items if o.metadata.name != "kube-root-ca.crt"]
            assert sorted(o.metadata.name for o in objects) == ["alpha", "beta"]
            for obj in objects:
                (ref,) = obj.metadata.owner_references
                assert uids[ref.uid] == obj.metadata.name
        assert not any(
            n == "gamma"
            for n in (
                cr["metadata"]["name"]
                for cr in cluster.custom.list_namespaced_custom_object(
                    "ddtree.dev", "v1alpha1", namespace, "speculativedeployments"
                )["items"]
            )
        )
    finally:
        # Remove the resources while an operator can still drop their finalizers.
        for name in ("alpha", "beta"):
            cluster.kubectl("delete", "specdeploy", name, "-n", namespace, "--timeout=60s", check=False)
        stop_operator(second)
    output = log.read_text(errors="replace")
    assert "Traceback" not in output, output[-6000:]
    if second.returncode not in (0, -signal.SIGTERM):
        pytest.fail(f"operator exited with {second.returncode}:\n{output[-4000:]}")
