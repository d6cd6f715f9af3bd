"""Pure functions from a SpeculativeDeployment spec to the Kubernetes objects that run it.

No I/O here: the handlers server-side-apply whatever these functions return, so the same spec always
yields the same objects (idempotent reconcile, deterministic names, no duplicates after a restart).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any, Literal

import pydantic
import yaml
from pydantic import Field
from pydantic.alias_generators import to_camel

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
DEFAULT_CONTAINER_ANNOTATION = "kubectl.kubernetes.io/default-container"
OWN_POD_ANNOTATIONS = (DEFAULT_CONTAINER_ANNOTATION, CONFIG_HASH_ANNOTATION)


@dataclasses.dataclass(frozen=True)
class Owner:
    """The identity of the custom resource that its children reference."""

    name: str
    namespace: str
    uid: str


class _Defaults(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class CacheDefaults(_Defaults):
    """The engine's download cache where a spec has no `modelCache`: a size-limited emptyDir, or one
    existing PVC (which must exist in every namespace with resources; ReadWriteMany for replicas on
    several nodes)."""

    size_limit: api.Quantity | None = None
    claim_name: str | None = Field(default=None, min_length=1, max_length=253)

    @pydantic.model_validator(mode="after")
    def _one_of(self) -> CacheDefaults:
        if (self.size_limit is None) == (self.claim_name is None):
            raise ValueError("cache needs exactly one of sizeLimit and claimName")
        return self


class LocalObjectReference(_Defaults):
    name: str = Field(min_length=1, max_length=253)


ENGINE_DEFAULTS_ENV = "DDTREE_ENGINE_DEFAULTS"
DEFAULT_ENGINE_IMAGE = "ddtree-engine:latest"
DEFAULT_KEDA_PROMETHEUS_ADDRESS = "http://prometheus-operated.monitoring.svc:9090"


class EngineDefaults(_Defaults):
    """Operator-wide settings (Helm values) used where a spec leaves them out: the image from
    DDTREE_ENGINE_IMAGE and DDTREE_ENGINE_IMAGE_PULL_POLICY, the rest from the JSON object
    DDTREE_ENGINE_DEFAULTS (camelCase keys, all optional; `engine_defaults_from_env`)."""

    image: str = DEFAULT_ENGINE_IMAGE
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    image_pull_secrets: tuple[LocalObjectReference, ...] = ()
    service_account_name: str | None = Field(default=None, min_length=1, max_length=253)
    pod_labels: dict[str, str] = Field(default_factory=dict)
    pod_annotations: dict[str, str] = Field(default_factory=dict)
    priority_class_name: str | None = Field(default=None, min_length=1, max_length=253)  # spec's wins
    cache: CacheDefaults | None = None
    # GPUs of one node: a replica with this many has no second node-sized hole to surge into.
    node_gpus: int = Field(default=8, ge=1, le=1024)
    autoscaling_provider: Literal["prometheus-adapter", "keda"] = "prometheus-adapter"
    keda_prometheus_address: str = Field(default=DEFAULT_KEDA_PROMETHEUS_ADDRESS, min_length=1)

    @pydantic.field_validator("pod_labels", "pod_annotations")
    @classmethod
    def _not_the_operators_own(cls, value: dict[str, str], info: pydantic.ValidationInfo) -> dict[str, str]:
        # The operator's labels select the pods (Deployment, Service, PDB, metrics); its annotations roll them.
        own = set(labels("x")) if info.field_name == "pod_labels" else set(OWN_POD_ANNOTATIONS)
        if taken := sorted(own & set(value)):
            raise ValueError(f"must not set the operator's own keys {taken}")
        return value


def engine_defaults_from_env(environ: Mapping[str, str]) -> EngineDefaults:
    """The operator's EngineDefaults, or ValueError with one line saying what is wrong (at start-up)."""
    text = environ.get(ENGINE_DEFAULTS_ENV, "").strip() or "{}"
    try:
        settings = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{ENGINE_DEFAULTS_ENV} is not valid JSON: {exc}") from exc
    if not isinstance(settings, dict):
        raise ValueError(f"{ENGINE_DEFAULTS_ENV} must be a JSON object, not {type(settings).__name__}")
    known = sorted(
        f.alias for name, f in EngineDefaults.model_fields.items() if name not in ("image", "image_pull_policy")
    )
    if unknown := sorted(set(settings) - set(known)):
        raise ValueError(f"{ENGINE_DEFAULTS_ENV} has unknown keys {unknown}; known keys: {', '.join(known)}")
    image_variables = {"image": "DDTREE_ENGINE_IMAGE", "imagePullPolicy": "DDTREE_ENGINE_IMAGE_PULL_POLICY"}
    image = {key: environ[variable] for key, variable in image_variables.items() if environ.get(variable)}
    try:
        return EngineDefaults.model_validate({**settings, **image})
    except pydantic.ValidationError as exc:

        def where(loc: tuple[int | str, ...]) -> str:
            key = str(loc[0])
            return image_variables.get(key) or f"{ENGINE_DEFAULTS_ENV} {'.'.join(map(str, loc))}"

        problems = "; ".join(f"{where(e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"invalid engine defaults: {problems}") from exc


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
    budget: int | str | dict[int, int] = speculation_spec.budget
    if speculation_spec.budget_by_batch_size:
        budget = {
            s.max_batch_size: s.budget
            for s in sorted(speculation_spec.budget_by_batch_size, key=lambda s: s.max_batch_size)
        }
    speculation: dict[str, Any] = {"method": ENGINE_METHOD[speculation_spec.method]}
    if budget != api.AUTO_BUDGET or speculation_spec.method == "ddtree":  # auto, the default, is ddtree's alone
        speculation["budget"] = budget
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
    if spec.engine.kv_cache_tokens is not None:
        serving["kv_cache_tokens"] = spec.engine.kv_cache_tokens
    if spec.engine.gpu_memory_utilization is not None:
        serving["gpu_memory_utilization"] = spec.engine.gpu_memory_utilization
    if spec.model.served_name:
        serving["served_model_name"] = spec.model.served_name
    if spec.serving.api_key_secret is not None:
        serving["api_key_file"] = f"{API_KEYS_MOUNT}/{API_KEYS_FILE}"
    config["serving"] = serving
    return config


def engine_config_text(spec: SpeculativeDeploymentSpec) -> str:
    return yaml.safe_dump(engine_config(spec), sort_keys=False)


def engine_config_hash(spec: SpeculativeDeploymentSpec) -> str:
    """The pods' CONFIG_HASH_ANNOTATION: which configuration a pod runs."""
    return hashlib.sha256(engine_config_text(spec).encode()).hexdigest()


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


def _volumes(
    owner: Owner, spec: SpeculativeDeploymentSpec, defaults: EngineDefaults
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(spec.resources.shared_memory_size)}},
        {"name": CONFIG_VOLUME, "configMap": {"name": owner.name}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": CONFIG_VOLUME, "mountPath": CONFIG_MOUNT, "readOnly": True},
    ]
    cache = defaults.cache
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
    elif cache is not None and cache.claim_name is not None:
        volumes.append({"name": "cache", "persistentVolumeClaim": {"claimName": cache.claim_name}})
        mounts.append({"name": "cache", "mountPath": CACHE_DIR})
    else:
        size_limit = {"sizeLimit": str(cache.size_limit)} if cache is not None and cache.size_limit else {}
        volumes.append({"name": "cache", "emptyDir": size_limit})
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


