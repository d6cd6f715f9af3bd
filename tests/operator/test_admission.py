"""The admission webhook against the real API server, wired as the chart wires it: the chart's certificate
Secret, Service and ValidatingWebhookConfiguration (rendered by helm), the operator serving HTTPS with that
certificate on the port and directory its Deployment's environment names. The Service is the chart's name
(the certificate's) made an ExternalName of 127.0.0.1, since no kube-proxy routes cluster IPs here.

A fake hub on 127.0.0.1 (the operator's HF_ENDPOINT) serves config.json files, one of them slower than the
webhook waits: that spec is admitted, then reconcile reports the same check in the Compatible condition.
"""

from __future__ import annotations

import base64
import copy
import json
import pathlib
import socket
import ssl
import time

import pytest
import yaml

from ddtree_operator.admission import run_checks
from ddtree_operator.api import SpeculativeDeploymentSpec
from ddtree_operator.fit import ConfigRef
from ddtree_operator.handlers import ADMISSION_HUB_TIMEOUT_SECONDS, HUB_TIMEOUT_SECONDS
from kube_testbed import CHART, OPERATOR_NAMESPACE, FakeHub, environment, exists, wait_for

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "data" / "model_configs"
KIMI = json.loads((CONFIGS / "kimi-k2.6.json").read_text())
QWEN_MOE = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())
SLOW_SECONDS = (ADMISSION_HUB_TIMEOUT_SECONDS + HUB_TIMEOUT_SECONDS) / 2  # past the webhook's wait, not reconcile's
SMOLLM2, SMOLLM2_DRAFTER = "smollm2-135m-instruct", "smollm2-135m-instruct-dflash"
WEBHOOK = "validate.speculativedeployments.ddtree.dev"


def config_path(repo: str) -> str:
    return f"/{repo}/resolve/main/config.json"


# path -> (config, seconds before the answer)
HUB_FILES = {
    config_path("moonshotai/Kimi-K2.6"): (KIMI, 0.0),
    config_path("Qwen/Qwen3-30B-A3B"): (QWEN_MOE, 0.0),
    config_path("org/slow-qwen"): (QWEN_MOE, SLOW_SECONDS),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def webhook(cluster, chart_installed, tmp_path_factory):
    """The chart's webhook objects registered with the API server and the operator's environment set for them
    (before the module's operator starts: autouse fixtures come first). Yields the HTTPS port."""
    rendered = cluster.helm(
        "template", "ddtree", str(CHART), "--namespace", OPERATOR_NAMESPACE,
        "--show-only", "templates/webhook.yaml", "--show-only", "templates/deployment.yaml",
    ).stdout  # fmt: skip
    docs = {d["kind"]: d for d in yaml.safe_load_all(rendered) if d}
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    (mount,) = container["volumeMounts"]
    (volume,) = docs["Deployment"]["spec"]["template"]["spec"]["volumes"]
    assert mount["mountPath"] == env["DDTREE_WEBHOOK_CERT_DIR"]
    assert volume["secret"]["secretName"] == docs["Secret"]["metadata"]["name"]
    assert {"name": "webhook", "containerPort": int(env["DDTREE_WEBHOOK_PORT"])} in container["ports"]

    cert_dir = tmp_path_factory.mktemp("webhook-cert")  # what the Secret's volume holds in the pod
    for key, value in docs["Secret"]["data"].items():
        (cert_dir / key).write_bytes(base64.b64decode(value))
    port = free_port()
    service = docs["Service"]
    service["spec"] = {"type": "ExternalName", "externalName": "127.0.0.1"}
    configuration = docs["ValidatingWebhookConfiguration"]
    configuration["webhooks"][0]["clientConfig"]["service"]["port"] = port  # an ExternalName's port is this one
    registered = {"kind": "List", "apiVersion": "v1", "items": [service, configuration]}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(registered))

    hub = FakeHub(HUB_FILES)
    try:
        with environment(
            HF_ENDPOINT=hub.endpoint, DDTREE_WEBHOOK_PORT=str(port), DDTREE_WEBHOOK_CERT_DIR=str(cert_dir)
        ):
            yield port, cert_dir
    finally:
        cluster.kubectl("delete", "validatingwebhookconfiguration", configuration["metadata"]["name"])
        cluster.kubectl("delete", "service", service["metadata"]["name"], "-n", OPERATOR_NAMESPACE)
        hub.close()


