"""The CRD as the real kube-apiserver enforces it: examples accepted, bad specs rejected with the
CEL/schema message, defaults equal to the pydantic ones, every status field kept, printer columns."""

import datetime
import json

import pytest
import yaml

from ddtree_operator.api import SpeculativeDeploymentSpec
from ddtree_operator.fit import MemoryCheck
from ddtree_operator.metrics import EngineSample, Window
from ddtree_operator.status import DeploymentView, Failure, PodView, compute_status, status_patch
from invalid_specs import INVALID_SPECS, OUT_OF_BOUNDS_SPECS, VALID
from kube_testbed import EXAMPLES


def resource(name: str, spec: dict) -> str:
    return json.dumps(
        {"apiVersion": "ddtree.dev/v1alpha1", "kind": "SpeculativeDeployment", "metadata": {"name": name}, "spec": spec}
    )


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_examples_pass_server_side_dry_run(cluster, chart_installed, namespace, example):
    result = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(EXAMPLES / example))
    assert "created (server dry run)" in result.stdout


def test_budget_zero_per_batch_size_is_accepted(cluster, chart_installed, namespace):
    """Budget 0 in budgetByBatchSize (drafting off at those batch sizes) passes the schema and the rules."""
    spec = {
        **VALID,
        "speculation": {
            "batchBuckets": [1, 2, 4],
            "budgetByBatchSize": [{"maxBatchSize": 1, "budget": 32}, {"maxBatchSize": 4, "budget": 0}],
        },
        "engine": {"maxBatchSize": 4},
    }
    SpeculativeDeploymentSpec.model_validate(spec)
    result = cluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=resource("budget-zero", spec)
    )
    assert "created (server dry run)" in result.stdout


@pytest.mark.parametrize("case", INVALID_SPECS, ids=str)
def test_cel_rules_reject_with_their_message(cluster, chart_installed, namespace, case):
    spec, message = INVALID_SPECS[case]
    result = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=resource("bad", spec), check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize("case", OUT_OF_BOUNDS_SPECS, ids=str)
def test_schema_bounds_reject_naming_the_field(cluster, chart_installed, namespace, case):
    spec, field = OUT_OF_BOUNDS_SPECS[case]
    result = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=resource("bad", spec), check=False)
    assert result.returncode != 0 and field in result.stderr, result.stderr


def test_new_fields_pass_the_schema_and_the_rules(cluster, chart_installed, namespace):
    spec = {
        **VALID,
        "model": {"uri": "moonshotai/Kimi-K2.6", "trustRemoteCode": True},
        "parallelism": {"tensor": 8, "expert": 8},
        "engine": {"maxSeqLen": 131072},
        "resources": {"gpus": 8, "gpuMemory": "141Gi"},
        "rollout": {"maxSurge": 0, "maxUnavailable": "25%"},
    }
    SpeculativeDeploymentSpec.model_validate(spec)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=resource("new-fields", spec))
    stored = cluster.specdeploy(namespace, "new-fields")["spec"]
    assert SpeculativeDeploymentSpec.model_validate(stored) == SpeculativeDeploymentSpec.model_validate(spec)
    assert stored["rollout"] == {"type": "RollingUpdate", "maxSurge": 0, "maxUnavailable": "25%"}


def test_recreate_and_autoscaling_pass_the_schema_with_server_defaults(cluster, chart_installed, namespace):
    spec = {**VALID, "rollout": {"type": "Recreate"}, "autoscaling": {"maxReplicas": 4}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=resource("autoscaled", spec))
    stored = cluster.specdeploy(namespace, "autoscaled")["spec"]
    assert stored["rollout"] == {"type": "Recreate"}
    assert stored["autoscaling"] == {"minReplicas": 1, "maxReplicas": 4, "target": 0.8}
    assert SpeculativeDeploymentSpec.model_validate(stored) == SpeculativeDeploymentSpec.model_validate(spec)


def test_name_must_be_a_dns_label(cluster, chart_installed, namespace):
    result = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=resource("1.starts-with-digit", VALID), check=False
    )
    assert result.returncode != 0 and "metadata.name must be a DNS-1035 label" in result.stderr, result.stderr


