"""Render functions: the objects a spec turns into."""

import copy
import pathlib

import pytest
import yaml

from ddtree.config import EngineConfig
from ddtree_operator.api import SpeculativeDeploymentSpec
from ddtree_operator.render import (
    CONFIG_HASH_ANNOTATION,
    EngineDefaults,
    Owner,
    engine_config,
    engine_defaults_from_env,
    labels,
    render_children,
    render_config_map,
    render_deployment,
    render_pod_disruption_budget,
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
            "engine": {"maxBatchSize": 64},
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


def test_trust_remote_code_expert_parallel_and_context_reach_the_engine():
    s = spec(
        model={"uri": "moonshotai/Kimi-K2.6", "trustRemoteCode": True},
        parallelism={"tensor": 8, "expert": 1},
        resources={"gpus": 8},
        engine={"maxSeqLen": 8192, "kvCacheTokens": 65536},
    )
    config = mounted_config(s)
    assert config["model"]["trust_remote_code"] is True
    assert config["parallel"] == {"tensor_parallel": 8, "expert_parallel": 1}
    assert config["serving"]["max_seq_len"] == 8192 and config["serving"]["kv_cache_tokens"] == 65536
    engine = EngineConfig.from_dict(config)  # the engine's own parser reads them by these names
    assert engine.model.trust_remote_code is True and engine.parallel.expert_parallel == 1
    assert (engine.serving.max_seq_len, engine.serving.kv_cache_tokens) == (8192, 65536)
    # unset: nothing rendered, the engine's defaults hold
    plain = mounted_config(spec())
    assert "trust_remote_code" not in plain["model"] and "parallel" not in plain
    assert "max_seq_len" not in plain["serving"] and "kv_cache_tokens" not in plain["serving"]
    shared = EngineConfig.from_dict(mounted_config(spec(engine={"gpuMemoryUtilization": 0.85})))
    assert (shared.serving.gpu_memory_utilization, shared.serving.kv_cache_tokens) == (0.85, None)


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
    def strategy(defaults=DEFAULTS, **overrides):
        return render_deployment(OWNER, spec(**overrides), defaults)["spec"]["strategy"]

    def rolling(surge, unavailable):
        return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable}}

    assert strategy() == strategy(resources={"gpus": 1}) == rolling(1, 0)
    assert strategy(resources={"gpus": 8}) == rolling(0, 1)  # a node-sized replica: one old pod goes first
    assert render_deployment(OWNER, example("kimi-ddtree.yaml"), DEFAULTS)["spec"]["strategy"] == rolling(0, 1)
    assert strategy(rollout={"maxSurge": "25%", "maxUnavailable": "25%"}) == rolling("25%", "25%")
    assert strategy(resources={"gpus": 8}, rollout={"maxSurge": 1}) == rolling(1, 1)
    assert strategy(rollout={"maxSurge": 0}) == rolling(0, 1)
    # what fills a node is the operator's nodeGpus
    four_gpu_nodes = DEFAULTS.model_copy(update={"node_gpus": 4})
    assert strategy(four_gpu_nodes, resources={"gpus": 4}) == rolling(0, 1)
    assert strategy(DEFAULTS.model_copy(update={"node_gpus": 16}), resources={"gpus": 8}) == rolling(1, 0)
    assert strategy(rollout={"type": "Recreate"}) == strategy(resources={"gpus": 8}, rollout={"type": "Recreate"})
    assert strategy(rollout={"type": "Recreate"}) == {"type": "Recreate"}


def test_pod_disruption_budget_only_for_several_replicas():
    assert render_pod_disruption_budget(OWNER, spec(), DEFAULTS) is None
    assert render_pod_disruption_budget(OWNER, spec(replicas=0), DEFAULTS) is None
    assert "PodDisruptionBudget" not in [c["kind"] for c in render_children(OWNER, spec(), DEFAULTS)]
    budget = render_pod_disruption_budget(OWNER, spec(replicas=2), DEFAULTS)
    assert budget is not None and (budget["apiVersion"], budget["kind"]) == ("policy/v1", "PodDisruptionBudget")
    # one pod at a time by default, even where a rollout takes none away (it surges instead)
    assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels("demo")}}
    assert budget["metadata"]["ownerReferences"] == render_service(OWNER, spec())["metadata"]["ownerReferences"]

    def allowed(**overrides):
        return render_pod_disruption_budget(OWNER, spec(replicas=4, **overrides), DEFAULTS)["spec"]["maxUnavailable"]

    # as many as a rolling update may take
    assert allowed(rollout={"maxUnavailable": "50%"}) == "50%" and allowed(rollout={"maxUnavailable": 2}) == 2
    assert allowed(rollout={"maxUnavailable": 0}) == 1 and allowed(resources={"gpus": 8}) == 1
    assert allowed(rollout={"type": "Recreate"}) == 1


