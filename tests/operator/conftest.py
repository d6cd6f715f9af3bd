"""Fixtures for the operator tests: a real control plane on loopback (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, kwok) started by hack/start-test-cluster.sh from the binaries
hack/build-test-cluster.sh builds, the Helm chart installed into it, and the operator under
kopf.testing.KopfRunner with the chart's ServiceAccount (so its least-privilege RBAC is what runs).

Without the binaries these tests skip locally and fail under CI=true (a missing build must not pass).
"""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import uuid

import kubernetes
import pytest
import yaml

from kube_testbed import (
    BIN_DIR,
    CHART,
    ENGINE_IMAGE,
    HACK,
    OPERATOR_NAMESPACE,
    OPERATOR_SA,
    Cluster,
    exists,
    missing,
    node_ready,
    operator_environment,
    tool,
    wait_for,
)


@pytest.fixture(scope="session")
def helm() -> str:
    """The helm binary of the control-plane build (the chart tests render and lint with it)."""
    path = BIN_DIR / "helm"
    if not os.access(path, os.X_OK):
        missing(f"{path} is missing")
    return str(path)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> Cluster:
    for binary in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "helm"):
        if not os.access(BIN_DIR / binary, os.X_OK):
            missing(f"test-cluster binary {BIN_DIR / binary} is missing")
    kubectl = tool("kubectl")
    workdir = tmp_path_factory.mktemp("cluster")
    env = {**os.environ, "KUBECTL": kubectl, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    start = subprocess.run(
        ["bash", str(HACK / "start-test-cluster.sh"), str(BIN_DIR), str(workdir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        if start.returncode != 0:
            pytest.fail(f"start-test-cluster.sh failed:\n{start.stdout}\n{start.stderr}")
        kubeconfig = workdir / "kubeconfig"
        cluster = Cluster(
            workdir,
            kubeconfig,
            kubectl,
            str(BIN_DIR / "helm"),
            kubernetes.config.new_client_from_config(config_file=str(kubeconfig)),
        )
        # The controller-manager is up once it made the default ServiceAccount; kwok once nodes are Ready.
        wait_for(
            lambda: exists(lambda: cluster.core.read_namespaced_service_account("default", "default")),
            60,
            "kube-controller-manager (default ServiceAccount)",
        )
        wait_for(lambda: all(node_ready(n) for n in cluster.core.list_node().items), 60, "kwok nodes Ready")
        yield cluster
    finally:
        subprocess.run(
            ["bash", str(HACK / "stop-test-cluster.sh"), str(workdir), "--keep"], timeout=120, capture_output=True
        )


@pytest.fixture(scope="session")
def chart_installed(cluster: Cluster) -> str:
    """`helm template … | kubectl apply --server-side`, as the quickstart does without Tiller/releases."""
    cluster.kubectl("create", "namespace", OPERATOR_NAMESPACE)
    rendered = cluster.helm(
        "template",
        "ddtree",
        str(CHART),
        "--namespace",
        OPERATOR_NAMESPACE,
        "--set",
        f"engine.image.repository={ENGINE_IMAGE.split(':')[0]}",
        "--set",
        f"engine.image.tag={ENGINE_IMAGE.split(':')[1]}",
        # The webhook's Service has a cluster IP no one routes here (no kube-proxy): the API server would wait
        # out the webhook's timeout on every apply. test_admission.py registers the webhook where it answers.
        "--set",
        "webhook.enabled=false",
    ).stdout
    cluster.kubectl("apply", "--server-side", "-f", "-", input=rendered)
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/speculativedeployments.ddtree.dev")
    return rendered


@pytest.fixture(scope="session")
def operator_kubeconfig(cluster: Cluster, chart_installed: str) -> pathlib.Path:
    """A kubeconfig with a token of the chart's ServiceAccount: the operator gets only the chart's RBAC."""
    token = cluster.kubectl("create", "token", OPERATOR_SA, "-n", OPERATOR_NAMESPACE, "--duration=4h").stdout.strip()
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    admin["users"] = [{"name": "operator", "user": {"token": token}}]
    admin["contexts"][0]["context"]["user"] = "operator"
    path = cluster.workdir / "operator.kubeconfig"
    path.write_text(yaml.safe_dump(admin))
    return path


@pytest.fixture(scope="module")
def operator(operator_kubeconfig: pathlib.Path):
    """The operator under kopf's test runner, for one test module."""
    from kopf.testing import KopfRunner

    logging.getLogger("kopf").setLevel(logging.INFO)
    with operator_environment(operator_kubeconfig):
        with KopfRunner(
            ["run", "--standalone", "--all-namespaces", "-m", "ddtree_operator.handlers"], timeout=60
        ) as runner:
            yield runner
    assert runner.exception is None, f"operator crashed: {runner.exception!r}\n{runner.output[-4000:]}"
    assert runner.exit_code == 0, runner.output[-4000:]
    assert "Traceback" not in runner.output, runner.output[-6000:]


@pytest.fixture
def namespace(cluster: Cluster) -> str:
    """A fresh namespace, deleted afterwards (while the module's operator still runs to drop finalizers)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false")
