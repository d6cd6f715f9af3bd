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
}

# Bounds and formats enforced by plain OpenAPI keywords: id -> (spec, path the server names)
OUT_OF_BOUNDS_SPECS = {
    "budget-too-large": ({**VALID, "speculation": {"budget": 4096}}, "spec.speculation.budget"),
    "budget-zero": ({**VALID, "speculation": {"budget": 0}}, "spec.speculation.budget"),
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
}
