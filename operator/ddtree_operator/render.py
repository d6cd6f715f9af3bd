"""Pure functions from a SpeculativeDeployment spec to the Kubernetes objects that run it.

No I/O here: the handlers server-side-apply whatever these functions return, so the same spec always
yields the same objects (idempotent reconcile, deterministic names, no duplicates after a restart).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
from typing import Any

import yaml

from . import api
from .api import SpeculativeDeploymentSpec

ENGINE_CONTAINER = "engine"
PORT_NAME = "http"
MANAGED_BY = "ddtree-operator"
OWNER_LABEL = f"{api.GROUP}/speculativedeployment"
APP_NAME = "ddtree-engine"
CACHE_DIR = "/var/cache/ddtree"
PVC_MOUNT_ROOT = "/mnt/pvc"
TERMINATION_LOG = "/dev/termination-log"
ENGINE_UID = 1000  # the `ddtree` user of the Dockerfile's engine image
STARTUP_PROBE_PERIOD_SECONDS = 10
# Deployment progress is judged after the startup probe had its whole budget, plus scheduling/pull slack.
PROGRESS_DEADLINE_SLACK_SECONDS = 600
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
# The CRD's speculation.method `none` is the engine's method `ar` (plain autoregressive decoding).
ENGINE_METHOD = {"ddtree": "ddtree", "dflash": "dflash", "none": "ar"}
CONFIG_MOUNT = "/etc/ddtree"  # the engine configuration ConfigMap, mounted read-only
API_KEYS_MOUNT = "/etc/ddtree-api-keys"  # spec.serving.apiKeySecret's key, as the file API_KEYS_FILE
API_KEYS_FILE = "api-keys"
CONFIG_FILE = "engine.yaml"
CONFIG_VOLUME = "engine-config"
CONFIG_HASH_ANNOTATION = f"{api.GROUP}/engine-config-sha256"


@dataclasses.dataclass(frozen=True)
class Owner:
    """The identity of the custom resource that its children reference."""

    name: str
    namespace: str
    uid: str


@dataclasses.dataclass(frozen=True)
class EngineDefaults:
    """Operator-wide settings (Helm values) used where a spec leaves them out."""

    image: str
    image_pull_policy: str = "IfNotPresent"


def selector_labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": APP_NAME, OWNER_LABEL: name}


def selector_string(name: str) -> str:
    """`status.selector`: what HPA and `kubectl scale` use to find the pods."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": f"{api.GROUP}/{api.VERSION}",
        "kind": api.KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(owner: Owner) -> dict[str, Any]:
    return {
        "name": owner.name,
        "namespace": owner.namespace,
        "labels": labels(owner.name),
        "ownerReferences": [owner_reference(owner)],
    }


@dataclasses.dataclass(frozen=True)
class ResolvedUri:
    """What `--model`/`--drafter` get, and the PVC to mount for it (pvc:// uris only)."""

    arg: str
    claim: str | None = None


def resolve_uri(uri: str) -> ResolvedUri:
    if uri.startswith("pvc://"):
        claim, _, path = uri.removeprefix("pvc://").partition("/")
        return ResolvedUri(f"{PVC_MOUNT_ROOT}/{claim}/{path}", claim)
    if uri.startswith("hf://"):
        return ResolvedUri(uri.removeprefix("hf://"))
    return ResolvedUri(uri)  # hub id, absolute path in the image, or built-in id: the engine resolves it


def engine_config(spec: SpeculativeDeploymentSpec) -> dict[str, Any]:
    """The engine's configuration file for this spec: the sections and field names of the engine's
    `ddtree.config.EngineConfig` (docs/engine.md, "Configuration"), so that a setting is named once."""
    model: dict[str, Any] = {"id": resolve_uri(spec.model.uri).arg}
    if spec.model.revision:
        model["revision"] = spec.model.revision
    if spec.model.trust_remote_code:
        model["trust_remote_code"] = True
    if spec.drafter is not None:
        model["drafter"] = resolve_uri(spec.drafter.uri).arg
        if spec.drafter.revision:
            model["drafter_revision"] = spec.drafter.revision
    speculation_spec = spec.speculation
    budget: int | dict[int, int] = speculation_spec.budget
    if speculation_spec.budget_by_batch_size:
        budget = {
            s.max_batch_size: s.budget
            for s in sorted(speculation_spec.budget_by_batch_size, key=lambda s: s.max_batch_size)
        }
    speculation: dict[str, Any] = {"method": ENGINE_METHOD[speculation_spec.method], "budget": budget}
    if speculation_spec.block_size is not None:
        speculation["block_size"] = speculation_spec.block_size
    config: dict[str, Any] = {"model": model, "speculation": speculation}
    if speculation_spec.batch_buckets:
        config["kernels"] = {"batch_buckets": sorted(speculation_spec.batch_buckets)}
    parallel: dict[str, Any] = {}
    if spec.parallelism.tensor > 1:
        parallel["tensor_parallel"] = spec.parallelism.tensor
    if spec.parallelism.expert is not None:
        parallel["expert_parallel"] = spec.parallelism.expert
    if parallel:
        config["parallel"] = parallel
    serving: dict[str, Any] = {"host": "0.0.0.0", "port": spec.metrics.port, "termination_log": TERMINATION_LOG}
    if spec.engine.max_batch_size is not None:
        serving["max_batch_size"] = spec.engine.max_batch_size
    if spec.engine.max_seq_len is not None:
        serving["max_seq_len"] = spec.engine.max_seq_len
    if spec.model.served_name:
        serving["served_model_name"] = spec.model.served_name
    if spec.serving.api_key_secret is not None:
        serving["api_key_file"] = f"{API_KEYS_MOUNT}/{API_KEYS_FILE}"
    config["serving"] = serving
    return config


