"""The `SpeculativeDeployment` API (ddtree.dev/v1alpha1) as pydantic models.

These models are the single source of truth: `ddtree_operator.crd` turns them into the CRD's OpenAPI
schema (including the CEL rules below), and the operator parses every object's spec with them.
Cross-field rules are declared once as `Rule`s: the CEL expression is what the API server enforces on
`kubectl apply`, the Python predicate is the same check for code that builds specs without a server.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

from ddtree.config import DEFAULT_MAX_SEQ_LEN, ServingConfig

DEFAULT_MAX_BATCH_SIZE = ServingConfig.max_batch_size  # the engine's rows when spec.engine.maxBatchSize is unset

GROUP = "ddtree.dev"
VERSION = "v1alpha1"
KIND = "SpeculativeDeployment"
PLURAL = "speculativedeployments"
SINGULAR = "speculativedeployment"
SHORT_NAMES = ["specdeploy"]
CATEGORIES = ["llm"]

# Kubernetes' own pattern for resource.Quantity (k8s.io/apimachinery/pkg/api/resource) without the minus
# sign: requests, limits and volume sizes below 0 are refused by the API server when it creates the pods.
QUANTITY_PATTERN = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


def _check_quantity(value: int | str) -> int | str:
    if isinstance(value, str) and not re.match(QUANTITY_PATTERN, value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (examples: 4, 500m, 16Gi)")
    return value


# Written `cpu: 4` or `memory: 16Gi`, like the quantities of a PodSpec.
Quantity = Annotated[
    int | str,
    AfterValidator(_check_quantity),
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN}),
]

# A GPU's memory, e.g. 141Gi (H200) or 80Gi: a positive Kubernetes quantity of bytes (no milli, no sign).
GPU_MEMORY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$"

# maxSurge / maxUnavailable as a Deployment's rolling update takes them: a count or a percentage (no
# leading zeros, so that "0%" is the only spelling of zero the rules below need to know).
PERCENT_PATTERN = r"^(0|[1-9][0-9]*)%$"
# maxUnavailable: a Deployment and a PodDisruptionBudget refuse more than 100%
AT_MOST_ALL_PATTERN = r"^([0-9]|[1-9][0-9]|100)%$"


def _check_int_or_percent(value: int | str, pattern: str = PERCENT_PATTERN, what: str = "") -> int | str:
    if isinstance(value, str) and not re.match(pattern, value):
        raise ValueError(f"{value!r} is neither a count nor a percentage{what} (examples: 1, 25%)")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{value} must be >= 0")
    return value


def _check_at_most_all(value: int | str) -> int | str:
    return _check_int_or_percent(value, AT_MOST_ALL_PATTERN, " of at most 100%")


IntOrPercent = Annotated[
    int | str,
    AfterValidator(_check_int_or_percent),
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": PERCENT_PATTERN, "minimum": 0}),
]
IntOrPercentAtMostAll = Annotated[
    int | str,
    AfterValidator(_check_at_most_all),
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": AT_MOST_ALL_PATTERN, "minimum": 0}),
]

AUTO_BUDGET = "auto"


def _check_budget(value: int | str) -> int | str:
    if isinstance(value, str) and value != AUTO_BUDGET:
        raise ValueError(f"{value!r} is neither a budget (1 to 1024) nor {AUTO_BUDGET!r}")
    if isinstance(value, int) and not 1 <= value <= 1024:
        raise ValueError(f"budget {value} is outside 1 to 1024")
    return value


# A draft-tree budget, or `auto` (the engine chooses every round's).
BudgetOrAuto = Annotated[
    int | str,
    AfterValidator(_check_budget),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "x-kubernetes-validations": [
                {
                    "rule": "type(self) == int ? self >= 1 && self <= 1024 : self == 'auto'",
                    "message": "budget must be 1 to 1024 or 'auto'",
                }
            ],
        }
    ),
]

# Deliberately opaque (a full core/v1 Affinity schema would bloat the CRD, see docs/operator.md);
# the API server validates it when the operator copies it into the Deployment.
OpaqueObject = Annotated[
    dict[str, Any], WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})
]


@dataclasses.dataclass(frozen=True)
class Rule:
    """A cross-field rule: `cel` for the API server (x-kubernetes-validations), `check` for Python."""

    cel: str
    message: str
    check: Callable[[Any], bool]
    field_path: str | None = None  # where the API server reports the error, e.g. ".drafter"


def nested(model: type, description: str | None = None):
    """A nested object that is always present: `{}` in the CRD schema, so the server fills its defaults."""
    return Field(default_factory=model, description=description, json_schema_extra={"default": {}})


class _Model(BaseModel):
    """camelCase on the wire, unknown fields rejected, `Rule`s enforced and exported to the schema."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")
    rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self):
        for rule in self.rules:
            if not rule.check(self):
                raise ValueError(rule.message)
        return self

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        schema = handler(core_schema)
        target = handler.resolve_ref_schema(schema)
        if cls.rules:
            target["x-kubernetes-validations"] = [
                {"rule": r.cel, "message": r.message, **({"fieldPath": r.field_path} if r.field_path else {})}
                for r in cls.rules
            ]
        return schema


