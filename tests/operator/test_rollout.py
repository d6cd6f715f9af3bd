"""Rollouts against the real control plane: whether a spec change completes on the GPUs there are depends on
the Deployment strategy the operator renders (render_strategy, docs/operator.md "Rollouts").

The kwok test cluster has one GPU node, gpu-node-0 with 8 nvidia.com/gpu, and the operator's nodeGpus is
its default, 8: a replica of 8 GPUs fills the only node it fits on. kwok marks a pod Ready the moment it is
scheduled (the stand-in for the engine's `/ready`), so what a rollout waits for here is the scheduler.
A pod watch records every change of the resource's pods, so the checks see each state the cluster went
through, not only the ones a poll happened to catch.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import kubernetes
import pytest

from kube_testbed import OWNER_LABEL_KEY, wait_for

pytestmark = pytest.mark.usefixtures("operator")

NAME = "smollm2-cpu"  # examples/smollm2-cpu.yaml: a built-in model, so the fit check needs no hub
GPU_NODE = "gpu-node-0"
NODE_GPUS = 8  # hack/kwok-nodes.yaml's gpu-node-0, and the operator's default nodeGpus
GPU = "nvidia.com/gpu"
# A new pod of a full-node replica waits for the old one to be deleted; kwok deletes at once, so a
# scheduling retry or two at most.
PENDING_LIMIT_SECONDS = 10
ROLLOUT_TIMEOUT_SECONDS = 30
# What the rollouts change: an engine environment variable (in the pod template, so the pods roll).
ALLOC_CONF = {"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:True"}


def resources(gpus: int) -> dict[str, object]:
    return {"gpus": gpus, "cpu": 1, "memory": "4Gi", "sharedMemorySize": "256Mi"}


@dataclasses.dataclass(frozen=True)
class PodState:
    """One engine pod as one watch event left it."""

    name: str
    template_hash: str
    node: str | None
    ready: bool
    terminating: bool
    unschedulable: bool

    @classmethod
    def of(cls, pod) -> PodState:
        conditions = {c.type: c for c in pod.status.conditions or []}
        scheduled = conditions.get("PodScheduled")
        return cls(
            name=pod.metadata.name,
            template_hash=pod.metadata.labels["pod-template-hash"],
            node=pod.spec.node_name,
            ready=conditions.get("Ready") is not None and conditions["Ready"].status == "True",
            terminating=pod.metadata.deletion_timestamp is not None,
            unschedulable=scheduled is not None and scheduled.reason == "Unschedulable",
        )

    @property
    def serving(self) -> bool:
        return self.node is not None and self.ready and not self.terminating


class PodWatch:
    """Every change of one resource's engine pods, in the API server's order, each with the pods present
    after it. The watch starts at a list's resourceVersion, so no change between the two is lost."""

    def __init__(self, cluster, namespace: str, name: str):
        self.core = cluster.core
        self.namespace = namespace
        self.selector = f"{OWNER_LABEL_KEY}={name}"
        self.timeline: list[tuple[float, dict[str, PodState]]] = []  # (time.monotonic(), pods by name)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._error: BaseException | None = None

    def __enter__(self) -> PodWatch:
        listed = self.core.list_namespaced_pod(self.namespace, label_selector=self.selector)
        self.timeline.append((time.monotonic(), {p.metadata.name: PodState.of(p) for p in listed.items}))
        self._version = listed.metadata.resource_version
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        try:
            wait_for(lambda: self._error or self.timeline[-1][1] == self._listed(), 10, "the watch to catch up")
        finally:
            self._stop.set()
            self._thread.join(timeout=10)
        if self._error is not None:
            raise AssertionError("the pod watch failed: an incomplete history proves nothing") from self._error

    def _listed(self) -> dict[str, PodState]:
        listed = self.core.list_namespaced_pod(self.namespace, label_selector=self.selector)
        return {p.metadata.name: PodState.of(p) for p in listed.items}

    def _run(self) -> None:
        try:
            self._follow()
        except BaseException as exc:  # re-raised by __exit__, in the test's thread
            self._error = exc

    def _follow(self) -> None:
        while not self._stop.is_set():
            # short server-side timeouts: the loop sees _stop within a couple of seconds
            for event in kubernetes.watch.Watch().stream(
                self.core.list_namespaced_pod,
                self.namespace,
                label_selector=self.selector,
                resource_version=self._version,
                timeout_seconds=2,
            ):
                pod = event["object"]
                self._version = pod.metadata.resource_version
                pods = dict(self.timeline[-1][1])
                if event["type"] == "DELETED":
                    pods.pop(pod.metadata.name, None)
                else:
                    pods[pod.metadata.name] = PodState.of(pod)
                self.timeline.append((time.monotonic(), pods))

    def describe(self) -> str:
        start = self.timeline[0][0]
        return "\n".join(f"{t - start:6.2f}s {sorted(pods.values(), key=str)}" for t, pods in self.timeline)

    def longest_pending_seconds(self) -> float:
        """The longest time any pod existed without a node."""
        unbound_since: dict[str, float] = {}
        longest = 0.0
        for t, pods in self.timeline:
            for name, pod in pods.items():
                if pod.node is None:
                    unbound_since.setdefault(name, t)
            for name in list(unbound_since):
                if name not in pods or pods[name].node is not None:
                    longest = max(longest, t - unbound_since.pop(name))
        end = self.timeline[-1][0]
        return max([longest, *(end - since for since in unbound_since.values())])


