"""Specs that must be rejected, with the message a user sees. Shared by the pydantic unit tests and the
API-server tests, which proves that the CEL rules and the Python checks agree."""

VALID = {"model": {"uri": "smollm2-135m-instruct"}, "drafter": {"uri": "smollm2-135m-instruct-dflash"}}

# id -> (spec, message the rejection must contain)
INVALID_SPECS = {
    "ddtree-without-drafter": (
        {"model": {"uri": "Qwen/Qwen3-8B"}, "speculation": {"method": "ddtree"}},
        "spec.drafter is required when spec.speculation.method is ddtree or dflash",
    ),
    "dflash-without-drafter": (
        {"model": {"uri": "Qwen/Qwen3-8B"}, "speculation": {"method": "dflash"}},
        "spec.drafter is required when spec.speculation.method is ddtree or dflash",
    ),
    "drafter-with-method-none": (
        {**VALID, "speculation": {"method": "none"}},
        "spec.drafter must be omitted when spec.speculation.method is none",
    ),
    "gpus-not-multiple-of-tp": (
        {**VALID, "resources": {"gpus": 6}, "parallelism": {"tensor": 4}},
        "spec.resources.gpus must be a multiple of spec.parallelism.tensor",
    ),
    "tp-without-gpus": (
        {**VALID, "parallelism": {"tensor": 2}},
        "spec.parallelism.tensor > 1 needs GPUs",
    ),
    "bucket-above-max-batch": (
        {**VALID, "speculation": {"batchBuckets": [1, 8]}, "engine": {"maxBatchSize": 4}},
        "every spec.speculation.batchBuckets entry must be <= spec.engine.maxBatchSize",
    ),
    "bucket-above-the-default-max-batch": (
        {**VALID, "speculation": {"batchBuckets": [1, 16]}},
        "every spec.speculation.batchBuckets entry must be <= spec.engine.maxBatchSize (default 8)",
    ),
    "budget-by-batch-size-with-dflash": (
        {**VALID, "speculation": {"method": "dflash", "budgetByBatchSize": [{"maxBatchSize": 1, "budget": 32}]}},
        "budgetByBatchSize needs method ddtree",
    ),
    "budget-step-not-a-bucket": (
        {
            **VALID,
            "speculation": {
                "batchBuckets": [1, 2, 4],
                "budgetByBatchSize": [{"maxBatchSize": 1, "budget": 32}, {"maxBatchSize": 3, "budget": 8}],
            },
        },
        "every spec.speculation.budgetByBatchSize maxBatchSize must be one of spec.speculation.batchBuckets",
    ),
    "min-acceptance-without-speculation": (
        {
            "model": {"uri": "Qwen/Qwen3-8B"},
            "speculation": {"method": "none"},
            "readiness": {"minAcceptanceLength": 2.0},
        },
        "spec.readiness.minAcceptanceLength needs speculation",
    ),
    "malformed-pvc-uri": (
        {**VALID, "model": {"uri": "pvc://only-a-claim"}},
        "a pvc:// uri must look like pvc://<claim-name>/<path inside the claim>",
    ),
    "env-with-value-and-secret": (
        {
            **VALID,
            "engine": {
                "env": [{"name": "HF_TOKEN", "value": "x", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
            },
        },
        "an env entry needs exactly one of value and valueFrom",
    ),
    "expert-parallel-neither-1-nor-tensor": (
        {**VALID, "resources": {"gpus": 8}, "parallelism": {"tensor": 8, "expert": 4}},
        "spec.parallelism.expert must be 1 or equal to spec.parallelism.tensor",
    ),
    "gpu-memory-without-gpus": (
        {**VALID, "resources": {"gpuMemory": "80Gi"}},
        "spec.resources.gpuMemory needs GPUs",
    ),
    "rollout-both-zero": (
        {**VALID, "rollout": {"maxSurge": 0, "maxUnavailable": "0%"}},
        "spec.rollout.maxSurge and spec.rollout.maxUnavailable must not both be 0",
    ),
    "recreate-with-max-surge": (
        {**VALID, "rollout": {"type": "Recreate", "maxSurge": 1}},
        "spec.rollout.maxSurge and spec.rollout.maxUnavailable apply to type RollingUpdate only",
    ),
    "recreate-with-max-unavailable": (
        {**VALID, "rollout": {"type": "Recreate", "maxUnavailable": "25%"}},
        "spec.rollout.maxSurge and spec.rollout.maxUnavailable apply to type RollingUpdate only",
    ),
    "autoscaling-min-above-max": (
        {**VALID, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
        "spec.autoscaling.minReplicas must be <= spec.autoscaling.maxReplicas",
    ),
    "drafter-canary-without-pods": (
        {**VALID, "drafterCanary": {"replicas": "0%"}},
        "spec.drafterCanary.replicas must be at least 1",
    ),
}

# Bounds and formats enforced by plain OpenAPI keywords: id -> (spec, path the server names)
OUT_OF_BOUNDS_SPECS = {
    "budget-too-large": ({**VALID, "speculation": {"budget": 4096}}, "spec.speculation.budget"),
    "budget-zero": ({**VALID, "speculation": {"budget": 0}}, "spec.speculation.budget"),
    "budget-neither-a-number-nor-auto": ({**VALID, "speculation": {"budget": "often"}}, "spec.speculation.budget"),
    "budget-step-negative": (
        {**VALID, "speculation": {"budgetByBatchSize": [{"maxBatchSize": 4, "budget": -1}]}},
        "spec.speculation.budgetByBatchSize[0].budget",
    ),
    "negative-replicas": ({**VALID, "replicas": -1}, "spec.replicas"),
    "unknown-method": ({**VALID, "speculation": {"method": "eagle"}}, "spec.speculation.method"),
    "bad-memory-quantity": ({**VALID, "resources": {"memory": "lots"}}, "spec.resources.memory"),
    "startup-timeout-too-short": (
        {**VALID, "readiness": {"startupTimeoutSeconds": 5}},
        "spec.readiness.startupTimeoutSeconds",
    ),
    "bad-gpu-memory": ({**VALID, "resources": {"gpus": 1, "gpuMemory": "lots"}}, "spec.resources.gpuMemory"),
    "gpu-memory-in-millibytes": ({**VALID, "resources": {"gpus": 1, "gpuMemory": "80m"}}, "spec.resources.gpuMemory"),
    "max-surge-not-a-percentage": ({**VALID, "rollout": {"maxSurge": "half"}}, "spec.rollout.maxSurge"),
    "negative-max-unavailable": ({**VALID, "rollout": {"maxUnavailable": -1}}, "spec.rollout.maxUnavailable"),
    "max-unavailable-above-all": ({**VALID, "rollout": {"maxUnavailable": "150%"}}, "spec.rollout.maxUnavailable"),
    "zero-with-leading-zeros": (
        {**VALID, "rollout": {"maxSurge": 0, "maxUnavailable": "00%"}},
        "spec.rollout.maxUnavailable",
    ),
    "negative-cpu": ({**VALID, "resources": {"cpu": "-1"}}, "spec.resources.cpu"),
    "negative-shared-memory": ({**VALID, "resources": {"sharedMemorySize": "-1Gi"}}, "spec.resources.sharedMemorySize"),
    "max-seq-len-too-small": ({**VALID, "engine": {"maxSeqLen": 8}}, "spec.engine.maxSeqLen"),
    "kv-cache-smaller-than-a-request": (
        {**VALID, "engine": {"maxSeqLen": 8192, "kvCacheTokens": 4096}},
        "spec.engine.kvCacheTokens",
    ),
    "kv-cache-smaller-than-the-default-request": (
        {**VALID, "engine": {"kvCacheTokens": 1024}},
        "spec.engine.kvCacheTokens",
    ),
    "kv-cache-tokens-and-gpu-memory-share": (
        {**VALID, "engine": {"kvCacheTokens": 65536, "gpuMemoryUtilization": 0.9}},
        "spec.engine.gpuMemoryUtilization",
    ),
    "gpu-memory-share-above-one": (
        {**VALID, "engine": {"gpuMemoryUtilization": 1.5}},
        "spec.engine.gpuMemoryUtilization",
    ),
    "gpu-memory-share-zero": ({**VALID, "engine": {"gpuMemoryUtilization": 0}}, "spec.engine.gpuMemoryUtilization"),
    "expert-parallel-zero": ({**VALID, "parallelism": {"expert": 0}}, "spec.parallelism.expert"),
    "unknown-rollout-type": ({**VALID, "rollout": {"type": "BlueGreen"}}, "spec.rollout.type"),
    "autoscaling-min-zero": (
        {**VALID, "autoscaling": {"minReplicas": 0, "maxReplicas": 2}},
        "spec.autoscaling.minReplicas",
    ),
    "autoscaling-without-max": ({**VALID, "autoscaling": {"minReplicas": 1}}, "spec.autoscaling.maxReplicas"),
    "autoscaling-target-zero": ({**VALID, "autoscaling": {"maxReplicas": 2, "target": 0}}, "spec.autoscaling.target"),
    "drafter-canary-tolerance-above-1": ({**VALID, "drafterCanary": {"tolerance": 2}}, "spec.drafterCanary.tolerance"),
}