def engine_config_text(spec: SpeculativeDeploymentSpec) -> str:
    return yaml.safe_dump(engine_config(spec), sort_keys=False)


def engine_args(spec: SpeculativeDeploymentSpec) -> list[str]:
    """Arguments of `ddtree serve` (the container command): the mounted configuration file, then the
    spec's extra flags, which override it."""
    return ["--config", f"{CONFIG_MOUNT}/{CONFIG_FILE}", *spec.engine.args]


NCCL_DEFAULT_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def _env(spec: SpeculativeDeploymentSpec) -> list[dict[str, Any]]:
    env = [
        {"name": "DDTREE_CACHE", "value": CACHE_DIR},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
    ]
    if spec.model_cache is not None and spec.model_cache.read_only:
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})  # a read-only cache cannot take downloads
    if spec.parallelism.tensor > 1:
        # NCCL between the replica's GPUs: NVLink multicast (NVLS) off unless spec.engine.env turns it on;
        # on shared hosts a program using it can take the GPUs out of service.
        own = {var.name for var in spec.engine.env}
        env += [{"name": name, "value": value} for name, value in NCCL_DEFAULT_ENV.items() if name not in own]
    for var in spec.engine.env:
        env.append(var.model_dump(by_alias=True, exclude_none=True))
    return env


def _volumes(owner: Owner, spec: SpeculativeDeploymentSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(spec.resources.shared_memory_size)}},
        {"name": CONFIG_VOLUME, "configMap": {"name": owner.name}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": CONFIG_VOLUME, "mountPath": CONFIG_MOUNT, "readOnly": True},
    ]
    if spec.model_cache is not None:
        volumes.append(
            {
                "name": "cache",
                "persistentVolumeClaim": {
                    "claimName": spec.model_cache.claim_name,
                    "readOnly": spec.model_cache.read_only,
                },
            }
        )
        mounts.append({"name": "cache", "mountPath": CACHE_DIR, "readOnly": spec.model_cache.read_only})
    else:
        volumes.append({"name": "cache", "emptyDir": {}})
        mounts.append({"name": "cache", "mountPath": CACHE_DIR})
    secret = spec.serving.api_key_secret
    if secret is not None:
        items = [{"key": secret.key, "path": API_KEYS_FILE}]
        volumes.append({"name": "api-keys", "secret": {"secretName": secret.name, "items": items}})
        mounts.append({"name": "api-keys", "mountPath": API_KEYS_MOUNT, "readOnly": True})
    uris = [spec.model.uri] + ([spec.drafter.uri] if spec.drafter is not None else [])
    claims = list(dict.fromkeys(c for c in (resolve_uri(u).claim for u in uris) if c))
    for index, claim in enumerate(claims):
        volumes.append({"name": f"weights-{index}", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": f"weights-{index}", "mountPath": f"{PVC_MOUNT_ROOT}/{claim}", "readOnly": True})
    return volumes, mounts


def _resources(spec: SpeculativeDeploymentSpec) -> dict[str, Any]:
    res = spec.resources
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if res.cpu is not None:
        requests["cpu"] = str(res.cpu)
    if res.memory is not None:
        requests["memory"] = limits["memory"] = str(res.memory)
    if res.gpus:
        limits[GPU_RESOURCE] = str(res.gpus)
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def _http_probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": 5,  # /health can stall for seconds under load
        "failureThreshold": failures,
    }


def _affinity(spec: SpeculativeDeploymentSpec) -> dict[str, Any] | None:
    affinity = copy.deepcopy(spec.scheduling.affinity or {})
    if spec.resources.gpu_product:
        wanted = {"key": GPU_PRODUCT_LABEL, "operator": "In", "values": list(spec.resources.gpu_product)}
        required = affinity.setdefault("nodeAffinity", {}).setdefault(
            "requiredDuringSchedulingIgnoredDuringExecution", {}
        )
        # Terms are ORed: the product constraint must hold in each of them.
        terms = required.get("nodeSelectorTerms") or [{}]
        for term in terms:
            term.setdefault("matchExpressions", []).append(wanted)
        required["nodeSelectorTerms"] = terms
    return affinity or None


def _tolerations(spec: SpeculativeDeploymentSpec) -> list[dict[str, Any]]:
    tolerations = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.scheduling.tolerations]
    if spec.resources.gpus:
        # GPU node pools are commonly tainted nvidia.com/gpu:NoSchedule to keep other pods off.
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    return tolerations