def _resources(spec: SpeculativeDeploymentSpec, defaults: EngineDefaults) -> dict[str, Any]:
    res = spec.resources
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if res.cpu is not None:
        requests["cpu"] = str(res.cpu)
    if spec.model_cache is None and defaults.cache is not None and defaults.cache.size_limit is not None:
        # The scheduler places the pod where its size-limited emptyDir cache fits on the node's disk.
        requests["ephemeral-storage"] = str(defaults.cache.size_limit)
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


def render_strategy(spec: SpeculativeDeploymentSpec, defaults: EngineDefaults) -> dict[str, Any]:
    """The Deployment strategy of spec.rollout. By default a replica smaller than a node surges (a new engine
    is Ready before an old one goes: serving capacity never drops); a node-sized one cannot (no second
    node-sized hole), so one old pod goes first. Either way a new pod counts as available only once its
    readiness probe passes, which is the smoke test (`/ready`) unless spec.readiness.smokeTest is false."""
    if spec.rollout.type == "Recreate":
        return {"type": "Recreate"}
    surge, unavailable = spec.rollout.effective(spec.resources.gpus, defaults.node_gpus)
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}}


def render_deployment(owner: Owner, spec: SpeculativeDeploymentSpec, defaults: EngineDefaults) -> dict[str, Any]:
    port = spec.metrics.port
    startup = spec.readiness.startup_timeout_seconds
    volumes, mounts = _volumes(owner, spec, defaults)
    container = {
        "name": ENGINE_CONTAINER,
        "image": spec.engine.image or defaults.image,
        "imagePullPolicy": spec.engine.image_pull_policy or defaults.image_pull_policy,
        "command": ["ddtree", "serve"],
        "args": engine_args(spec),
        "ports": [{"name": PORT_NAME, "containerPort": port, "protocol": "TCP"}],
        "env": _env(spec),
        "resources": _resources(spec, defaults),
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
    if priority_class_name := scheduling.priority_class_name or defaults.priority_class_name:
        pod_spec["priorityClassName"] = priority_class_name
    if defaults.service_account_name:
        pod_spec["serviceAccountName"] = defaults.service_account_name
    if defaults.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [secret.model_dump() for secret in defaults.image_pull_secrets]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(owner.name)},
            "strategy": render_strategy(spec, defaults),
            "progressDeadlineSeconds": startup + PROGRESS_DEADLINE_SLACK_SECONDS,
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {
                    # the defaults cannot hold the operator's own keys (EngineDefaults refuses them)
                    "labels": {**defaults.pod_labels, **labels(owner.name)},
                    "annotations": {
                        **defaults.pod_annotations,
                        DEFAULT_CONTAINER_ANNOTATION: ENGINE_CONTAINER,
                        # a changed configuration rolls the pods (a mounted ConfigMap alone would not)
                        CONFIG_HASH_ANNOTATION: engine_config_hash(spec),
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


def render_pod_disruption_budget(
    owner: Owner, spec: SpeculativeDeploymentSpec, defaults: EngineDefaults
) -> dict[str, Any] | None:
    """How many engine pods voluntary disruptions (node drains, cluster-autoscaler scale-down) may take at once:
    as many as a rolling update may (spec.rollout's effective maxUnavailable, sized by the user to the capacity
    they can spare), but at least 1, since a budget that allows none blocks node drains for good. None for one
    replica or fewer: there is no capacity to keep serving through a drain, and a budget would either block the
    drain (0) or allow everything (1)."""
    if spec.replicas <= 1:
        return None
    unavailable: int | str = 1
    if spec.rollout.type == "RollingUpdate":
        unavailable = spec.rollout.effective(spec.resources.gpus, defaults.node_gpus)[1]
        if api.is_zero(unavailable):
            unavailable = 1
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner),
        "spec": {"maxUnavailable": unavailable, "selector": {"matchLabels": selector_labels(owner.name)}},
    }