def answers_tls(port: int, cert_dir: pathlib.Path) -> bool:
    """The operator's endpoint completes a TLS handshake, verified as the API server verifies it."""
    context = ssl.create_default_context(cafile=str(cert_dir / "ca.crt"))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as raw:
            with context.wrap_socket(raw, server_hostname=f"ddtree-webhook.{OPERATOR_NAMESPACE}.svc"):
                return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def serving(webhook, operator):
    port, cert_dir = webhook
    wait_for(lambda: answers_tls(port, cert_dir), 60, f"the operator's webhook on 127.0.0.1:{port}")


pytestmark = pytest.mark.usefixtures("serving")


def resource(name: str, spec: dict) -> str:
    doc = {"apiVersion": "ddtree.dev/v1alpha1", "kind": "SpeculativeDeployment", "metadata": {"name": name}}
    return json.dumps({**doc, "spec": spec})


def apply(cluster, namespace, name, spec, check=True):
    return cluster.kubectl("apply", "-n", namespace, "-f", "-", input=resource(name, spec), check=check)


def refusal(spec: dict, fetched: dict) -> str:
    """What the webhook must say, from the same configs and the same checks."""
    message = run_checks(SpeculativeDeploymentSpec.model_validate(spec), fetched).refusal()
    assert message is not None
    return message


def assert_refused(cluster, namespace, name, spec, fetched):
    result = apply(cluster, namespace, name, spec, check=False)
    assert result.returncode != 0, result.stdout
    assert f'admission webhook "{WEBHOOK}" denied the request: {refusal(spec, fetched)}' in result.stderr, result.stderr
    assert not exists(lambda: cluster.specdeploy(namespace, name))


def test_a_drafter_of_another_model_is_refused_when_applied(cluster, namespace):
    spec = {"model": {"uri": "Qwen/Qwen3-30B-A3B"}, "drafter": {"uri": SMOLLM2_DRAFTER}}
    assert_refused(cluster, namespace, "wrong-drafter", spec, {ConfigRef("Qwen/Qwen3-30B-A3B", "main"): QWEN_MOE})


def test_a_split_that_does_not_divide_the_model_is_refused(cluster, namespace):
    spec = {"model": {"uri": SMOLLM2}, "drafter": {"uri": SMOLLM2_DRAFTER}, "parallelism": {"tensor": 2}}
    spec["resources"] = {"gpus": 2}
    assert_refused(cluster, namespace, "bad-split", spec, {})
    assert "tensor parallel 2 does not divide the model: 9 attention heads, 3 KV heads" in refusal(spec, {})


def test_a_model_that_does_not_fit_its_gpus_is_refused(cluster, namespace):
    spec = {
        "model": {"uri": "moonshotai/Kimi-K2.6", "trustRemoteCode": True},
        "speculation": {"method": "none"},
        "resources": {"gpus": 1, "gpuMemory": "141Gi"},
    }
    assert_refused(cluster, namespace, "too-big", spec, {ConfigRef("moonshotai/Kimi-K2.6", "main"): KIMI})
    assert refusal(spec, {ConfigRef("moonshotai/Kimi-K2.6", "main"): KIMI}).startswith(
        "the model does not fit its GPUs: needs "
    )