def render_strategy(spec: SpeculativeDeploymentSpec) -> dict[str, Any]:
    """The rolling update of spec.rollout. By default a replica smaller than a node surges (a new engine is
    Ready before an old one goes: serving capacity never drops); a node-sized one cannot (no second node-sized
    hole), so one old pod goes first."""
    surge, unavailable = spec.rollout.effective(spec.resources.gpus)
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}}


def render_deployment(owner: Owner, spec: SpeculativeDeploymentSpec, defaults: EngineDefaults) -> dict[str, Any]:
    port = spec.metrics.port
    startup = spec.readiness.startup_timeout_seconds
    volumes, mounts = _volumes(owner, spec)
    container = {
        "name": ENGINE_CONTAINER,
        "image": spec.engine.image or defaults.image,
        "imagePullPolicy": spec.engine.image_pull_policy or defaults.image_pull_policy,
        "command": ["ddtree", "serve"],
        "args": engine_args(spec),
        "ports": [{"name": PORT_NAME, "containerPort": port, "protocol": "TCP"}],
        "env": _env(spec),
        "resources": _resources(spec),
        "volumeMounts": mounts,
        # Load + graph capture + smoke test may take the whole budget; no initialDelaySeconds guesswork.
        "startupProbe": _http_probe(
            "/health", STARTUP_PROBE_PERIOD_SECONDS, math.ceil(startup / STARTUP_PROBE_PERIOD_SECONDS)
        ),
        "readinessProbe": _http_probe("/ready" if spec.readiness.smoke_test else "/health", 5, 3),
        "livenessProbe": _http_probe("/health", 15, 4),
        "terminationMessagePath": TERMINATION_LOG,
        # The engine writes its smoke-test failure reason there; other crashes fall back to the log tail.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": ENGINE_UID,
            "runAsGroup": ENGINE_UID,
            "fsGroup": ENGINE_UID,  # makes the cache PVC writable for the engine user
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": 60,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
    }
    scheduling = spec.scheduling
    if scheduling.node_selector:
        pod_spec["nodeSelector"] = dict(scheduling.node_selector)
    if tolerations := _tolerations(spec):
        pod_spec["tolerations"] = tolerations
    if affinity := _affinity(spec):
        pod_spec["affinity"] = affinity
    if scheduling.priority_class_name:
        pod_spec["priorityClassName"] = scheduling.priority_class_name
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(owner.name)},
            "strategy": render_strategy(spec),
            "progressDeadlineSeconds": startup + PROGRESS_DEADLINE_SLACK_SECONDS,
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {
                    "labels": labels(owner.name),
                    "annotations": {
                        "kubectl.kubernetes.io/default-container": ENGINE_CONTAINER,
                        # a changed configuration rolls the pods (a mounted ConfigMap alone would not)
                        CONFIG_HASH_ANNOTATION: hashlib.sha256(engine_config_text(spec).encode()).hexdigest(),
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def render_service(owner: Owner, spec: SpeculativeDeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(owner.name),
            "ports": [{"name": PORT_NAME, "port": spec.metrics.port, "targetPort": PORT_NAME, "protocol": "TCP"}],
        },
    }


def render_pod_monitor(owner: Owner, spec: SpeculativeDeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _metadata(owner),
        "spec": {
            "selector": {"matchLabels": selector_labels(owner.name)},
            "podMetricsEndpoints": [
                {"port": PORT_NAME, "path": "/metrics", "interval": f"{spec.metrics.scrape_interval_seconds}s"}
            ],
        },
    }


def render_config_map(owner: Owner, spec: SpeculativeDeploymentSpec) -> dict[str, Any]:
    """The engine configuration file the pods mount (read by `ddtree serve --config`)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(owner),
        "data": {CONFIG_FILE: engine_config_text(spec)},
    }


def render_children(owner: Owner, spec: SpeculativeDeploymentSpec, defaults: EngineDefaults) -> list[dict[str, Any]]:
    """Every object the resource should own, in apply order (the ConfigMap before the pods that mount it)."""
    children = [render_config_map(owner, spec), render_deployment(owner, spec, defaults), render_service(owner, spec)]
    if spec.metrics.pod_monitor:
        children.append(render_pod_monitor(owner, spec))
    return children
