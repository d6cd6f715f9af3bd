"""The Helm chart: lint, schema-validated values, least-privilege RBAC, what the operator Deployment runs."""

import os
import subprocess

import pytest
import yaml

from kube_testbed import BIN_DIR, CHART, missing


@pytest.fixture(scope="module")
def helm() -> str:
    path = BIN_DIR / "helm"
    if not os.access(path, os.X_OK):
        missing(f"{path} is missing")
    return str(path)


def template(helm: str, *args: str) -> list[dict]:
    result = subprocess.run(
        [helm, "template", "ddtree", str(CHART), "--namespace", "ddtree-system", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def test_helm_lint_is_clean(helm):
    result = subprocess.run([helm, "lint", "--strict", str(CHART)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


def test_renders_the_expected_objects(helm):
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in template(helm))
    assert kinds == [
        ("ClusterRole", "ddtree-operator"),
        ("ClusterRoleBinding", "ddtree-operator"),
        ("CustomResourceDefinition", "speculativedeployments.ddtree.dev"),
        ("Deployment", "ddtree-operator"),
        ("ServiceAccount", "ddtree-operator"),
    ]


def test_operator_deployment(helm):
    docs = template(helm, "--set", "engine.image.repository=reg.example/engine", "--set", "engine.image.tag=1.2")
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "ddtree-operator:0.1.0"
    assert container["command"] == ["kopf"]
    assert container["args"][:2] == ["run", "--standalone"] and "--all-namespaces" in container["args"]
    assert container["args"][-2:] == ["-m", "ddtree_operator.handlers"]
    assert {"name": "DDTREE_ENGINE_IMAGE", "value": "reg.example/engine:1.2"} in container["env"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["serviceAccountName"] == "ddtree-operator"


def test_watch_namespaces_and_log_level(helm):
    docs = template(helm, "--set", "operator.watchNamespaces={llm,research}", "--set", "operator.logLevel=verbose")
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" not in args
    assert {"--namespace=llm", "--namespace=research", "--verbose"} <= set(args)


def test_hub_endpoint_is_the_operators_hf_endpoint(helm):
    def env(*args):
        docs = template(helm, *args)
        return next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]

    assert "HF_ENDPOINT" not in {e["name"] for e in env()}  # the operator's default: https://huggingface.co
    mirror = "https://hub-mirror.example"
    assert {"name": "HF_ENDPOINT", "value": mirror} in env("--set", f"operator.hubEndpoint={mirror}")


def test_values_schema_rejects_typos(helm):
    result = subprocess.run(
        [helm, "template", "ddtree", str(CHART), "--set", "operator.logLevl=debug"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "logLevl" in result.stderr


def test_crd_can_be_left_out(helm):
    kinds = {d["kind"] for d in template(helm, "--set", "crds.install=false")}
    assert "CustomResourceDefinition" not in kinds


def test_rbac_has_no_wildcards(helm):
    role = next(d for d in template(helm) if d["kind"] == "ClusterRole")
    for rule in role["rules"]:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key], rule
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert ("ddtree.dev", "speculativedeployments/status", "patch") in granted
    assert ("", "secrets", "get") not in granted  # the operator never reads Secrets
