"""Render functions: the objects a spec turns into."""

import copy
import pathlib

import yaml

from ddtree.config import EngineConfig
from ddtree_operator.api import SpeculativeDeploymentSpec
from ddtree_operator.render import (
    CONFIG_HASH_ANNOTATION,
    EngineDefaults,
    Owner,
    engine_config,
    labels,
    render_children,
    render_config_map,
    render_deployment,
    render_service,
    selector_labels,
    selector_string,
)
from invalid_specs import VALID

OWNER = Owner(name="demo", namespace="llm", uid="1f6a4a8e-0000-4000-8000-000000000001")
DEFAULTS = EngineDefaults(image="ddtree-engine:9.9", image_pull_policy="IfNotPresent")
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def spec(**overrides) -> SpeculativeDeploymentSpec:
    return SpeculativeDeploymentSpec.model_validate({**VALID, **overrides})


def example(name: str) -> SpeculativeDeploymentSpec:
    return SpeculativeDeploymentSpec.model_validate(yaml.safe_load((EXAMPLES / name).read_text())["spec"])


def container(deployment):
    (engine,) = deployment["spec"]["template"]["spec"]["containers"]
    return engine


def mounted_config(s: SpeculativeDeploymentSpec) -> dict:
    """The configuration file the pods read: the ConfigMap's engine.yaml, where `--config` points."""
    engine = container(render_deployment(OWNER, s, DEFAULTS))
    path = engine["args"][engine["args"].index("--config") + 1]
    folder, name = path.rsplit("/", 1)
    volume = next(m["name"] for m in engine["volumeMounts"] if m["mountPath"] == folder)
    pod = render_deployment(OWNER, s, DEFAULTS)["spec"]["template"]["spec"]
    assert next(v for v in pod["volumes"] if v["name"] == volume)["configMap"] == {"name": OWNER.name}
    return yaml.safe_load(render_config_map(OWNER, s)["data"][name])


def test_smollm2_example_engine_configuration():
    engine = container(render_deployment(OWNER, example("smollm2-cpu.yaml"), DEFAULTS))
    assert engine["command"] == ["ddtree", "serve"]
    assert engine["args"] == ["--config", "/etc/ddtree/engine.yaml"]
    assert mounted_config(example("smollm2-cpu.yaml")) == {
        "model": {"id": "smollm2-135m-instruct", "drafter": "smollm2-135m-instruct-dflash"},
        "speculation": {"method": "ddtree", "budget": 8},
        "kernels": {"batch_buckets": [1, 2]},
        "serving": {
            "host": "0.0.0.0",
            "port": 8000,
            "termination_log": "/dev/termination-log",
            "max_batch_size": 2,
            "served_model_name": "smollm2",
        },
    }
    assert engine["image"] == "ddtree-engine:9.9"  # the operator's default
    assert "nvidia.com/gpu" not in engine["resources"].get("limits", {})


def test_every_example_renders_a_configuration_the_engine_reads_as_the_spec_says():
    # the engine's own parser is the schema: a field the operator renders must exist there, by that name
    for path in sorted(EXAMPLES.glob("*.yaml")):
        s = example(path.name)
        config = EngineConfig.from_dict(mounted_config(s))
        assert config.model.id == s.model.uri.removeprefix("hf://")
        assert config.speculation.method == {"none": "ar"}.get(s.speculation.method, s.speculation.method)
        assert config.serving.port == s.metrics.port and config.parallel.tensor_parallel == s.parallelism.tensor


def test_a_changed_configuration_rolls_the_pods():
    def annotations(s):
        return render_deployment(OWNER, s, DEFAULTS)["spec"]["template"]["metadata"]["annotations"]

    assert annotations(spec()) == annotations(spec())
    assert (
        annotations(spec())[CONFIG_HASH_ANNOTATION]
        != annotations(spec(speculation={"budget": 16}))[CONFIG_HASH_ANNOTATION]
    )