# pvc://<claim>/<path>; the same regular expression in CEL (RE2) and Python.
PVC_URI_PATTERN = r"^pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?/.+$"
PVC_URI_RULE = Rule(
    cel=f"!self.uri.startsWith('pvc://') || self.uri.matches('{PVC_URI_PATTERN}')",
    message="a pvc:// uri must look like pvc://<claim-name>/<path inside the claim>",
    check=lambda m: not m.uri.startswith("pvc://") or re.match(PVC_URI_PATTERN, m.uri) is not None,
    field_path=".uri",
)


class ModelSpec(_Model):
    """The target model the engine serves."""

    uri: str = Field(
        min_length=1,
        max_length=512,
        description="Where the weights come from: a hub id (`org/name` or `hf://org/name`), "
        "`pvc://<claim>/<path>` (the claim is mounted read-only), an absolute path inside the engine "
        "image, or a built-in id such as `smollm2-135m-instruct`.",
    )
    revision: str | None = Field(
        default=None, max_length=128, description="Hub revision (branch, tag or commit) to pin; hub ids only."
    )
    served_name: str | None = Field(
        default=None,
        max_length=256,
        description="Model name clients use in OpenAI requests (`--served-model-name`); "
        "default: the engine's choice (the uri).",
    )
    trust_remote_code: bool = Field(
        default=False,
        description="Run the Python tokenizer code the checkpoint ships (`--trust-remote-code`); Kimi's "
        "tiktoken tokenizer needs it. Default: false.",
    )
    rules: ClassVar = (PVC_URI_RULE,)


class DrafterSpec(_Model):
    """The DFlash drafter that proposes the draft tree."""

    uri: str = Field(min_length=1, max_length=512, description="Drafter weights; same forms as `model.uri`.")
    revision: str | None = Field(default=None, max_length=128, description="Hub revision to pin; hub ids only.")
    rules: ClassVar = (PVC_URI_RULE,)


class BudgetStep(_Model):
    """The draft-tree budget while at most `maxBatchSize` requests run."""

    max_batch_size: int = Field(ge=1, le=4096, description="Largest batch this budget applies to.")
    budget: int = Field(
        ge=0,
        le=1024,
        description="Draft-tree node budget for those batches; 0 decodes "
        "them without drafting (where `ddtree bench` finds plain decoding faster).",
    )