def gpus_bound_to(cluster, node: str) -> int:
    pods = cluster.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}").items
    return sum(
        int((c.resources.requests or {}).get(GPU, 0))
        for p in pods
        if p.status.phase not in ("Succeeded", "Failed")
        for c in p.spec.containers
    )


def create_ready(cluster, namespace: str, gpus: int) -> PodState:
    """The resource with `gpus` GPUs per replica, Ready with one pod; returns that pod."""
    nodes = cluster.core.list_node().items
    gpu_nodes = {n.metadata.name: int(n.status.allocatable.get(GPU, 0)) for n in nodes if GPU in n.status.allocatable}
    assert gpu_nodes == {GPU_NODE: NODE_GPUS}, "the tests below assume hack/kwok-nodes.yaml's one GPU node"
    # Namespaces of earlier tests are deleted in the background: their engines may still hold GPUs.
    wait_for(lambda: gpus_bound_to(cluster, GPU_NODE) == 0, 60, f"no GPU of {GPU_NODE} taken")
    cluster.apply_example(namespace, "smollm2-cpu.yaml", resources=resources(gpus))
    wait_for(lambda: cluster.status(namespace, NAME).get("phase") == "Ready", 60, f"{NAME} Ready")
    (pod,) = cluster.engine_pods(namespace, NAME)
    assert pod.spec.node_name == GPU_NODE
    return PodState.of(pod)


def patch_spec(cluster, namespace: str, spec: dict[str, object]) -> None:
    cluster.kubectl("patch", "specdeploy", NAME, "-n", namespace, "--type=merge", "-p", json.dumps({"spec": spec}))


def strategy(cluster, namespace: str) -> tuple[object, object]:
    rolling = cluster.apps.read_namespaced_deployment(NAME, namespace).spec.strategy.rolling_update
    return rolling.max_surge, rolling.max_unavailable


def wait_rolled(cluster, namespace: str, old: PodState, watch: PodWatch) -> PodState:
    """Until the Deployment reports its second revision updated and available, with one pod: the new one."""

    def rolled():
        deployment = cluster.apps.read_namespaced_deployment(NAME, namespace)
        status = deployment.status
        pods = [PodState.of(p) for p in cluster.engine_pods(namespace, NAME)]
        done = (
            deployment.metadata.annotations.get("deployment.kubernetes.io/revision") == "2"
            and status.observed_generation == deployment.metadata.generation
            and (status.replicas, status.updated_replicas, status.available_replicas) == (1, 1, 1)
            and len(pods) == 1
            and pods[0].template_hash != old.template_hash
            and pods[0].serving
        )
        return done and pods[0]

    try:
        new = wait_for(rolled, ROLLOUT_TIMEOUT_SECONDS, "the rollout to complete")
    except pytest.fail.Exception as exc:
        pytest.fail(f"{exc}\npods over time:\n{watch.describe()}")
    (new_replica_set,) = [
        rs
        for rs in cluster.apps.list_namespaced_replica_set(namespace).items
        if rs.metadata.annotations.get("deployment.kubernetes.io/revision") == "2"
    ]
    assert new_replica_set.metadata.labels["pod-template-hash"] == new.template_hash
    wait_for(
        lambda: (s := cluster.status(namespace, NAME)).get("phase") == "Ready" and s.get("observedGeneration") == 2,
        30,
        f"{NAME} Ready at generation 2",
    )
    return new