def test_a_good_spec_is_admitted_and_a_bad_update_of_it_refused(cluster, namespace):
    good = {"model": {"uri": SMOLLM2}, "drafter": {"uri": SMOLLM2_DRAFTER}}
    result = apply(cluster, namespace, "smol", good)
    assert "Warning" not in result.stderr, result.stderr
    wait_for(lambda: exists(lambda: cluster.apps.read_namespaced_deployment("smol", namespace)), 30, "the Deployment")
    compatible = wait_for(lambda: cluster.condition(namespace, "smol", "Compatible"), 30, "a Compatible condition")
    assert (compatible["status"], compatible["reason"]) == ("True", "Compatible")

    bad = copy.deepcopy(good)
    bad["parallelism"], bad["resources"] = {"tensor": 2}, {"gpus": 2}
    patch = cluster.kubectl(
        "patch", "specdeploy", "smol", "-n", namespace, "--type=merge", "-p", json.dumps({"spec": bad}), check=False
    )
    assert patch.returncode != 0 and refusal(bad, {}) in patch.stderr, patch.stderr
    assert cluster.specdeploy(namespace, "smol")["spec"]["parallelism"]["tensor"] == 1
    # metadata alone is never checked (kopf's own finalizer patches go through the same webhook)
    cluster.kubectl("label", "specdeploy", "smol", "-n", namespace, "team=llm")


def test_a_config_the_webhook_cannot_fetch_in_time_is_admitted_and_checked_at_reconcile(cluster, namespace):
    spec = {"model": {"uri": "org/slow-qwen"}, "drafter": {"uri": SMOLLM2_DRAFTER}}
    start = time.monotonic()
    result = apply(cluster, namespace, "slow", spec)
    took = time.monotonic() - start
    assert took < ADMISSION_HUB_TIMEOUT_SECONDS + 3, f"the apply waited {took:.1f}s"
    assert "Warning: not checked: the config of spec.model org/slow-qwen: " in result.stderr, result.stderr

    # reconcile waits longer for the hub, then reports what the webhook would have said, and creates nothing
    compatible = wait_for(
        lambda: (c := cluster.condition(namespace, "slow", "Compatible")).get("status") == "False" and c,
        SLOW_SECONDS + 30,
        "Compatible=False",
    )
    expected = run_checks(
        SpeculativeDeploymentSpec.model_validate(spec), {ConfigRef("org/slow-qwen", "main"): QWEN_MOE}
    ).compatibility.message
    assert (compatible["reason"], compatible["message"]) == ("Incompatible", expected)
    assert expected.startswith(f"spec.drafter {SMOLLM2_DRAFTER} does not fit spec.model org/slow-qwen: vocabulary")
    ready = cluster.condition(namespace, "slow", "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "Incompatible")
    assert cluster.status(namespace, "slow")["phase"] == "Failed"

    def event():
        events = cluster.core.list_namespaced_event(namespace).items
        return next((e for e in events if e.reason == "Incompatible" and e.involved_object.name == "slow"), None)

    assert wait_for(event, 30, "an Incompatible Event").message == expected
    assert not exists(lambda: cluster.apps.read_namespaced_deployment("slow", namespace))

    # the fix is admitted without waiting on the hub again (the config is cached) and gets its Deployment
    start = time.monotonic()
    apply(cluster, namespace, "slow", {"model": {"uri": "org/slow-qwen"}, "speculation": {"method": "none"}})
    assert time.monotonic() - start < SLOW_SECONDS
    wait_for(lambda: exists(lambda: cluster.apps.read_namespaced_deployment("slow", namespace)), 30, "the Deployment")
    wait_for(lambda: cluster.condition(namespace, "slow", "Compatible").get("status") == "True", 30, "Compatible")


def test_a_drafter_on_a_volume_is_admitted_with_a_warning_and_served(cluster, namespace):
    spec = {"model": {"uri": SMOLLM2}, "drafter": {"uri": "pvc://models/drafter"}}
    result = apply(cluster, namespace, "on-volume", spec)
    assert "Warning: not checked: the config of spec.drafter pvc://models/drafter: " in result.stderr, result.stderr
    wait_for(
        lambda: exists(lambda: cluster.apps.read_namespaced_deployment("on-volume", namespace)), 30, "the Deployment"
    )
    compatible = wait_for(lambda: cluster.condition(namespace, "on-volume", "Compatible"), 30, "Compatible")
    assert (compatible["status"], compatible["reason"]) == ("Unknown", "ConfigUnavailable")