class SpeculationSpec(_Model):
    """How the engine speculates."""

    method: Literal["ddtree", "dflash", "none"] = Field(
        default="ddtree",
        description="`ddtree` (tree of drafts verified in one pass), `dflash` (single draft block) or "
        "`none` (plain autoregressive decoding, engine `--method ar`). Default: ddtree.",
    )
    budget: BudgetOrAuto = Field(
        default=AUTO_BUDGET,
        description="Draft-tree node budget per round (`--budget`, 1 to 1024), or `auto`: the engine chooses "
        "each round's budget for the running batch from the draft's calibrated forecast of each budget's "
        "acceptance and the round times it measured at start-up. Default: auto.",
    )
    budget_by_batch_size: list[BudgetStep] | None = Field(
        default=None,
        max_length=16,
        description="A budget per batch size, replacing `budget` (`--budget 1:32,16:8`; `ddtree bench` prints "
        "the measured best; budget 0 switches drafting off, `--budget 1:32,16:8,64:0`): each entry holds up "
        "to its maxBatchSize, the last also beyond. Its batch "
        "sizes must be among the graph batch buckets. Method ddtree only.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["maxBatchSize"]},
    )
    block_size: int | None = Field(
        default=None, ge=2, le=256, description="Drafter block size (`--block-size`); default: read from the drafter."
    )
    batch_buckets: list[Annotated[int, Field(ge=1, le=4096)]] | None = Field(
        default=None,
        max_length=32,
        description="Batch sizes the engine captures CUDA graphs for (`--batch-buckets`); default: the engine's.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    rules: ClassVar = (
        Rule(
            cel="!has(self.budgetByBatchSize) || self.method == 'ddtree'",
            message="budgetByBatchSize needs method ddtree",
            check=lambda m: m.budget_by_batch_size is None or m.method == "ddtree",
            field_path=".budgetByBatchSize",
        ),
        Rule(  # the engine replays a bucket's graph, so the budget may change only at a bucket
            cel="!has(self.budgetByBatchSize) || !has(self.batchBuckets) || self.budgetByBatchSize.all(s, "
            "s.maxBatchSize in self.batchBuckets || self.batchBuckets.all(b, b < s.maxBatchSize))",
            message="every spec.speculation.budgetByBatchSize maxBatchSize must be one of "
            "spec.speculation.batchBuckets (or above all of them)",
            check=lambda m: (
                m.budget_by_batch_size is None
                or m.batch_buckets is None
                or all(
                    s.max_batch_size in m.batch_buckets or all(b < s.max_batch_size for b in m.batch_buckets)
                    for s in m.budget_by_batch_size
                )
            ),
            field_path=".budgetByBatchSize",
        ),
    )


class SecretKeyRef(_Model):
    """A key of a Secret in the resource's namespace."""

    name: str = Field(min_length=1, max_length=253)
    key: str = Field(min_length=1, max_length=253)


class EnvValueFrom(_Model):
    """Where an environment variable's value comes from."""

    secret_key_ref: SecretKeyRef


class EnvVar(_Model):
    """An environment variable of the engine container (a literal value or a Secret key)."""

    name: str = Field(min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str | None = None
    value_from: EnvValueFrom | None = None
    rules: ClassVar = (
        Rule(
            cel="has(self.value) != has(self.valueFrom)",
            message="an env entry needs exactly one of value and valueFrom",
            check=lambda m: (m.value is None) != (m.value_from is None),
        ),
    )


class EngineSpec(_Model):
    """The engine container."""

    image: str | None = Field(
        default=None,
        max_length=512,
        description="Engine image (the Dockerfile's `engine` target); default: the operator's "
        "configured engine image (Helm value `engine.image`).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="Default: the operator's configured pull policy."
    )
    max_batch_size: int | None = Field(
        default=None, ge=1, le=4096, description="Largest batch the engine schedules (`--max-batch-size`)."
    )
    max_seq_len: int | None = Field(
        default=None,
        ge=16,
        le=16777216,
        description="The most tokens of one request, prompt plus generated tokens (`--max-seq-len`), at most "
        "the model's context (the engine refuses to start otherwise); default: the engine's (2048, or the "
        "model's context where shorter).",
    )
    kv_cache_tokens: int | None = Field(
        default=None,
        ge=16,
        le=1 << 34,
        description="The KV cache's page pool in tokens, shared by all running requests (`--kv-cache-tokens`): "
        "requests are admitted while their pages are free, and pages holding the same prompt start are "
        "shared. Default: maxBatchSize x maxSeqLen, every request at its longest at once. At least maxSeqLen.",
    )
    gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Instead of kvCacheTokens: the largest KV cache page pool that keeps the engine within this "
        "share of each GPU's memory (`--gpu-memory-utilization`; 0.9 is 90%), as `ddtree plan` counts it "
        "(weights, caches, a round's workspace, a reserve) and within what the GPU has free at start-up.",
    )
    args: list[Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=list, max_length=64, description="Extra `ddtree serve` arguments, appended last."
    )
    env: list[EnvVar] = Field(default_factory=list, max_length=64, description="Extra environment variables.")
    rules: ClassVar = (
        Rule(
            cel="!has(self.kvCacheTokens) || self.kvCacheTokens >= "
            f"(has(self.maxSeqLen) ? self.maxSeqLen : {DEFAULT_MAX_SEQ_LEN})",
            message=f"spec.engine.kvCacheTokens must be >= spec.engine.maxSeqLen (default {DEFAULT_MAX_SEQ_LEN})",
            check=lambda e: e.kv_cache_tokens is None or e.kv_cache_tokens >= (e.max_seq_len or DEFAULT_MAX_SEQ_LEN),
            field_path=".kvCacheTokens",
        ),
        Rule(
            cel="!has(self.kvCacheTokens) || !has(self.gpuMemoryUtilization)",
            message="give spec.engine.kvCacheTokens or spec.engine.gpuMemoryUtilization, not both",
            check=lambda e: e.kv_cache_tokens is None or e.gpu_memory_utilization is None,
            field_path=".gpuMemoryUtilization",
        ),
    )