def test_autoscaling_renders_an_hpa_on_the_resources_scale_subresource():
    s = spec(autoscaling={"minReplicas": 2, "maxReplicas": 6, "target": 0.75})
    children = render_children(OWNER, s, DEFAULTS)
    assert [c["kind"] for c in children][-1] == "HorizontalPodAutoscaler"
    assert "ScaledObject" not in [c["kind"] for c in children]
    hpa = children[-1]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"] == {
        "scaleTargetRef": {"apiVersion": "ddtree.dev/v1alpha1", "kind": "SpeculativeDeployment", "name": "demo"},
        "minReplicas": 2,
        "maxReplicas": 6,
        "metrics": [
            {
                "type": "Pods",
                "pods": {"metric": {"name": "ddtree_load"}, "target": {"type": "AverageValue", "averageValue": "750m"}},
            }
        ],
    }
    assert hpa["metadata"]["ownerReferences"][0]["kind"] == "SpeculativeDeployment"
    default_target = render_children(OWNER, spec(autoscaling={"maxReplicas": 3}), DEFAULTS)[-1]
    assert default_target["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "800m"
    assert default_target["spec"]["minReplicas"] == 1
    # the replicas the autoscaler wrote into spec.replicas are what the Deployment gets
    assert render_deployment(OWNER, spec(replicas=5, autoscaling={"maxReplicas": 6}), DEFAULTS)["spec"]["replicas"] == 5


def test_autoscaling_with_keda_renders_a_scaled_object():
    keda = DEFAULTS.model_copy(update={"autoscaling_provider": "keda", "keda_prometheus_address": "http://prom:9090"})
    children = render_children(OWNER, spec(autoscaling={"maxReplicas": 4, "target": 1.5}), keda)
    assert "HorizontalPodAutoscaler" not in [c["kind"] for c in children]
    scaled = children[-1]
    assert (scaled["apiVersion"], scaled["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"] == {
        "apiVersion": "ddtree.dev/v1alpha1",
        "kind": "SpeculativeDeployment",
        "name": "demo",
    }
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (1, 4)
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"] == {
        "serverAddress": "http://prom:9090",
        # a sum: KEDA's HPA divides it by the replicas, so the threshold is a load per replica
        "query": 'sum(ddtree_load{namespace="llm",pod=~"demo-[a-z0-9]+-[a-z0-9]{5}"})',
        "threshold": "1.5",
    }


def test_engine_defaults_reach_the_pods():
    defaults = EngineDefaults(
        image="ddtree-engine:9.9",
        image_pull_secrets=[{"name": "registry"}],
        service_account_name="engine",
        pod_labels={"team": "llm"},
        pod_annotations={"sidecar.istio.io/inject": "false"},
        priority_class_name="inference",
        cache={"sizeLimit": "100Gi"},
    )
    deployment = render_deployment(OWNER, spec(), defaults)
    template = deployment["spec"]["template"]
    pod = template["spec"]
    assert pod["imagePullSecrets"] == [{"name": "registry"}] and pod["serviceAccountName"] == "engine"
    assert pod["priorityClassName"] == "inference"
    assert template["metadata"]["labels"] == {"team": "llm", **labels("demo")}
    assert template["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    assert CONFIG_HASH_ANNOTATION in template["metadata"]["annotations"]
    assert next(v for v in pod["volumes"] if v["name"] == "cache") == {
        "name": "cache",
        "emptyDir": {"sizeLimit": "100Gi"},
    }
    assert container(deployment)["resources"]["requests"] == {"ephemeral-storage": "100Gi"}
    # the spec's own choices win
    own = render_deployment(
        OWNER, spec(scheduling={"priorityClassName": "batch"}, modelCache={"claimName": "weights"}), defaults
    )
    assert own["spec"]["template"]["spec"]["priorityClassName"] == "batch"
    assert next(v for v in own["spec"]["template"]["spec"]["volumes"] if v["name"] == "cache") == {
        "name": "cache",
        "persistentVolumeClaim": {"claimName": "weights", "readOnly": False},
    }
    assert "ephemeral-storage" not in container(own)["resources"].get("requests", {})
    # an existing claim as the cache
    claimed = render_deployment(OWNER, spec(), EngineDefaults(image="ddtree-engine:9.9", cache={"claimName": "shared"}))
    pod = claimed["spec"]["template"]["spec"]
    assert next(v for v in pod["volumes"] if v["name"] == "cache") == {
        "name": "cache",
        "persistentVolumeClaim": {"claimName": "shared"},
    }
    # none set: nothing rendered
    plain = render_deployment(OWNER, spec(), DEFAULTS)["spec"]["template"]
    assert not {"imagePullSecrets", "serviceAccountName", "priorityClassName"} & set(plain["spec"])
    assert plain["metadata"]["labels"] == labels("demo")
    assert next(v for v in plain["spec"]["volumes"] if v["name"] == "cache") == {"name": "cache", "emptyDir": {}}


def test_engine_defaults_from_the_environment():
    plain = engine_defaults_from_env({})
    assert plain == EngineDefaults() and plain.node_gpus == 8 and plain.autoscaling_provider == "prometheus-adapter"
    assert plain.keda_prometheus_address == "http://prometheus-operated.monitoring.svc:9090"
    parsed = engine_defaults_from_env(
        {
            "DDTREE_ENGINE_IMAGE": "registry.example/ddtree:2",
            "DDTREE_ENGINE_IMAGE_PULL_POLICY": "Always",
            "DDTREE_ENGINE_DEFAULTS": '{"imagePullSecrets": [{"name": "r"}], "podLabels": {"a": "b"}, '
            '"cache": {"claimName": "c"}, "nodeGpus": 4, "autoscalingProvider": "keda", '
            '"kedaPrometheusAddress": "http://p:9090", "serviceAccountName": "s", "priorityClassName": "p", '
            '"podAnnotations": {"x": "y"}}',
        }
    )
    assert (parsed.image, parsed.image_pull_policy, parsed.node_gpus) == ("registry.example/ddtree:2", "Always", 4)
    assert parsed.cache is not None and parsed.cache.claim_name == "c" and parsed.autoscaling_provider == "keda"
    assert parsed.image_pull_secrets[0].name == "r" and parsed.pod_labels == {"a": "b"}


@pytest.mark.parametrize(
    "text, message",
    [
        ("{nodeGpus: 4}", "DDTREE_ENGINE_DEFAULTS is not valid JSON"),
        ("[1]", "DDTREE_ENGINE_DEFAULTS must be a JSON object, not list"),
        ('{"nodeGPUs": 4}', "DDTREE_ENGINE_DEFAULTS has unknown keys ['nodeGPUs']; known keys: autoscalingProvider"),
        ('{"image": "x"}', "unknown keys ['image']"),  # DDTREE_ENGINE_IMAGE sets it
        ('{"nodeGpus": 0}', "DDTREE_ENGINE_DEFAULTS nodeGpus: Input should be greater than or equal to 1"),
        ('{"autoscalingProvider": "hpa"}', "DDTREE_ENGINE_DEFAULTS autoscalingProvider: Input should be"),
        ('{"cache": {"sizeLimit": "1Gi", "claimName": "c"}}', "cache needs exactly one of sizeLimit and claimName"),
        ('{"cache": {"sizeLimit": "lots"}}', "is not a Kubernetes quantity"),
        (
            '{"podLabels": {"app.kubernetes.io/name": "mine"}}',
            "podLabels: Value error, must not set the operator's own keys ['app.kubernetes.io/name']",
        ),
        ('{"podAnnotations": {"ddtree.dev/engine-config-sha256": "0"}}', "must not set the operator's own keys"),
    ],
)
def test_bad_engine_defaults_are_one_clear_error(text, message):
    with pytest.raises(ValueError) as error:
        engine_defaults_from_env({"DDTREE_ENGINE_DEFAULTS": text})
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_bad_image_pull_policy_names_its_variable():
    with pytest.raises(ValueError, match="DDTREE_ENGINE_IMAGE_PULL_POLICY: Input should be"):
        engine_defaults_from_env({"DDTREE_ENGINE_IMAGE_PULL_POLICY": "Sometimes"})


def test_the_scaled_objects_pod_pattern_follows_kubernetes_name_generation():
    """Pods are named by Kubernetes' rule: the ReplicaSet NAME-<hash>, then its prefix "NAME-<hash>-" cut
    to 58 characters, then 5 random ones; the pattern (anchored, as PromQL's =~ is) must hold every length
    of name the CRD allows, and keep the canary's and other workloads' pods out where the names allow."""
    import re

    from ddtree_operator.render import deployment_pods

    def pod(deployment: str, template_hash: str) -> str:
        return f"{deployment}-{template_hash}-"[:58] + "x7k2q"

    for length in (4, 40, 46, 47, 50, 56, 57, 63):
        name = ("d" + "x" * 62)[:length]
        pattern = re.compile(deployment_pods(name))
        for template_hash in ("5d8f7c9b4", "7f9c8d6b5a"):
            assert pattern.fullmatch(pod(name, template_hash)), (length, template_hash)
            if length <= 46:  # the canary's pods are told apart while its hash is whole
                assert not pattern.fullmatch(pod(f"{name}-canary", template_hash)), length
        assert not pattern.fullmatch(f"{name}-x-0"[:63]) or length >= 57, length
        assert not pattern.fullmatch(f"other{name}-5d8f7c9b4-x7k2q"), length
