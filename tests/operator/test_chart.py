"""The Helm chart: lint, schema-validated values, least-privilege RBAC, what the operator Deployment runs."""

import base64
import json
import subprocess

import pytest
import yaml

from ddtree_operator.handlers import ADMISSION_HUB_TIMEOUT_SECONDS, WEBHOOK_ID
from ddtree_operator.render import engine_defaults_from_env
from kube_testbed import CHART, OPERATOR_NAMESPACE, OPERATOR_SA

RBAC_GROUP = "rbac.authorization.k8s.io"
DIGEST = "sha256:" + "0123456789abcdef" * 4
NAMESPACED = ("--set", "operator.watchNamespaces={llm,research}")


def render(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [helm, "template", "ddtree", str(CHART), "--namespace", OPERATOR_NAMESPACE, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def template(helm: str, *args: str) -> list[dict]:
    result = render(helm, *args)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def operator_container(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]


def engine_defaults(helm: str, *args: str) -> dict:
    env = {e["name"]: e["value"] for e in operator_container(template(helm, *args))["env"]}
    return json.loads(env["DDTREE_ENGINE_DEFAULTS"])


def granted(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


@pytest.mark.parametrize(
    "values",
    [(), NAMESPACED, ("--set", "dashboards.enabled=true", "--set", "alerts.enabled=true")],
    ids=["default", "namespaced", "dashboards-and-alerts"],
)
def test_helm_lint_is_clean(helm, values):
    result = subprocess.run([helm, "lint", "--strict", str(CHART), *values], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


def test_renders_the_expected_objects(helm):
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in template(helm))
    assert kinds == [
        ("ClusterRole", "ddtree-edit"),
        ("ClusterRole", "ddtree-operator"),
        ("ClusterRole", "ddtree-view"),
        ("ClusterRoleBinding", "ddtree-operator"),
        ("CustomResourceDefinition", "speculativedeployments.ddtree.dev"),
        ("Deployment", "ddtree-operator"),
        ("Secret", "ddtree-webhook-tls"),
        ("Service", "ddtree-webhook"),
        ("ServiceAccount", "ddtree-operator"),
        ("ValidatingWebhookConfiguration", "ddtree-webhook"),
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


@pytest.mark.parametrize(
    "value, named",
    [
        ("operator.logLevl=debug", "logLevl"),
        ("engine.podLabel.team=llm", "podLabel"),
        ("alerts.acceptance.minLenght=2", "minLenght"),
        ("engine.image.digest=0123abcd", "digest"),
        ("autoscaling.provider=hpa", "provider"),
        ("engine.cache.sizeLimit=lots", "sizeLimit"),
    ],
)
def test_values_schema_rejects_typos_and_bad_values(helm, value, named):
    result = render(helm, "--set", value)
    assert result.returncode != 0 and named in result.stderr, result.stderr


def test_values_schema_accepts_helms_global_values(helm):
    """A parent chart's `global:` reaches this chart's values as a subchart: it must validate."""
    docs = template(helm, "--set", "global.imageRegistry=reg.example", "--set", "global.team=llm")
    assert any(d["kind"] == "Deployment" for d in docs)


def test_engine_defaults_by_default(helm):
    assert engine_defaults(helm) == {"nodeGpus": 8, "autoscalingProvider": "prometheus-adapter"}


def test_engine_defaults_carry_every_engine_pod_setting(helm):
    engine = {
        "imagePullSecrets": [{"name": "regcred"}],
        "serviceAccountName": "llm-engine",
        "podLabels": {"team": "llm", "cost-center": "42"},
        "podAnnotations": {"sidecar.istio.io/inject": "false"},
        "priorityClassName": "inference-high",
        "cache": {"sizeLimit": "100Gi"},
        "nodeGpus": 4,
    }
    values = (
        "--set-json",
        f"engine={json.dumps(engine)}",
        "--set",
        "autoscaling.provider=keda",
        "--set",
        "autoscaling.kedaPrometheusAddress=http://prometheus.monitoring:9090",
    )
    rendered = engine_defaults(helm, *values)
    assert rendered == {
        "imagePullSecrets": [{"name": "regcred"}],
        "serviceAccountName": "llm-engine",
        "podLabels": {"team": "llm", "cost-center": "42"},
        "podAnnotations": {"sidecar.istio.io/inject": "false"},
        "priorityClassName": "inference-high",
        "cache": {"sizeLimit": "100Gi"},
        "nodeGpus": 4,
        "autoscalingProvider": "keda",
        "kedaPrometheusAddress": "http://prometheus.monitoring:9090",
    }
    # what the chart writes is what the operator reads
    defaults = engine_defaults_from_env({"DDTREE_ENGINE_DEFAULTS": json.dumps(rendered)})
    assert (defaults.node_gpus, defaults.autoscaling_provider, defaults.pod_labels["team"]) == (4, "keda", "llm")
    assert str(defaults.cache.size_limit) == "100Gi" and defaults.image_pull_secrets[0].name == "regcred"


def test_engine_cache_is_an_existing_claim_or_a_sized_empty_dir_not_both(helm):
    assert engine_defaults(helm, "--set", "engine.cache.existingClaim=model-cache")["cache"] == {
        "claimName": "model-cache"
    }
    both = render(helm, "--set", "engine.cache.existingClaim=model-cache", "--set", "engine.cache.sizeLimit=10Gi")
    assert both.returncode != 0
    assert (
        "engine.cache: set sizeLimit (an emptyDir) or existingClaim (a PersistentVolumeClaim), not both" in both.stderr
    )


def test_images_can_be_pinned_by_digest(helm):
    docs = template(
        helm,
        "--set", f"operator.image.digest={DIGEST}",
        "--set", "engine.image.repository=reg.example/engine",
        "--set", "engine.image.tag=1.2",
        "--set", f"engine.image.digest={DIGEST}",
    )  # fmt: skip
    container = operator_container(docs)
    assert container["image"] == f"ddtree-operator@{DIGEST}"  # the digest wins over tag and appVersion
    assert {"name": "DDTREE_ENGINE_IMAGE", "value": f"reg.example/engine@{DIGEST}"} in container["env"]


def test_dashboards_and_alerts_are_opt_in(helm):
    assert not {"ConfigMap", "PrometheusRule"} & {d["kind"] for d in template(helm)}


def test_dashboard_config_map_for_the_grafana_sidecar(helm):
    (config_map,) = (d for d in template(helm, "--set", "dashboards.enabled=true") if d["kind"] == "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == OPERATOR_NAMESPACE
    dashboard = json.loads(config_map["data"]["speculativedeployment.json"])
    assert dashboard["uid"] == "ddtree-speculativedeployment" and dashboard["panels"]
    (moved,) = (
        d
        for d in template(
            helm,
            "--set",
            "dashboards.enabled=true",
            "--set",
            "dashboards.label=dashboards.example/grafana",
            "--set",
            "dashboards.labelValue=llm",
            "--set",
            "dashboards.namespace=monitoring",
            "--set",
            "dashboards.annotations.grafana_folder=LLM",
        )  # fmt: skip
        if d["kind"] == "ConfigMap"
    )
    assert moved["metadata"]["labels"]["dashboards.example/grafana"] == "llm"
    assert "grafana_dashboard" not in moved["metadata"]["labels"]
    assert moved["metadata"]["namespace"] == "monitoring"
    assert moved["metadata"]["annotations"] == {"grafana_folder": "LLM"}


def test_alert_thresholds_come_from_values(helm):
    (rule,) = (
        d
        for d in template(
            helm,
            "--set",
            "alerts.enabled=true",
            "--set",
            "alerts.labels.release=kube-prometheus-stack",
            "--set",
            "alerts.ruleLabels.team=llm",
            "--set-json",
            "alerts.acceptance.minLength=2.5",  # --set would pass the string "2.5"
            "--set",
            "alerts.acceptance.window=30m",
            "--set-json",
            "alerts.acceptance.minRatioToBaseline=0.5",
            "--set",
            "alerts.acceptance.baselineWindow=7d",
            "--set",
            "alerts.smokeTest.notPassedFor=2h",
            "--set",
            "alerts.stalled.window=10m",
        )  # fmt: skip
        if d["kind"] == "PrometheusRule"
    )
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    alerts = {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}
    assert set(alerts) == {
        "DDTreeAcceptanceLengthLow",
        "DDTreeAcceptanceLengthBelowBaseline",
        "DDTreeSmokeTestNotPassed",
        "DDTreeNoTokensWhileRequestsWait",
    }
    assert all(a["labels"]["team"] == "llm" for a in alerts.values())
    low, baseline = alerts["DDTreeAcceptanceLengthLow"], alerts["DDTreeAcceptanceLengthBelowBaseline"]
    assert "< 2.5" in low["expr"] and "[30m]" in low["expr"]
    assert "< 0.5 * (1 + " in baseline["expr"] and "[7d]" in baseline["expr"] and "[30m]" in baseline["expr"]
    assert alerts["DDTreeSmokeTestNotPassed"]["for"] == "2h"
    assert "[10m]" in alerts["DDTreeNoTokensWhileRequestsWait"]["expr"]
    # Prometheus expands these; Helm must leave them alone
    assert "{{ $labels.job }}" in low["annotations"]["summary"]


def test_crd_can_be_left_out(helm):
    kinds = {d["kind"] for d in template(helm, "--set", "crds.install=false")}
    assert "CustomResourceDefinition" not in kinds


def test_rbac_has_no_wildcards(helm):
    for values in ((), NAMESPACED):
        for role in (d for d in template(helm, *values) if d["kind"] in ("ClusterRole", "Role")):
            for rule in role["rules"]:
                for key in ("apiGroups", "resources", "verbs"):
                    assert "*" not in rule[key], rule
    role = next(d for d in template(helm) if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "ddtree-operator")
    rules = granted(role["rules"])
    assert ("ddtree.dev", "speculativedeployments/status", "patch") in rules
    assert ("", "secrets", "get") not in rules  # the operator never reads Secrets
    # kopf lists namespaces only when it watches some of them (--namespace), never with --all-namespaces
    assert ("", "namespaces", "list") not in rules


def test_operator_may_manage_its_optional_children_and_no_more(helm):
    """PodMonitors, PDBs, HPAs and ScaledObjects: read (only the resource's own are deleted), applied and
    deleted; never listed, watched or updated."""
    role = next(d for d in template(helm) if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "ddtree-operator")
    rules = granted(role["rules"])
    for group, resource in [
        ("monitoring.coreos.com", "podmonitors"),
        ("policy", "poddisruptionbudgets"),
        ("autoscaling", "horizontalpodautoscalers"),
        ("keda.sh", "scaledobjects"),
    ]:
        assert {(group, resource, verb) for verb in ("get", "create", "patch", "delete")} <= rules, resource
        assert not {(group, resource, verb) for verb in ("list", "watch", "update")} & rules, resource


def test_namespaced_mode_grants_roles_per_watched_namespace(helm):
    docs = template(helm, *NAMESPACED)
    cluster_wide = template(helm)
    operator_rules = next(
        d["rules"] for d in cluster_wide if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "ddtree-operator"
    )
    roles = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "Role"}
    bindings = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "RoleBinding"}
    assert set(roles) == set(bindings) == {"llm", "research"}
    for namespace, binding in bindings.items():
        assert binding["roleRef"] == {"apiGroup": RBAC_GROUP, "kind": "Role", "name": "ddtree-operator"}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": OPERATOR_SA, "namespace": OPERATOR_NAMESPACE}]
        # everything the all-namespaces ClusterRole grants on namespaced resources, in this namespace only
        cluster_scoped = {("apiextensions.k8s.io", "customresourcedefinitions")}
        assert granted(roles[namespace]["rules"]) == {
            (g, r, v) for g, r, v in granted(operator_rules) if (g, r) not in cluster_scoped
        }
    (operator_cluster_role,) = (
        d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "ddtree-operator"
    )
    # cluster-wide: only what kopf watches in --namespace mode, read-only
    assert granted(operator_cluster_role["rules"]) == {
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
        ("", "namespaces", "list"),
        ("", "namespaces", "watch"),
    }


def test_user_roles_aggregate_into_the_builtin_roles(helm):
    roles = {d["metadata"]["name"]: d for d in template(helm) if d["kind"] == "ClusterRole"}
    view, edit = roles["ddtree-view"], roles["ddtree-edit"]
    aggregate = "rbac.authorization.k8s.io/aggregate-to-"
    assert {k for k, v in view["metadata"]["labels"].items() if k.startswith(aggregate) and v == "true"} == {
        f"{aggregate}view"
    }
    assert {k for k, v in edit["metadata"]["labels"].items() if k.startswith(aggregate) and v == "true"} == {
        f"{aggregate}edit",
        f"{aggregate}admin",
    }
    read = {"get", "list", "watch"}
    assert granted(view["rules"]) == {
        ("ddtree.dev", resource, verb)
        for resource in ("speculativedeployments", "speculativedeployments/status", "speculativedeployments/scale")
        for verb in read
    }
    edit_rules = granted(edit["rules"])
    assert {("ddtree.dev", "speculativedeployments", v) for v in read | {"create", "patch", "delete"}} <= edit_rules
    assert ("ddtree.dev", "speculativedeployments/scale", "patch") in edit_rules
    assert ("ddtree.dev", "speculativedeployments/status", "patch") not in edit_rules  # status is the operator's
    names = {d["metadata"]["name"] for d in template(helm, "--set", "rbac.userRoles=false")}
    assert not {"ddtree-view", "ddtree-edit"} & names


def webhook_objects(docs: list[dict]) -> dict[str, dict]:
    kinds = ("Secret", "Service", "ValidatingWebhookConfiguration", "Certificate", "Issuer")
    return {d["kind"]: d for d in docs if d["kind"] in kinds}


def test_the_webhook_is_served_with_the_certificate_the_api_server_trusts(helm, tmp_path):
    docs = template(helm)
    objects = webhook_objects(docs)
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["DDTREE_WEBHOOK_PORT"] == "9443" and {"name": "webhook", "containerPort": 9443} in container["ports"]
    assert container["volumeMounts"] == [
        {"name": "webhook-cert", "mountPath": env["DDTREE_WEBHOOK_CERT_DIR"], "readOnly": True}
    ]
    assert pod["volumes"] == [{"name": "webhook-cert", "secret": {"secretName": "ddtree-webhook-tls"}}]
    assert objects["Service"]["spec"]["ports"] == [{"name": "webhook", "port": 443, "targetPort": "webhook"}]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert objects["Service"]["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]

    (hook,) = objects["ValidatingWebhookConfiguration"]["webhooks"]
    assert hook["clientConfig"]["service"] == {
        "name": "ddtree-webhook",
        "namespace": OPERATOR_NAMESPACE,
        "path": f"/{WEBHOOK_ID}",  # kopf routes a request to the handler its path names
        "port": 443,
    }
    # a down operator never blocks an apply, and the API server outwaits the operator's own fetch
    assert hook["failurePolicy"] == "Ignore" and hook["timeoutSeconds"] > ADMISSION_HUB_TIMEOUT_SECONDS
    assert hook["rules"] == [
        {
            "apiGroups": ["ddtree.dev"],
            "apiVersions": ["v1alpha1"],
            "resources": ["speculativedeployments"],
            "operations": ["CREATE", "UPDATE"],
            "scope": "Namespaced",
        }
    ]
    assert "namespaceSelector" not in hook and hook["sideEffects"] == "None"

    # the CA the API server is given signed the serving certificate, which names the Service
    data = objects["Secret"]["data"]
    assert objects["Secret"]["type"] == "kubernetes.io/tls" and hook["clientConfig"]["caBundle"] == data["ca.crt"]
    for key in ("ca.crt", "tls.crt"):
        (tmp_path / key).write_bytes(base64.b64decode(data[key]))
    verify = subprocess.run(
        ["openssl", "verify", "-CAfile", str(tmp_path / "ca.crt"), str(tmp_path / "tls.crt")],
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    names = subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(tmp_path / "tls.crt")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"DNS:ddtree-webhook.{OPERATOR_NAMESPACE}.svc" in names, names


def test_the_webhook_settings_and_namespaced_mode(helm):
    docs = template(helm, *NAMESPACED, "--set", "webhook.failurePolicy=Fail", "--set", "webhook.timeoutSeconds=20")
    (hook,) = webhook_objects(docs)["ValidatingWebhookConfiguration"]["webhooks"]
    assert (hook["failurePolicy"], hook["timeoutSeconds"]) == ("Fail", 20)
    assert hook["namespaceSelector"] == {
        "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["llm", "research"]}]
    }


def test_cert_manager_issues_the_webhook_certificate_when_enabled(helm):
    objects = webhook_objects(template(helm, "--set", "webhook.certManager.enabled=true"))
    assert "Secret" not in objects  # cert-manager writes it
    certificate, issuer = objects["Certificate"], objects["Issuer"]
    assert certificate["spec"]["secretName"] == "ddtree-webhook-tls"
    assert f"ddtree-webhook.{OPERATOR_NAMESPACE}.svc" in certificate["spec"]["dnsNames"]
    assert certificate["spec"]["issuerRef"] == {"kind": "Issuer", "name": issuer["metadata"]["name"]}
    assert issuer["spec"] == {"selfSigned": {}}
    configuration = objects["ValidatingWebhookConfiguration"]
    # cainjector fills in the CA bundle from the Certificate
    assert configuration["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": f"{OPERATOR_NAMESPACE}/ddtree-webhook"
    }
    assert "caBundle" not in configuration["webhooks"][0]["clientConfig"]

    own = webhook_objects(
        template(
            helm,
            "--set",
            "webhook.certManager.enabled=true",
            "--set",
            "webhook.certManager.issuerRef.kind=ClusterIssuer",
            "--set",
            "webhook.certManager.issuerRef.name=company-ca",
        )
    )
    assert "Issuer" not in own
    assert own["Certificate"]["spec"]["issuerRef"] == {"kind": "ClusterIssuer", "name": "company-ca"}


def test_the_webhook_can_be_turned_off(helm):
    docs = template(helm, "--set", "webhook.enabled=false")
    assert webhook_objects(docs) == {}
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert "volumes" not in pod and "volumeMounts" not in pod["containers"][0]
    assert not {e["name"] for e in pod["containers"][0]["env"]} & {"DDTREE_WEBHOOK_PORT", "DDTREE_WEBHOOK_CERT_DIR"}


@pytest.mark.parametrize(
    "value, named",
    [("webhook.failurePolicy=Never", "failurePolicy"), ("webhook.timeoutSeconds=60", "timeoutSeconds")],
)
def test_values_schema_rejects_bad_webhook_settings(helm, value, named):
    result = render(helm, "--set", value)
    assert result.returncode != 0 and named in result.stderr, result.stderr