class ParallelismSpec(_Model):
    """How one replica is split over devices."""

    tensor: int = Field(default=1, ge=1, le=64, description="Tensor-parallel degree (`--tensor-parallel`). Default: 1.")
    expert: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="MoE models: ranks the routed experts are split over (`--expert-parallel`). Equal to "
        "`tensor`: whole experts per rank (the engine's default when unset); 1: every expert's width is "
        "split over the ranks instead. No other value is accepted.",
    )
    rules: ClassVar = (
        Rule(
            cel="!has(self.expert) || self.expert == 1 || self.expert == self.tensor",
            message="spec.parallelism.expert must be 1 or equal to spec.parallelism.tensor",
            check=lambda m: m.expert is None or m.expert in (1, m.tensor),
            field_path=".expert",
        ),
    )


class ResourcesSpec(_Model):
    """What one replica (pod) gets."""

    gpus: int = Field(
        default=0,
        ge=0,
        le=64,
        description="`nvidia.com/gpu` limit; a multiple of `parallelism.tensor`. Default: 0 (CPU).",
    )
    gpu_memory: str | None = Field(
        default=None,
        max_length=32,
        pattern=GPU_MEMORY_PATTERN,
        description="Memory of one GPU, e.g. 141Gi (H200) or 80Gi. When set, the operator checks with the "
        "engine's memory plan that the model fits `parallelism.tensor` such GPUs before it creates any pod "
        '(hub models only; docs/operator.md, "Fit check").',
    )
    gpu_product: list[Annotated[str, Field(max_length=128)]] = Field(
        default_factory=list,
        max_length=16,
        description="Acceptable `nvidia.com/gpu.product` node labels (e.g. NVIDIA-H200); required node affinity.",
    )
    cpu: Quantity | None = Field(default=None, description="CPU request (no CPU limit, to avoid throttling).")
    memory: Quantity | None = Field(
        default=None, description="Memory request and limit; must leave room for `sharedMemorySize` (tmpfs counts)."
    )
    shared_memory_size: Quantity = Field(
        default="1Gi", description="Size of the in-memory `/dev/shm` volume. Default: 1Gi."
    )


