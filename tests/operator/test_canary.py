"""The drafter canary end to end (docs/operator.md, "Drafter canary"): the operator on the real control plane,
its engine pods run as real `python -m ddtree serve` processes on their kwok pod IPs (hack/kwok_engines.py plays
kubelet and sends completions), and a change of spec.drafter decided from the acceptance lengths the operator
scrapes. The built-in trained drafter (smollm2-135m-instruct-dflash) against a random-init one (random:1, whose
drafts the target almost never accepts): replacing the random drafter with the trained one is promoted, and
replacing the trained one with the random one is rolled back.

Skipped, with the reason, only when this environment has no `ddtree serve`.
"""

from __future__ import annotations

import json

import pytest
import yaml

from kube_testbed import load_hack_module, wait_for

kwok_engines = load_hack_module("kwok_engines")

pytestmark = pytest.mark.usefixtures("operator")

NAME = "smollm2-cpu"  # examples/smollm2-cpu.yaml: SmolLM2-135M on CPU
TRAINED = {"uri": "smollm2-135m-instruct-dflash"}
RANDOM = {"uri": "random:1"}
# Short enough for 2 shared CPU cores: each engine gets a completion of 32 tokens every few seconds.
CANARY = {"windowSeconds": 20, "minRounds": 40, "tolerance": 0.05, "deadlineSeconds": 600}
# Two engines starting together (load, smoke test) on busy cores, then the canary's.
READY_TIMEOUT_SECONDS = 600
DECISION_TIMEOUT_SECONDS = 600


@pytest.fixture(scope="module")
def ddtree_serve():
    ok, detail = kwok_engines.serve_available()
    if not ok:
        pytest.skip(f"`python -m ddtree serve --help` failed, so there is no engine to run: {detail}")


def deployment_drafters(cluster, namespace: str) -> dict[str, tuple[int, str]]:
    """{Deployment name: (replicas, drafter of the configuration file its pods read)}."""
    files = cluster.core.read_namespaced_config_map(NAME, namespace).data
    out = {}
    for deployment in cluster.apps.list_namespaced_deployment(namespace).items:
        args = deployment.spec.template.spec.containers[0].args
        config = yaml.safe_load(files[args[args.index("--config") + 1].rsplit("/", 1)[1]])
        out[deployment.metadata.name] = (deployment.spec.replicas, config["model"]["drafter"])
    return out


def change_drafter(cluster, namespace: str, old: dict, new: dict, tmp_path) -> tuple[dict, dict]:
    """Two replicas on `old`, then spec.drafter `new`: the canary's end condition and status.drafterCanary."""
    cluster.apply_example(namespace, "smollm2-cpu.yaml", drafter=old, replicas=2, drafterCanary=CANARY)
    runner = kwok_engines.EngineRunner(cluster.api, namespace, NAME, tmp_path)
    with runner.start(load=True, load_seconds=READY_TIMEOUT_SECONDS + DECISION_TIMEOUT_SECONDS, ignore_eos=True):

        def status_where(predicate):
            if any(p.finished for p in runner.pods.values()):
                pytest.fail(f"an engine exited; status: {cluster.status(namespace, NAME)}\n{runner.logs()}")
            status = cluster.status(namespace, NAME)
            return predicate(status) and status

        wait_for(
            lambda: status_where(
                lambda s: s.get("readyReplicas") == 2 and (s.get("drafterCanary") or {}).get("stable") == old
            ),
            READY_TIMEOUT_SECONDS,
            "2 ready replicas of the old drafter",
            interval=2,
        )
        patch = json.dumps({"spec": {"drafter": new}})
        cluster.kubectl("patch", "specdeploy", NAME, "-n", namespace, "--type=merge", "-p", patch)
        # one pod of each drafter, the total still spec.replicas
        wait_for(
            lambda: (
                deployment_drafters(cluster, namespace) == {NAME: (1, old["uri"]), f"{NAME}-canary": (1, new["uri"])}
            ),
            60,
            "the canary Deployment next to the engine Deployment",
        )
        wait_for(
            lambda: status_where(lambda s: (s.get("drafterCanary") or {}).get("phase") not in (None, "Progressing")),
            DECISION_TIMEOUT_SECONDS,
            "the canary's decision",
            interval=2,
        )
    condition = cluster.condition(namespace, NAME, "DrafterCanary")
    return condition, cluster.status(namespace, NAME)["drafterCanary"]


def events(cluster, namespace: str, reason: str) -> list[str]:
    return [e.message for e in cluster.core.list_namespaced_event(namespace).items if e.reason == reason]


def test_a_trained_drafter_replaces_a_random_one(cluster, namespace, ddtree_serve, tmp_path):
    condition, canary = change_drafter(cluster, namespace, RANDOM, TRAINED, tmp_path)
    assert (condition["status"], condition["reason"]) == ("False", "Promoted"), condition
    assert canary["stable"] == TRAINED and canary["candidate"] == TRAINED
    new, old = canary["candidateMeasurement"], canary["stableMeasurement"]
    assert new["rounds"] >= CANARY["minRounds"] and old["rounds"] >= CANARY["minRounds"]
    assert new["acceptanceLength"] > old["acceptanceLength"], canary
    assert f"acceptance length {new['acceptanceLength']:.2f}" in condition["message"]
    assert f"acceptance length {old['acceptanceLength']:.2f}" in condition["message"]
    # every pod gets the trained drafter; the canary Deployment is gone
    wait_for(
        lambda: deployment_drafters(cluster, namespace) == {NAME: (2, TRAINED["uri"])},
        60,
        "the engine Deployment on the trained drafter alone",
    )
    assert any("promoted smollm2-135m-instruct-dflash" in m for m in events(cluster, namespace, "Promoted"))


def test_a_random_drafter_is_rolled_back(cluster, namespace, ddtree_serve, tmp_path):
    condition, canary = change_drafter(cluster, namespace, TRAINED, RANDOM, tmp_path)
    assert (condition["status"], condition["reason"]) == ("False", "RolledBack"), condition
    assert canary["stable"] == TRAINED and canary["candidate"] == RANDOM
    new, old = canary["candidateMeasurement"], canary["stableMeasurement"]
    assert new["acceptanceLength"] < old["acceptanceLength"] * (1 - CANARY["tolerance"]), canary
    assert "the acceptance length of random:1" in condition["message"]
    assert "until spec.drafter changes" in condition["message"]
    # the user's spec is left as written; the engines run the trained drafter on both replicas again
    assert cluster.specdeploy(namespace, NAME)["spec"]["drafter"] == RANDOM
    wait_for(
        lambda: deployment_drafters(cluster, namespace) == {NAME: (2, TRAINED["uri"])},
        60,
        "the engine Deployment back on the trained drafter alone",
    )
    (warning,) = events(cluster, namespace, "RolledBack")
    assert "rolled back to smollm2-135m-instruct-dflash" in warning