# The engine's load gauge: requests running plus waiting over its max batch size (docs/operator.md, "Autoscaling").
LOAD_METRIC = "ddtree_load"


def _scale_target(owner: Owner) -> dict[str, str]:
    """The resource itself, through its scale subresource: the autoscaler writes spec.replicas, from which the
    operator renders the Deployment's replicas, so the two never fight over them."""
    return {"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND, "name": owner.name}


def render_horizontal_pod_autoscaler(owner: Owner, autoscaling: api.AutoscalingSpec) -> dict[str, Any]:
    """An HPA on the per-pod `ddtree_load`, which the prometheus-adapter serves as a pods custom metric."""
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(owner),
        "spec": {
            "scaleTargetRef": _scale_target(owner),
            "minReplicas": autoscaling.min_replicas,
            "maxReplicas": autoscaling.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": LOAD_METRIC},
                        # a Quantity: 0.8 is written 800m
                        "target": {"type": "AverageValue", "averageValue": f"{round(autoscaling.target * 1000)}m"},
                    },
                }
            ],
        },
    }


GENERATED_NAME_PREFIX = 58  # a generated name's prefix is cut to 63 characters less its 5 random ones
TEMPLATE_HASH = 10  # a pod-template-hash has at most 10 characters


def deployment_pods(name: str) -> str:
    """A PromQL regex of the names of Deployment `name`'s pods: NAME-<template hash>-<5 characters>, a shape
    that keeps other workloads called NAME-something (the drafter canary's NAME-canary-...) out. Kubernetes
    cuts NAME-<hash>- to 58 characters: past a name of 46 characters the hash may be cut short (the pod's
    name is then 63 characters), and from 57 on only the name's first 57 are left, which the canary's pods
    share."""
    prefix = f"{name}-"
    whole = f"{prefix}[a-z0-9]+-[a-z0-9]{{5}}"
    if len(prefix) + TEMPLATE_HASH + 1 <= GENERATED_NAME_PREFIX:
        return whole
    if len(prefix) >= GENERATED_NAME_PREFIX:
        return f"{prefix[:GENERATED_NAME_PREFIX]}[a-z0-9]{{5}}"
    cut = GENERATED_NAME_PREFIX - len(prefix)
    return f"{whole}|{prefix}[a-z0-9-]{{{cut}}}[a-z0-9]{{5}}"