class Toleration(_Model):
    """core/v1 Toleration."""

    key: str | None = Field(default=None, max_length=316)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(default=None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class SchedulingSpec(_Model):
    """Where replicas may run."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    affinity: OpaqueObject | None = Field(
        default=None, description="core/v1 Affinity; `resources.gpuProduct` is added to its required node affinity."
    )
    priority_class_name: str | None = Field(default=None, max_length=253)


class ModelCacheSpec(_Model):
    """An existing PVC used as the engine's download cache (DDTREE_CACHE and HF_HOME)."""

    claim_name: str = Field(min_length=1, max_length=253)
    read_only: bool = Field(
        default=False, description="Mount read-only and run the hub client offline (a pre-filled cache)."
    )


class ReadinessSpec(_Model):
    """When a replica counts as ready."""

    startup_timeout_seconds: int = Field(
        default=3600,
        ge=60,
        le=86400,
        description="Budget for download, load, graph capture and smoke test before the startup probe "
        "gives up. Default: 3600.",
    )
    smoke_test: bool = Field(
        default=True,
        description="Gate readiness on the engine's graph-capture smoke test (`/ready`); when false "
        "readiness follows `/health`. Default: true.",
    )
    min_acceptance_length: float | None = Field(
        default=None,
        ge=1.0,
        le=1025.0,
        description="Windowed mean acceptance length below which the resource reports Degraded.",
    )


class MetricsSpec(_Model):
    """The engine's port and how the operator scrapes it."""

    port: int = Field(
        default=8000,
        ge=1024,
        le=65535,
        description="Port the engine serves on; the API, /health, /ready and /metrics share it. Default: 8000.",
    )
    scrape_interval_seconds: int = Field(
        default=15, ge=5, le=3600, description="How often the operator scrapes ready pods. Default: 15."
    )
    pod_monitor: bool = Field(
        default=False, description="Also create a Prometheus-operator PodMonitor. Default: false."
    )


class ServingSpec(_Model):
    """Who may use the engine's OpenAI API."""

    api_key_secret: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding the API keys, one per line: requests to /v1/* then need "
        "`Authorization: Bearer KEY` (401 otherwise). /health, /ready and /metrics stay open for probes "
        "and scrapes. Default: no key needed.",
    )


ZERO = ("0", "0%")


def is_zero(value: int | str | None) -> bool:
    return value is not None and str(value) in ZERO


class RolloutSpec(_Model):
    """How a new revision replaces the engine pods (the Deployment's strategy)."""

    type: Literal["RollingUpdate", "Recreate"] = Field(
        default="RollingUpdate",
        description="`RollingUpdate` replaces pods a few at a time (maxSurge, maxUnavailable); `Recreate` stops "
        "every old pod before the first new one starts (no two revisions ever serve together, and no "
        "GPUs are needed beyond those of `replicas`). Default: RollingUpdate.",
    )
    max_surge: IntOrPercent | None = Field(
        default=None,
        description="Pods above `replicas` during a rollout (a count or a percentage, as in a Deployment). "
        "Default: 0 when a replica fills a node (`resources.gpus` >= the operator's `nodeGpus`, 8 unless "
        "configured), so a surge pod would find no room, else 1 (a new engine is ready before an old one "
        "goes, so serving capacity never drops); 1 whenever maxUnavailable is set to 0.",
    )
    max_unavailable: IntOrPercentAtMostAll | None = Field(
        default=None,
        description="Pods below `replicas` during a rollout (a count or a percentage). Default: 1 when a "
        "replica fills a node, else 0; 1 whenever maxSurge is set to 0. They must not both be 0.",
    )
    rules: ClassVar = (
        Rule(
            cel="self.type == 'RollingUpdate' || (!has(self.maxSurge) && !has(self.maxUnavailable))",
            message="spec.rollout.maxSurge and spec.rollout.maxUnavailable apply to type RollingUpdate only",
            check=lambda m: m.type == "RollingUpdate" or (m.max_surge is None and m.max_unavailable is None),
        ),
        Rule(  # a Deployment refuses both 0: it could never roll
            cel="!(has(self.maxSurge) && has(self.maxUnavailable) && "
            f"string(self.maxSurge) in {list(ZERO)} && string(self.maxUnavailable) in {list(ZERO)})",
            message="spec.rollout.maxSurge and spec.rollout.maxUnavailable must not both be 0",
            check=lambda m: not (is_zero(m.max_surge) and is_zero(m.max_unavailable)),
        ),
    )

    def effective(self, gpus: int, node_gpus: int) -> tuple[int | str, int | str]:
        """(maxSurge, maxUnavailable) of a rolling update: what is set, else the default for a replica of
        `gpus` GPUs on nodes of `node_gpus`. The defaults never make both 0: one set to 0 makes the other 1."""
        surge, unavailable = (0, 1) if gpus >= node_gpus else (1, 0)
        if is_zero(self.max_surge):
            unavailable = 1
        if is_zero(self.max_unavailable):
            surge = 1
        return (
            self.max_surge if self.max_surge is not None else surge,
            self.max_unavailable if self.max_unavailable is not None else unavailable,
        )


class AutoscalingSpec(_Model):
    """Replicas that follow the engines' load (docs/operator.md, "Autoscaling")."""

    min_replicas: int = Field(default=1, ge=1, le=1024, description="Fewest engine pods. Default: 1.")
    max_replicas: int = Field(ge=1, le=1024, description="Most engine pods.")
    target: float = Field(
        default=0.8,
        ge=0.1,
        le=16.0,
        description="Load per replica the autoscaler holds: the engine's `ddtree_load`, requests running plus "
        "waiting over its max batch size (1 = full batches, above 1 = requests queue). Default: 0.8 (room "
        "for the traffic that arrives while a new replica loads).",
    )
    rules: ClassVar = (
        Rule(
            cel="self.minReplicas <= self.maxReplicas",
            message="spec.autoscaling.minReplicas must be <= spec.autoscaling.maxReplicas",
            check=lambda m: m.min_replicas <= m.max_replicas,
            field_path=".minReplicas",
        ),
        Rule(  # the schema's minimum alone lets an integer 0 through (compared as integers, 0.1 becomes 0)
            cel="self.target >= 0.1",
            message="spec.autoscaling.target must be at least 0.1",
            check=lambda m: m.target >= 0.1,
            field_path=".target",
        ),
    )


class DrafterCanarySpec(_Model):
    """How a new `drafter` is tried on a few replicas before it replaces the running one (docs/operator.md,
    "Drafter canary"). DDTree is lossless: a drafter changes how fast answers come, not what they are (token
    for token when greedy, in distribution when sampled), so this decision is only about speed."""

    enabled: bool = Field(
        default=True,
        description="Try a changed `drafter` on `replicas` pods and promote it only when its acceptance length "
        "holds up; false rolls a drafter change out directly. Default: true.",
    )
    replicas: IntOrPercent = Field(
        default=1,
        description="Pods that run the new drafter during the canary, taken from `replicas`: a count or a "
        "percentage (rounded up); at least 1, and at least one pod keeps the old drafter. Default: 1.",
    )
    window_seconds: int = Field(
        default=600,
        ge=10,
        le=86400,
        description="Both drafters are measured for at least this long before a decision. Default: 600.",
    )
    min_rounds: int = Field(
        default=1000,
        ge=1,
        le=1_000_000_000,
        description="Verify rounds (`ddtree_spec_decode_num_drafts_total`) each drafter must have run in the "
        "window before a decision. Default: 1000.",
    )
    tolerance: float = Field(
        default=0.02,
        ge=0.0,
        le=1.0,
        description="The new drafter is promoted when its acceptance length is at least (1 - tolerance) "
        "times the old one's, else rolled back. Default: 0.02.",
    )
    deadline_seconds: int = Field(
        default=7200,
        ge=60,
        le=604800,
        description="A canary without a decision this long after it started (its pods not ready, or too "
        "little traffic) is rolled back. Default: 7200.",
    )
    rules: ClassVar = (
        Rule(
            # has(): the schema's default ({}) is checked before its fields' defaults fill it
            cel=f"!has(self.replicas) || !(string(self.replicas) in {list(ZERO)})",
            message="spec.drafterCanary.replicas must be at least 1 (set enabled: false to skip the canary)",
            check=lambda m: not is_zero(m.replicas),
            field_path=".replicas",
        ),
    )


class SpeculativeDeploymentSpec(_Model):
    """A model served by DDTree speculative-decoding engine pods."""

    model: ModelSpec
    drafter: DrafterSpec | None = Field(default=None, description="Required for ddtree and dflash.")
    speculation: SpeculationSpec = nested(SpeculationSpec)
    engine: EngineSpec = nested(EngineSpec)
    parallelism: ParallelismSpec = nested(ParallelismSpec)
    replicas: int = Field(
        default=1,
        ge=0,
        le=1024,
        description="Engine pods (scale subresource; with `autoscaling`, the autoscaler sets it). Default: 1.",
    )
    resources: ResourcesSpec = nested(ResourcesSpec)
    rollout: RolloutSpec = nested(RolloutSpec)
    autoscaling: AutoscalingSpec | None = Field(
        default=None,
        description="Scale `replicas` between minReplicas and maxReplicas on the engines' load, through a "
        "HorizontalPodAutoscaler or a KEDA ScaledObject (the operator's `autoscalingProvider`).",
    )
    scheduling: SchedulingSpec = nested(SchedulingSpec)
    model_cache: ModelCacheSpec | None = None
    readiness: ReadinessSpec = nested(ReadinessSpec)
    metrics: MetricsSpec = nested(MetricsSpec)
    serving: ServingSpec = nested(ServingSpec)
    drafter_canary: DrafterCanarySpec = nested(DrafterCanarySpec)

    rules: ClassVar = (
        Rule(
            cel="self.speculation.method == 'none' || has(self.drafter)",
            message="spec.drafter is required when spec.speculation.method is ddtree or dflash",
            check=lambda s: s.speculation.method == "none" or s.drafter is not None,
            field_path=".drafter",
        ),
        Rule(
            cel="self.speculation.method != 'none' || !has(self.drafter)",
            message="spec.drafter must be omitted when spec.speculation.method is none",
            check=lambda s: s.speculation.method != "none" or s.drafter is None,
            field_path=".drafter",
        ),
        Rule(
            cel="self.resources.gpus % self.parallelism.tensor == 0",
            message="spec.resources.gpus must be a multiple of spec.parallelism.tensor",
            check=lambda s: s.resources.gpus % s.parallelism.tensor == 0,
            field_path=".resources.gpus",
        ),
        Rule(
            cel="self.parallelism.tensor == 1 || self.resources.gpus > 0",
            message="spec.parallelism.tensor > 1 needs GPUs (spec.resources.gpus)",
            check=lambda s: s.parallelism.tensor == 1 or s.resources.gpus > 0,
            field_path=".parallelism.tensor",
        ),
        Rule(
            # (a --max-batch-size in engine.args, which overrides the field, is the engine's to check)
            cel="!has(self.speculation.batchBuckets) || "
            "(has(self.engine.args) && self.engine.args.exists(a, a.startsWith('--max-batch-size'))) || "
            "self.speculation.batchBuckets.all(b, b <= "
            f"(has(self.engine.maxBatchSize) ? self.engine.maxBatchSize : {DEFAULT_MAX_BATCH_SIZE}))",
            message="every spec.speculation.batchBuckets entry must be <= spec.engine.maxBatchSize "
            f"(default {DEFAULT_MAX_BATCH_SIZE})",
            check=lambda s: (
                s.speculation.batch_buckets is None
                or any(a.startswith("--max-batch-size") for a in s.engine.args)
                or all(b <= (s.engine.max_batch_size or DEFAULT_MAX_BATCH_SIZE) for b in s.speculation.batch_buckets)
            ),
            field_path=".speculation.batchBuckets",
        ),
        Rule(
            cel="!has(self.readiness.minAcceptanceLength) || self.speculation.method != 'none'",
            message="spec.readiness.minAcceptanceLength needs speculation (method ddtree or dflash)",
            check=lambda s: s.readiness.min_acceptance_length is None or s.speculation.method != "none",
            field_path=".readiness.minAcceptanceLength",
        ),
        Rule(
            cel="!has(self.resources.gpuMemory) || self.resources.gpus > 0",
            message="spec.resources.gpuMemory needs GPUs (spec.resources.gpus)",
            check=lambda s: s.resources.gpu_memory is None or s.resources.gpus > 0,
            field_path=".resources.gpuMemory",
        ),
    )


# ---- status -------------------------------------------------------------------------------------

Phase = Literal["Pending", "Loading", "Ready", "Degraded", "Failed"]


class Condition(_Model):
    """metav1.Condition."""

    type: str = Field(max_length=316)
    status: Literal["True", "False", "Unknown"]
    observed_generation: int | None = None
    last_transition_time: datetime.datetime
    reason: str = Field(max_length=1024)
    message: str = Field(default="", max_length=32768)


class SmokeTestStatus(_Model):
    """Summary of the engines' graph-capture smoke tests."""

    result: Literal["Pending", "Passed", "Failed", "Disabled"]
    passed_replicas: int = Field(default=0, description="Ready pods whose engine reports a passed smoke test.")
    graph_capture_seconds: float | None = Field(
        default=None, description="Longest graph capture among ready pods (ddtree_graph_capture_seconds)."
    )
    message: str | None = Field(default=None, description="The engine's reason for the last failure.")


class MemoryPlanStatus(_Model):
    """The fit check's outcome for the current spec (the engine's memory plan, per GPU)."""

    result: Literal["Fits", "DoesNotFit", "Skipped"]
    message: str = Field(default="", description="The plan's one-line reason, or `memory plan skipped: <why>`.")
    per_rank_bytes: dict[str, int] | None = Field(
        default=None, description="Bytes per GPU by kind (weights by kind, KV caches, workspace, reserve)."
    )
    max_context_that_fits: int | None = Field(
        default=None, description="The largest max sequence length that fits at the spec's batch size."
    )


class DrafterMeasurement(_Model):
    """One drafter's pods during a canary, from their counters since each one's first scrape in it."""

    pods: int = Field(description="Ready pods measured.")
    rounds: int = Field(description="Verify rounds they ran (Δ ddtree_spec_decode_num_drafts_total).")
    seconds: float = Field(description="The longest time one of them was measured.")
    acceptance_length: float | None = Field(default=None, description="1 + Δaccepted/Δdrafts over these pods.")
    tokens_per_second: float | None = Field(default=None, description="Generated tokens per second, per pod.")


class DrafterCanaryStatus(_Model):
    """The drafter the engines run, and the last drafter canary (docs/operator.md, "Drafter canary")."""

    stable: DrafterSpec = Field(
        description="The drafter of the engine Deployment: the last one promoted or rolled out directly."
    )
    phase: Literal["Progressing", "Promoted", "RolledBack", "Cancelled"] | None = Field(
        default=None, description="The last canary's state; unset before the first one."
    )
    candidate: DrafterSpec | None = Field(default=None, description="The drafter the last canary tried.")
    started_at: datetime.datetime | None = None
    stable_measurement: DrafterMeasurement | None = None
    candidate_measurement: DrafterMeasurement | None = None
    message: str = Field(default="", description="What happened and why, with both drafters' figures.")


class SpeculativeDeploymentStatus(_Model):
    """Observed state, written by the operator."""

    observed_generation: int | None = None
    phase: Phase | None = None
    replicas: int | None = Field(default=None, description="Engine pods that exist (scale subresource).")
    ready_replicas: int | None = None
    updated_replicas: int | None = None
    selector: str | None = Field(default=None, description="Label selector of the engine pods (scale subresource).")
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    acceptance_length: float | None = Field(
        default=None, description="Windowed mean acceptance length, 1 + Δaccepted/Δdrafts over ready pods."
    )
    throughput_tokens_per_second: float | None = Field(
        default=None, description="Generated tokens per second over the last scrape window, summed over ready pods."
    )
    last_scrape_time: datetime.datetime | None = None
    smoke_test: SmokeTestStatus | None = None
    memory_plan: MemoryPlanStatus | None = None
    drafter_canary: DrafterCanaryStatus | None = None
