"""`helm install` of the chart into the real control plane: namespaced mode (the operator works there with no
cluster-wide access to workloads), use as a subchart, and the user roles the built-in ones aggregate."""

import json
import os
import socket
import subprocess
import sys
import uuid

import pytest
import yaml

from kube_testbed import CHART, CLOSED_PORT_URL, exists, wait_for

EXAMPLE = "smollm2-cpu"
# What the operator must never be granted cluster-wide when it watches a list of namespaces.
WORKLOADS = {("", "pods"), ("apps", "deployments")}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def can_i(cluster, who: str, verb: str, resource: str, *where: str) -> bool:
    """The API server's own authorization answer (SubjectAccessReview through impersonation)."""
    result = cluster.kubectl("auth", "can-i", verb, resource, f"--as={who}", *where, check=False)
    assert result.stdout.strip() in ("yes", "no"), result.stdout + result.stderr
    return result.stdout.strip() == "yes"


def service_account_kubeconfig(cluster, namespace: str, name: str, path) -> None:
    token = cluster.kubectl("create", "token", name, "-n", namespace, "--duration=1h").stdout.strip()
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    config["users"] = [{"name": name, "user": {"token": token}}]
    config["contexts"][0]["context"]["user"] = name
    path.write_text(yaml.safe_dump(config))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_installed_operator(cluster, deployment, kubeconfig, log_path) -> subprocess.Popen:
    """The operator with the command line and environment of the Deployment the chart installed (the
    liveness endpoint moved to a free loopback port), as the chart's ServiceAccount."""
    (container,) = deployment.spec.template.spec.containers
    args = [
        f"--liveness=http://127.0.0.1:{free_port()}/healthz" if a.startswith("--liveness=") else a
        for a in container.args
    ]
    env = {
        **os.environ,
        **{e.name: e.value for e in container.env},
        "KUBECONFIG": str(kubeconfig),
        "NO_PROXY": "127.0.0.1,localhost",
        "HF_ENDPOINT": CLOSED_PORT_URL,
    }
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", container.command[0], *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


@pytest.fixture
def namespaces(cluster):
    """Make namespaces on demand; delete them afterwards."""
    made = []

    def make(prefix: str) -> str:
        name = unique(prefix)
        cluster.kubectl("create", "namespace", name)
        made.append(name)
        return name

    yield make
    for name in made:
        cluster.kubectl("delete", "namespace", name, "--wait=false")