def render_scaled_object(owner: Owner, autoscaling: api.AutoscalingSpec, defaults: EngineDefaults) -> dict[str, Any]:
    """A KEDA ScaledObject with a Prometheus trigger. The query sums `ddtree_load` over the resource's pods and
    the trigger is an AverageValue, so the HPA that KEDA makes divides it by the replicas: the target is a load
    per replica, as with the prometheus-adapter. The pods are matched by name (deployment_pods)."""
    pods = deployment_pods(owner.name)
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _metadata(owner),
        "spec": {
            "scaleTargetRef": _scale_target(owner),
            "minReplicaCount": autoscaling.min_replicas,
            "maxReplicaCount": autoscaling.max_replicas,
            "triggers": [
                {
                    "type": "prometheus",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": defaults.keda_prometheus_address,
                        "query": f'sum({LOAD_METRIC}{{namespace="{owner.namespace}",pod=~"{pods}"}})',
                        "threshold": f"{autoscaling.target:g}",
                    },
                }
            ],
        },
    }


def render_children(owner: Owner, spec: SpeculativeDeploymentSpec, defaults: EngineDefaults) -> list[dict[str, Any]]:
    """Every object the resource should own, in apply order (the ConfigMap before the pods that mount it)."""
    children = [render_config_map(owner, spec), render_deployment(owner, spec, defaults), render_service(owner, spec)]
    if spec.metrics.pod_monitor:
        children.append(render_pod_monitor(owner, spec))
    if budget := render_pod_disruption_budget(owner, spec, defaults):
        children.append(budget)
    if spec.autoscaling is not None:
        if defaults.autoscaling_provider == "keda":
            children.append(render_scaled_object(owner, spec.autoscaling, defaults))
        else:
            children.append(render_horizontal_pod_autoscaler(owner, spec.autoscaling))
    return children
