"""The pydantic models: examples parse, every cross-field rule rejects with its message."""

import pathlib

import pydantic
import pytest
import yaml

from ddtree_operator.api import SpeculativeDeploymentSpec
from invalid_specs import INVALID_SPECS, OUT_OF_BOUNDS_SPECS, VALID

EXAMPLES = sorted((pathlib.Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def test_there_are_the_three_examples():
    assert [p.name for p in EXAMPLES] == ["kimi-ddtree.yaml", "qwen3-8b-ddtree.yaml", "smollm2-cpu.yaml"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid_specs(path):
    doc = yaml.safe_load(path.read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("ddtree.dev/v1alpha1", "SpeculativeDeployment")
    SpeculativeDeploymentSpec.model_validate(doc["spec"])


def test_defaults():
    spec = SpeculativeDeploymentSpec.model_validate(VALID)
    assert spec.speculation.method == "ddtree" and spec.speculation.budget == "auto"
    assert spec.speculation.block_size is None  # taken from the drafter by the engine
    assert spec.replicas == 1 and spec.parallelism.tensor == 1 and spec.resources.gpus == 0
    assert spec.resources.shared_memory_size == "1Gi"
    assert spec.readiness.startup_timeout_seconds == 3600 and spec.readiness.smoke_test is True
    assert spec.metrics.port == 8000 and spec.metrics.scrape_interval_seconds == 15
    assert spec.metrics.pod_monitor is False


def test_wire_names_are_camel_case():
    spec = SpeculativeDeploymentSpec.model_validate(
        {**VALID, "readiness": {"startupTimeoutSeconds": 120}, "resources": {"sharedMemorySize": "2Gi"}}
    )
    assert spec.readiness.startup_timeout_seconds == 120
    dumped = spec.model_dump(by_alias=True)
    assert dumped["readiness"]["startupTimeoutSeconds"] == 120 and dumped["resources"]["sharedMemorySize"] == "2Gi"


@pytest.mark.parametrize("case", INVALID_SPECS, ids=str)
def test_cross_field_rules_reject(case):
    spec, message = INVALID_SPECS[case]
    with pytest.raises(pydantic.ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeDeploymentSpec.model_validate(spec)


@pytest.mark.parametrize("case", OUT_OF_BOUNDS_SPECS, ids=str)
def test_bounds_reject(case):
    spec, _ = OUT_OF_BOUNDS_SPECS[case]
    with pytest.raises(pydantic.ValidationError):
        SpeculativeDeploymentSpec.model_validate(spec)


def test_values_near_the_bounds_are_accepted():
    accepted = [
        {"rollout": {"maxSurge": "150%", "maxUnavailable": "100%"}},  # a surge may exceed the replicas
        {"resources": {"cpu": "500m", "memory": "+2Gi", "sharedMemorySize": "0"}},
        {"speculation": {"batchBuckets": [1, 8]}},  # the engine's default of 8 rows
        # a --max-batch-size in engine.args overrides the field: the engine checks the buckets against it
        {"speculation": {"batchBuckets": [1, 16]}, "engine": {"args": ["--max-batch-size", "16"]}},
    ]
    for extra in accepted:
        SpeculativeDeploymentSpec.model_validate({**VALID, **extra})


def test_unknown_fields_are_rejected():
    with pytest.raises(pydantic.ValidationError, match="budgett"):
        SpeculativeDeploymentSpec.model_validate({**VALID, "speculation": {"budgett": 3}})


def test_new_fields_default_to_the_engines_defaults():
    spec = SpeculativeDeploymentSpec.model_validate(VALID)
    assert spec.model.trust_remote_code is False and spec.parallelism.expert is None
    assert spec.engine.max_seq_len is None and spec.resources.gpu_memory is None
    assert (spec.rollout.max_surge, spec.rollout.max_unavailable) == (None, None)


def test_rollout_defaults_follow_the_replica_size():
    def effective(gpus, node_gpus=8, **rollout):
        s = SpeculativeDeploymentSpec.model_validate({**VALID, "resources": {"gpus": gpus}, "rollout": rollout})
        return s.rollout.effective(s.resources.gpus, node_gpus)

    assert effective(0) == effective(1) == effective(4) == (1, 0)  # surge: capacity never drops
    assert effective(8) == effective(16) == (0, 1)  # a whole node: no room for a surge pod
    assert effective(4, node_gpus=4) == (0, 1) and effective(8, node_gpus=16) == (1, 0)  # the operator's nodeGpus
    assert effective(8, maxSurge=1) == (1, 1) and effective(1, maxUnavailable="50%") == (1, "50%")
    assert effective(8, maxSurge="25%", maxUnavailable=0) == ("25%", 0)
    # one set to 0 makes the other default to 1, whatever the replica size: a Deployment refuses both 0
    assert effective(1, maxSurge=0) == (0, 1) and effective(8, maxUnavailable="0%") == (1, "0%")


def test_rollout_type_and_autoscaling_defaults():
    spec = SpeculativeDeploymentSpec.model_validate(VALID)
    assert spec.rollout.type == "RollingUpdate" and spec.autoscaling is None
    scaled = SpeculativeDeploymentSpec.model_validate({**VALID, "autoscaling": {"maxReplicas": 4}})
    assert scaled.autoscaling is not None
    assert (scaled.autoscaling.min_replicas, scaled.autoscaling.max_replicas, scaled.autoscaling.target) == (1, 4, 0.8)
    recreate = SpeculativeDeploymentSpec.model_validate({**VALID, "rollout": {"type": "Recreate"}})
    assert recreate.rollout.type == "Recreate"


def test_expert_parallel_is_one_or_the_tensor_degree():
    for expert in (1, 8):
        s = {**VALID, "resources": {"gpus": 8}, "parallelism": {"tensor": 8, "expert": expert}}
        assert SpeculativeDeploymentSpec.model_validate(s).parallelism.expert == expert


def test_quantities_accept_integers_and_strings():
    spec = SpeculativeDeploymentSpec.model_validate({**VALID, "resources": {"cpu": 4, "memory": "16Gi"}})
    assert (spec.resources.cpu, spec.resources.memory) == (4, "16Gi")