def test_namespaced_mode_runs_the_operator_without_cluster_wide_workload_access(
    cluster, chart_installed, namespaces, tmp_path
):
    release_namespace, watched, unwatched = namespaces("ops"), namespaces("llm"), namespaces("other")
    release = "scoped"
    cluster.helm(
        "install", release, str(CHART),
        f"--kubeconfig={cluster.kubeconfig}",
        f"--namespace={release_namespace}",
        f"--set=operator.watchNamespaces={{{watched}}}",
        "--set=crds.install=false",  # the CRD is already there: the chart_installed fixture installed it
        "--set=rbac.userRoles=false",
        "--set=webhook.enabled=false",  # its Service is not routed here (conftest.chart_installed says why)
    )  # fmt: skip
    try:
        service_account = f"{release}-ddtree-operator"
        subject = {"kind": "ServiceAccount", "name": service_account, "namespace": release_namespace}

        # No ClusterRoleBinding gives the operator pods or deployments; it reads only CRDs and namespaces.
        rbac = json.loads(cluster.kubectl("get", "clusterrolebindings,clusterroles", "-o", "json").stdout)["items"]
        cluster_roles = {o["metadata"]["name"]: o for o in rbac if o["kind"] == "ClusterRole"}
        bound = [
            cluster_roles[b["roleRef"]["name"]]
            for b in rbac
            if b["kind"] == "ClusterRoleBinding" and subject in (b.get("subjects") or [])
        ]
        granted = {
            (group, resource)
            for role in bound
            for rule in role.get("rules") or []
            for group in rule.get("apiGroups", [])
            for resource in rule.get("resources", [])
        }
        assert bound and not granted & WORKLOADS, granted
        assert granted == {("apiextensions.k8s.io", "customresourcedefinitions"), ("", "namespaces")}

        who = f"system:serviceaccount:{release_namespace}:{service_account}"
        assert can_i(cluster, who, "create", "deployments.apps", "-n", watched)
        assert can_i(cluster, who, "patch", "speculativedeployments.ddtree.dev", "--subresource=status", "-n", watched)
        assert can_i(cluster, who, "create", "horizontalpodautoscalers.autoscaling", "-n", watched)
        assert not can_i(cluster, who, "list", "pods", "-n", unwatched)
        assert not can_i(cluster, who, "list", "deployments.apps", "--all-namespaces")
        assert not can_i(cluster, who, "list", "speculativedeployments.ddtree.dev", "--all-namespaces")

        # The operator, run as the chart runs it with these permissions, serves the watched namespace only.
        deployment = cluster.apps.read_namespaced_deployment(service_account, release_namespace)
        assert f"--namespace={watched}" in deployment.spec.template.spec.containers[0].args
        kubeconfig = tmp_path / "operator.kubeconfig"
        service_account_kubeconfig(cluster, release_namespace, service_account, kubeconfig)
        log_path = tmp_path / "operator.log"
        operator = run_installed_operator(cluster, deployment, kubeconfig, log_path)
        try:
            cluster.apply_example(watched, f"{EXAMPLE}.yaml")
            cluster.apply_example(unwatched, f"{EXAMPLE}.yaml")
            wait_for(
                lambda: exists(lambda: cluster.apps.read_namespaced_deployment(EXAMPLE, watched)),
                60,
                f"the operator to create {watched}/{EXAMPLE}'s Deployment (log: {log_path})",
            )
            wait_for(lambda: cluster.status(watched, EXAMPLE).get("phase"), 60, "a phase in the watched status")
            ignored = cluster.specdeploy(unwatched, EXAMPLE)
            assert "status" not in ignored and not ignored["metadata"].get("finalizers"), ignored
            assert not cluster.apps.list_namespaced_deployment(unwatched).items
            # deleted while the operator runs, so that it releases its finalizer
            cluster.kubectl("delete", "specdeploy", EXAMPLE, "-n", watched, "--timeout=60s")
        finally:
            operator.terminate()
            operator.wait(timeout=30)
        log = log_path.read_text()
        for trouble in ("Forbidden", "Not enough permissions", "Traceback"):
            assert trouble not in log, log[-6000:]
    finally:
        cluster.helm("uninstall", release, f"--kubeconfig={cluster.kubeconfig}", f"--namespace={release_namespace}")


def test_installs_as_a_subchart_with_global_values(cluster, chart_installed, namespaces, tmp_path):
    parent = tmp_path / "platform"
    (parent / "templates").mkdir(parents=True)  # the parent's own (none)
    chart_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    (parent / "Chart.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v2",
                "name": "platform",
                "version": "1.0.0",
                "dependencies": [{"name": "ddtree", "version": chart_version, "repository": f"file://{CHART}"}],
            }
        )
    )
    (parent / "values.yaml").write_text(
        yaml.safe_dump(
            {
                "global": {"imageRegistry": "registry.example", "labels": {"team": "llm"}},
                "ddtree": {
                    "crds": {"install": False},  # the CRD is already there: the chart_installed fixture installed it
                    "engine": {"nodeGpus": 4},
                    "dashboards": {"enabled": True},
                    "webhook": {"enabled": False},  # its Service is not routed here (conftest.chart_installed)
                },
            }
        )
    )
    cluster.helm("dependency", "build", str(parent))
    lint = cluster.helm("lint", "--strict", "--with-subcharts", str(parent), check=False)
    assert lint.returncode == 0 and "[WARNING]" not in lint.stdout, lint.stdout + lint.stderr

    namespace = namespaces("platform")
    release = "plat"
    kube = (f"--kubeconfig={cluster.kubeconfig}", f"--namespace={namespace}")
    cluster.helm("install", release, str(parent), *kube, "--wait", "--timeout=90s")
    try:
        deployment = cluster.apps.read_namespaced_deployment(f"{release}-ddtree-operator", namespace)
        assert deployment.status.ready_replicas == 1  # kwok runs it
        env = {e.name: e.value for e in deployment.spec.template.spec.containers[0].env}
        assert json.loads(env["DDTREE_ENGINE_DEFAULTS"])["nodeGpus"] == 4
        assert exists(lambda: cluster.core.read_namespaced_config_map(f"{release}-ddtree-dashboards", namespace))
        assert can_i(
            cluster, f"system:serviceaccount:{namespace}:{release}-ddtree-operator", "list", "pods", "--all-namespaces"
        )
    finally:
        cluster.helm("uninstall", release, *kube)