def release_gpus(cluster, namespace: str) -> None:
    """Scale to zero, so that the next test finds the GPUs free at once (a deleted resource's pods wait for
    the garbage collector, which learns of the resource type only at its next resync: up to 30 s)."""
    cluster.kubectl("scale", "specdeploy", NAME, "-n", namespace, "--replicas=0")
    wait_for(lambda: not cluster.engine_pods(namespace, NAME), 30, "the engine pods gone")


def test_a_full_node_replica_rolls_without_surge(cluster, namespace):
    old = create_ready(cluster, namespace, gpus=NODE_GPUS)
    assert strategy(cluster, namespace) == (0, 1)

    with PodWatch(cluster, namespace, NAME) as watch:
        patch_spec(cluster, namespace, {"engine": {"env": [ALLOC_CONF]}})
        new = wait_rolled(cluster, namespace, old, watch)

    assert new.node == GPU_NODE
    history = watch.describe()
    most_bound = max(sum(p.node is not None and not p.terminating for p in pods.values()) for _, pods in watch.timeline)
    assert most_bound == 1, history
    assert watch.longest_pending_seconds() < PENDING_LIMIT_SECONDS, history
    release_gpus(cluster, namespace)


def test_a_forced_surge_of_a_full_node_replica_stays_pending(cluster, namespace):
    """What the default avoids: a surge pod of a full node finds no room and the old pod cannot go."""
    old = create_ready(cluster, namespace, gpus=NODE_GPUS)
    patch_spec(cluster, namespace, {"rollout": {"maxSurge": 1, "maxUnavailable": 0}, "engine": {"env": [ALLOC_CONF]}})

    def unschedulable_surge_pod():
        pods = cluster.engine_pods(namespace, NAME)
        return next((p for p in pods if p.metadata.name != old.name and PodState.of(p).unschedulable), None)

    surge = wait_for(unschedulable_surge_pod, 15, "an Unschedulable surge pod", interval=0.2)
    assert strategy(cluster, namespace) == (1, 0)
    scheduled = next(c for c in surge.status.conditions if c.type == "PodScheduled")
    assert surge.status.phase == "Pending" and f"Insufficient {GPU}" in scheduled.message, scheduled.message
    pods = {p.metadata.name: PodState.of(p) for p in cluster.engine_pods(namespace, NAME)}
    assert pods.keys() == {old.name, surge.metadata.name}
    assert pods[old.name].serving  # maxUnavailable 0: the old engine stays until a new one is Ready
    release_gpus(cluster, namespace)
    cluster.kubectl("delete", "specdeploy", NAME, "-n", namespace)


def test_a_small_replica_rolls_with_surge(cluster, namespace):
    old = create_ready(cluster, namespace, gpus=1)
    assert strategy(cluster, namespace) == (1, 0)

    with PodWatch(cluster, namespace, NAME) as watch:
        patch_spec(cluster, namespace, {"engine": {"env": [ALLOC_CONF]}})
        new = wait_rolled(cluster, namespace, old, watch)

    history = watch.describe()
    states = [pods for _, pods in watch.timeline]
    # the first state with the new pod serving, and the first without the old one serving (deleted or
    # marked for deletion, or not Ready)
    new_ready = next(i for i, pods in enumerate(states) if new.name in pods and pods[new.name].serving)
    old_going = next(i for i, pods in enumerate(states) if old.name not in pods or not pods[old.name].serving)
    assert new_ready < old_going, history
    assert states[new_ready].keys() == {old.name, new.name}, history  # the surge pod, next to the old one
    release_gpus(cluster, namespace)