def test_server_defaults_equal_pydantic_defaults(cluster, chart_installed, namespace):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=resource("minimal", VALID))
    stored = cluster.specdeploy(namespace, "minimal")["spec"]
    assert stored["speculation"]["budget"] == "auto" and stored["readiness"]["startupTimeoutSeconds"] == 3600
    assert SpeculativeDeploymentSpec.model_validate(stored) == SpeculativeDeploymentSpec.model_validate(VALID)


def test_every_status_field_survives_the_structural_schema(cluster, chart_installed, namespace):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=resource("full-status", VALID))
    status = compute_status(
        name="full-status",
        generation=1,
        spec=SpeculativeDeploymentSpec.model_validate(VALID),
        deployment=DeploymentView(1, 1, 2, 1, 2, False),
        pods=[
            PodView("a", "ua", "127.1.0.1", True, True, None),
            PodView("b", "ub", "127.1.0.2", False, True, Failure(3, "Error", "smoke test failed: x")),
        ],
        samples={"ua": EngineSample(0, 0, 0, 0, True, 4.5)},
        window=Window(2.5, 42.0),
        previous={},
        now=datetime.datetime.now(datetime.timezone.utc),
        memory=MemoryCheck("Fits", "75.06 GiB of 141.00 GiB per GPU", {"routed_experts": 71345249280}, 127878),
    )
    cluster.kubectl(
        "patch",
        "specdeploy",
        "full-status",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )
    stored = cluster.status(namespace, "full-status")
    assert status_patch(stored, status) == {}, "the API server pruned or changed status fields"
    assert stored["smokeTest"]["message"].endswith("smoke test failed: x")

    # The printer columns of `kubectl get specdeploy` show them.
    row = cluster.get_row(namespace, "full-status")
    assert list(row) == ["NAME", "READY", "REPLICAS", "METHOD", "BUDGET", "ACCLEN", "TOK/S", "PHASE", "AGE"]
    assert list(row.values())[:8] == ["full-status", "1", "1", "ddtree", "auto", "2.5", "42", "Degraded"]


def test_scale_subresource_reports_selector(cluster, chart_installed, namespace):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=resource("scaled", VALID))
    cluster.kubectl(
        "patch",
        "specdeploy",
        "scaled",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": {"replicas": 1, "selector": "a=b"}}),
    )
    cluster.kubectl("scale", "specdeploy", "scaled", "-n", namespace, "--replicas=4")
    scale = json.loads(
        cluster.kubectl(
            "get", "--raw", f"/apis/ddtree.dev/v1alpha1/namespaces/{namespace}/speculativedeployments/scaled/scale"
        ).stdout
    )
    assert scale["spec"]["replicas"] == 4 and scale["status"] == {"replicas": 1, "selector": "a=b"}
    assert cluster.specdeploy(namespace, "scaled")["spec"]["replicas"] == 4


def test_short_name_and_category(cluster, chart_installed, namespace):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=resource("named", VALID))
    assert "named" in cluster.kubectl("get", "specdeploy", "-n", namespace, "-o", "name").stdout
    assert "named" in cluster.kubectl("get", "llm", "-n", namespace, "-o", "name").stdout


def test_chart_installs_with_server_side_apply(cluster, chart_installed):
    # The fixture applied `helm template` once; applying it again must be a clean no-op.
    again = cluster.kubectl("apply", "--server-side", "-f", "-", input=chart_installed)
    documents = [d for d in yaml.safe_load_all(chart_installed) if d]
    assert again.stdout.count("serverside-applied") == len(documents) == 7, again.stdout
    for kind, name in (
        ("serviceaccount", "ddtree-operator"),
        ("deployment", "ddtree-operator"),
        ("clusterrole", "ddtree-operator"),
        ("clusterrolebinding", "ddtree-operator"),
        ("clusterrole", "ddtree-view"),
        ("clusterrole", "ddtree-edit"),
    ):
        cluster.kubectl("get", kind, name, "-n", "ddtree-system")
    crd = json.loads(cluster.kubectl("get", "crd", "speculativedeployments.ddtree.dev", "-o", "json").stdout)
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