def test_user_roles_extend_the_builtin_view_edit_and_admin(cluster, chart_installed, namespaces):
    def aggregated() -> bool:
        roles = json.loads(cluster.kubectl("get", "clusterroles", "view", "edit", "admin", "-o", "json").stdout)
        return all("speculativedeployments" in json.dumps(role["rules"]) for role in roles["items"])

    # kube-controller-manager's aggregation controller copies the chart's rules into the built-in roles
    wait_for(aggregated, 60, "the built-in view, edit and admin roles to include speculativedeployments")

    namespace = namespaces("team")
    for user, role in (("viewer", "view"), ("editor", "edit"), ("owner", "admin")):
        cluster.kubectl("create", "rolebinding", user, f"--clusterrole={role}", f"--user={user}", "-n", namespace)
    specdeploy = "speculativedeployments.ddtree.dev"
    where = ("-n", namespace)

    assert can_i(cluster, "viewer", "list", specdeploy, *where)
    assert can_i(cluster, "viewer", "get", specdeploy, "--subresource=scale", *where)
    assert not can_i(cluster, "viewer", "create", specdeploy, *where)
    assert not can_i(cluster, "viewer", "list", specdeploy, "--all-namespaces")

    assert can_i(cluster, "editor", "create", specdeploy, *where)
    assert can_i(cluster, "editor", "patch", specdeploy, "--subresource=scale", *where)
    assert not can_i(cluster, "editor", "patch", specdeploy, "--subresource=status", *where)

    assert can_i(cluster, "owner", "delete", specdeploy, *where)
    assert can_i(cluster, "owner", "update", specdeploy, "--subresource=scale", *where)


def test_an_upgrade_keeps_the_webhook_certificate_helm_made(cluster, chart_installed, namespaces):
    # The webhook is scoped to a namespace nothing is applied in: its Service is not routed here
    # (conftest.chart_installed), so the API server must never call it.
    release_namespace, watched = namespaces("ops"), namespaces("quiet")
    release = "certs"
    kube = (f"--kubeconfig={cluster.kubeconfig}", f"--namespace={release_namespace}")
    values = (f"--set=operator.watchNamespaces={{{watched}}}", "--set=crds.install=false", "--set=rbac.userRoles=false")
    secret_name = f"{release}-ddtree-webhook-tls"

    def installed() -> tuple[dict, str]:
        secret = cluster.core.read_namespaced_secret(secret_name, release_namespace).data
        configuration = json.loads(
            cluster.kubectl("get", "validatingwebhookconfiguration", f"{release}-ddtree-webhook", "-o", "json").stdout
        )
        return secret, configuration["webhooks"][0]["clientConfig"]["caBundle"]

    cluster.helm("install", release, str(CHART), *kube, *values)
    try:
        secret, ca_bundle = installed()
        assert ca_bundle == secret["ca.crt"] and secret["tls.crt"] and secret["tls.key"]
        cluster.helm("upgrade", release, str(CHART), *kube, *values, "--set=operator.logLevel=verbose")
        assert installed() == (secret, ca_bundle)
    finally:
        cluster.helm("uninstall", release, *kube)