def test_kimi_example_uses_eight_gpus_with_tensor_parallelism():
    deployment = render_deployment(OWNER, example("kimi-ddtree.yaml"), DEFAULTS)
    engine = container(deployment)
    config = mounted_config(example("kimi-ddtree.yaml"))
    assert config["parallel"] == {"tensor_parallel": 8, "expert_parallel": 8} and config["speculation"]["budget"] == 32
    assert config["model"]["trust_remote_code"] is True and config["serving"]["max_seq_len"] == 16384
    assert engine["resources"]["limits"] == {"memory": "256Gi", "nvidia.com/gpu": "8"}
    pod = deployment["spec"]["template"]["spec"]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [
        {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H200"]}]}
    ]
    cache = next(v for v in pod["volumes"] if v["name"] == "cache")
    assert cache["persistentVolumeClaim"] == {"claimName": "kimi-k2-6-cache", "readOnly": False}
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in engine["env"]
    # The startup budget of two hours is what the startup probe and the progress deadline allow.
    probe = engine["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] == 7200
    assert deployment["spec"]["progressDeadlineSeconds"] > 7200


def test_method_none_runs_the_engine_autoregressively_without_drafter():
    config = engine_config(spec(drafter=None, speculation={"method": "none"}))
    assert config["speculation"]["method"] == "ar"
    assert "drafter" not in config["model"]


def test_uris():
    config = engine_config(
        spec(
            model={"uri": "hf://Qwen/Qwen3-8B", "revision": "abc123"},
            drafter={"uri": "z-lab/Qwen3-8B-DFlash-b16", "revision": "v2"},
        )
    )
    assert config["model"] == {
        "id": "Qwen/Qwen3-8B",
        "revision": "abc123",
        "drafter": "z-lab/Qwen3-8B-DFlash-b16",
        "drafter_revision": "v2",
    }


def test_pvc_uris_are_mounted_read_only_once_per_claim():
    s = spec(model={"uri": "pvc://weights/kimi/target"}, drafter={"uri": "pvc://weights/kimi/drafter"})
    deployment = render_deployment(OWNER, s, DEFAULTS)
    engine = container(deployment)
    assert engine_config(s)["model"] == {
        "id": "/mnt/pvc/weights/kimi/target",
        "drafter": "/mnt/pvc/weights/kimi/drafter",
    }
    claims = [
        v
        for v in deployment["spec"]["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in v and v["name"].startswith("weights")
    ]
    assert claims == [{"name": "weights-0", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}]
    assert {"name": "weights-0", "mountPath": "/mnt/pvc/weights", "readOnly": True} in engine["volumeMounts"]


def test_read_only_model_cache_runs_the_hub_client_offline():
    engine = container(render_deployment(OWNER, spec(modelCache={"claimName": "c", "readOnly": True}), DEFAULTS))
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in engine["env"]
    assert {"name": "cache", "mountPath": "/var/cache/ddtree", "readOnly": True} in engine["volumeMounts"]


def test_probes_and_termination_message():
    engine = container(render_deployment(OWNER, spec(readiness={"startupTimeoutSeconds": 95}), DEFAULTS))
    assert engine["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert engine["startupProbe"]["failureThreshold"] == 10  # ceil(95 / 10)
    assert "initialDelaySeconds" not in engine["startupProbe"]
    assert engine["readinessProbe"]["httpGet"]["path"] == "/ready"  # gated on the smoke test
    assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
    assert engine["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert engine["terminationMessagePath"] == "/dev/termination-log"
    config = engine_config(spec(readiness={"startupTimeoutSeconds": 95}))
    assert config["serving"]["termination_log"] == engine["terminationMessagePath"]


def test_without_smoke_test_readiness_follows_health():
    engine = container(render_deployment(OWNER, spec(readiness={"smokeTest": False}), DEFAULTS))
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health"


def test_rollout_and_security():
    deployment = render_deployment(OWNER, spec(replicas=3), DEFAULTS)
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert container(deployment)["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }


def test_user_affinity_gets_the_gpu_product_in_every_term():
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
                ]
            }
        }
    }
    s = spec(scheduling={"affinity": affinity}, resources={"gpus": 1, "gpuProduct": ["NVIDIA-H100", "NVIDIA-H200"]})
    before = copy.deepcopy(s.model_dump())
    terms = render_deployment(OWNER, s, DEFAULTS)["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    product = {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100", "NVIDIA-H200"]}
    assert [t["matchExpressions"][-1] for t in terms] == [product, product]
    assert s.model_dump() == before  # rendering never mutates the spec


def test_scheduling_passthrough():
    toleration = {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
    s = spec(scheduling={"nodeSelector": {"pool": "llm"}, "priorityClassName": "serving", "tolerations": [toleration]})
    pod = render_deployment(OWNER, s, DEFAULTS)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "llm"} and pod["priorityClassName"] == "serving"
    assert pod["tolerations"] == [toleration]  # no GPU toleration without GPUs


def test_children_are_owned_and_selected_consistently():
    children = render_children(OWNER, spec(metrics={"podMonitor": True}), DEFAULTS)
    assert [c["kind"] for c in children] == ["ConfigMap", "Deployment", "Service", "PodMonitor"]
    for child in children:
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "ddtree.dev/v1alpha1",
            "kind": "SpeculativeDeployment",
            "name": "demo",
            "uid": OWNER.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert (child["metadata"]["name"], child["metadata"]["namespace"]) == ("demo", "llm")
    _, deployment, service, monitor = children
    assert deployment["spec"]["selector"]["matchLabels"] == selector_labels("demo")
    assert selector_labels("demo").items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["selector"] == selector_labels("demo")
    assert monitor["spec"]["selector"]["matchLabels"] == selector_labels("demo")
    assert monitor["spec"]["podMetricsEndpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert selector_string("demo") == "app.kubernetes.io/name=ddtree-engine,ddtree.dev/speculativedeployment=demo"
    assert labels("demo")["app.kubernetes.io/managed-by"] == "ddtree-operator"


def test_no_pod_monitor_unless_asked():
    assert [c["kind"] for c in render_children(OWNER, spec(), DEFAULTS)] == ["ConfigMap", "Deployment", "Service"]


def test_service_and_port_follow_metrics_port():
    s = spec(metrics={"port": 9000})
    ports = render_service(OWNER, s)["spec"]["ports"]
    assert ports == [{"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}]
    engine = container(render_deployment(OWNER, s, DEFAULTS))
    assert engine["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]
    assert engine_config(s)["serving"]["port"] == 9000


def test_rendering_is_deterministic():
    s = example("qwen3-8b-ddtree.yaml")
    assert render_children(OWNER, s, DEFAULTS) == render_children(OWNER, s, DEFAULTS)


def test_engine_overrides():
    s = spec(
        engine={
            "image": "registry.example/ddtree:1",
            "imagePullPolicy": "Always",
            "args": ["--seed", "1"],
            "env": [{"name": "X", "value": "1"}],
        }
    )
    engine = container(render_deployment(OWNER, s, DEFAULTS))
    assert (engine["image"], engine["imagePullPolicy"]) == ("registry.example/ddtree:1", "Always")
    assert engine["args"] == ["--config", "/etc/ddtree/engine.yaml", "--seed", "1"]  # flags override the file
    assert {"name": "X", "value": "1"} in engine["env"]


def test_tensor_parallel_pods_get_nvlink_multicast_off_unless_the_spec_says_otherwise():
    def env(**overrides):
        env = container(render_deployment(OWNER, spec(**overrides), DEFAULTS))["env"]
        return {e["name"]: e.get("value") for e in env}

    tp = {"resources": {"gpus": 2}, "parallelism": {"tensor": 2}}
    assert env(**tp)["NCCL_NVLS_ENABLE"] == "0" and env(**tp)["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert "NCCL_NVLS_ENABLE" not in env() and "NCCL_NVLS_ENABLE" not in env(resources={"gpus": 1})
    names = [
        e["name"]
        for e in container(
            render_deployment(OWNER, spec(**tp, engine={"env": [{"name": "NCCL_NVLS_ENABLE", "value": "1"}]}), DEFAULTS)
        )["env"]
    ]
    assert names.count("NCCL_NVLS_ENABLE") == 1
    assert env(**tp, engine={"env": [{"name": "NCCL_NVLS_ENABLE", "value": "1"}]})["NCCL_NVLS_ENABLE"] == "1"


def test_budget_by_batch_size_renders_one_budget_sorted_by_batch():
    spec = SpeculativeDeploymentSpec.model_validate(
        {
            **VALID,
            "speculation": {
                "batchBuckets": [1, 4, 16, 64],
                "budgetByBatchSize": [
                    {"maxBatchSize": 16, "budget": 8},
                    {"maxBatchSize": 64, "budget": 0},
                    {"maxBatchSize": 1, "budget": 32},
                ],
            },
        }
    )
    budget = mounted_config(spec)["speculation"]["budget"]
    # budget 0: no drafting from 17 to 64 requests
    assert budget == {1: 32, 16: 8, 64: 0} and list(budget) == [1, 16, 64]
    assert EngineConfig.from_dict(mounted_config(spec)).speculation.budget == {1: 32, 16: 8, 64: 0}


def test_trust_remote_code_expert_parallel_and_max_seq_len_reach_the_engine():
    s = spec(
        model={"uri": "moonshotai/Kimi-K2.6", "trustRemoteCode": True},
        parallelism={"tensor": 8, "expert": 1},
        resources={"gpus": 8},
        engine={"maxSeqLen": 8192},
    )
    config = mounted_config(s)
    assert config["model"]["trust_remote_code"] is True
    assert config["parallel"] == {"tensor_parallel": 8, "expert_parallel": 1}
    assert config["serving"]["max_seq_len"] == 8192
    engine = EngineConfig.from_dict(config)  # the engine's own parser reads them by these names
    assert engine.model.trust_remote_code is True and engine.parallel.expert_parallel == 1
    assert engine.serving.max_seq_len == 8192
    # unset: nothing rendered, the engine's defaults hold
    plain = mounted_config(spec())
    assert "trust_remote_code" not in plain["model"] and "parallel" not in plain
    assert "max_seq_len" not in plain["serving"]


def test_api_key_secret_is_mounted_where_the_engine_reads_its_keys(tmp_path):
    from ddtree.serving.auth import load_api_keys

    s = spec(serving={"apiKeySecret": {"name": "llm-keys", "key": "keys.txt"}})
    config = EngineConfig.from_dict(mounted_config(s))
    pod = render_deployment(OWNER, s, DEFAULTS)["spec"]["template"]["spec"]
    mount = next(m for m in container(render_deployment(OWNER, s, DEFAULTS))["volumeMounts"] if m["name"] == "api-keys")
    volume = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    assert mount["readOnly"] is True
    (item,) = volume["secret"]["items"]
    assert volume["secret"]["secretName"] == "llm-keys" and item["key"] == "keys.txt"
    assert config.serving.api_key_file == f"{mount['mountPath']}/{item['path']}"
    # what kubelet would put there is what the engine reads
    (tmp_path / item["path"]).write_text("k1\nk2\n")
    local = config.replace(serving={"api_key_file": str(tmp_path / item["path"])})
    assert load_api_keys(local) == (b"k1", b"k2")
    # no secret: no volume, no key file, an open API
    assert "api_key_file" not in mounted_config(spec())["serving"]
    assert all(
        v["name"] != "api-keys"
        for v in render_deployment(OWNER, spec(), DEFAULTS)["spec"]["template"]["spec"]["volumes"]
    )


def test_rollout_strategy_defaults_by_replica_size_and_overrides():
    def strategy(**overrides):
        return render_deployment(OWNER, spec(**overrides), DEFAULTS)["spec"]["strategy"]

    def rolling(surge, unavailable):
        return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}}

    assert strategy() == strategy(resources={"gpus": 1}) == rolling(1, 0)
    assert strategy(resources={"gpus": 8}) == rolling(0, 1)  # a node-sized replica: one old pod goes first
    assert render_deployment(OWNER, example("kimi-ddtree.yaml"), DEFAULTS)["spec"]["strategy"] == rolling(0, 1)
    assert strategy(rollout={"maxSurge": "25%", "maxUnavailable": "25%"}) == rolling("25%", "25%")
    assert strategy(resources={"gpus": 8}, rollout={"maxSurge": 1}) == rolling(1, 1)
