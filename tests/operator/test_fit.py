"""The fit check's pure part: which configs a spec needs, the engine settings it plans with, and the
decision from config.json dicts (the published Kimi K2.6 config, tests/data/model_configs)."""

import json
import pathlib
import subprocess
import sys

import pytest

from ddtree.models.memory import plan_memory
from ddtree_operator.api import SpeculativeDeploymentSpec
from ddtree_operator.fit import ConfigRef, MemoryCheck, PlanInputs, decide, engine_flag, hub_ref, plan_inputs

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "data" / "model_configs"
KIMI = json.loads((CONFIGS / "kimi-k2.6.json").read_text())
KIMI_REF = ConfigRef("moonshotai/Kimi-K2.6", "main")
DRAFTER_REF = ConfigRef("z-lab/Kimi-K2.6-DFlash", "main")
H200 = 141 << 30
# Kimi K2.6's DFlash drafter (partial; its MLP width derived from the published weight size: SOURCES.md)
DRAFTER = json.loads((CONFIGS / "dflash-kimi-k2.6.json").read_text())
EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "kimi-ddtree.yaml"


def kimi(tensor: int, **overrides) -> SpeculativeDeploymentSpec:
    spec = {
        "model": {"uri": "hf://moonshotai/Kimi-K2.6", "trustRemoteCode": True},
        "speculation": {"method": "none"},
        "parallelism": {"tensor": tensor},
        "resources": {"gpus": tensor, "gpuMemory": "141Gi"},
    }
    spec.update(overrides)
    return SpeculativeDeploymentSpec.model_validate(spec)


def with_drafter(tensor: int, **overrides) -> SpeculativeDeploymentSpec:
    drafter = {"speculation": {"method": "ddtree", "budget": 16}, "drafter": {"uri": "z-lab/Kimi-K2.6-DFlash"}}
    return kimi(tensor, **{**drafter, **overrides})


def test_the_plan_is_importable_without_torch():
    # The operator image has no torch: importing the fit check must not pull it in.
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch': raise ImportError('no torch in the operator image')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import ddtree_operator.handlers, ddtree_operator.fit\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "uri, expected",
    [
        ("moonshotai/Kimi-K2.6", ConfigRef("moonshotai/Kimi-K2.6", "main")),
        ("hf://Qwen/Qwen3-8B", ConfigRef("Qwen/Qwen3-8B", "main")),
        ("smollm2-135m-instruct", "built-in model"),
        ("random:tiny", "random-weight model"),
        ("pvc://models/kimi", "not on the hub"),
        ("/models/kimi", "not on the hub"),
        ("models/kimi.gguf", "not on the hub"),
    ],
)
def test_hub_ref(uri, expected):
    found = hub_ref(uri, None)
    assert found == expected if isinstance(expected, ConfigRef) else expected in found
    assert hub_ref("org/name", "v1.0") == ConfigRef("org/name", "v1.0")


def test_skipped_without_gpu_memory_or_a_hub_model():
    spec = SpeculativeDeploymentSpec.model_validate({"model": {"uri": "org/name"}, "speculation": {"method": "none"}})
    assert plan_inputs(spec) == MemoryCheck("Skipped", "memory plan skipped: spec.resources.gpuMemory is not set")
    random = kimi(1, model={"uri": "random:kimi-k2"})
    check = plan_inputs(random)
    assert isinstance(check, MemoryCheck) and check.result == "Skipped" and not check.blocks
    assert check.message.startswith("memory plan skipped: random:kimi-k2 is a random-weight model")


def test_plan_inputs_follow_the_spec_and_the_engine_defaults():
    inputs = plan_inputs(with_drafter(8))
    assert isinstance(inputs, PlanInputs)
    assert (inputs.target, inputs.drafter, inputs.drafter_unavailable) == (KIMI_REF, DRAFTER_REF, None)
    assert (inputs.gpus, inputs.gpu_memory) == (8, H200)
    # the engine's defaults (max_context: 2048, or the model's context where shorter, once its config is read)
    assert (inputs.max_context, inputs.max_batch, inputs.dtype) == (None, 8, "bfloat16")
    assert (inputs.budget, inputs.expert_parallel) == (16, None)
    spec = kimi(
        8,
        parallelism={"tensor": 8, "expert": 1},
        engine={"maxSeqLen": 32768, "maxBatchSize": 4},
    )
    inputs = plan_inputs(spec)
    assert (inputs.max_context, inputs.max_batch, inputs.expert_parallel, inputs.budget) == (32768, 4, 1, None)
    assert inputs.kv_cache_tokens is None  # the engine's default pool: every row at its longest
    spec = kimi(8, engine={"maxSeqLen": 32768, "kvCacheTokens": 65536, "args": ["--kv-cache-tokens", "131072"]})
    assert plan_inputs(spec).kv_cache_tokens == 131072
    assert plan_inputs(kimi(8, engine={"maxSeqLen": 32768, "kvCacheTokens": 65536})).kv_cache_tokens == 65536
    assert plan_inputs(kimi(8, engine={"gpuMemoryUtilization": 0.9})).gpu_memory_utilization == 0.9
    spec = kimi(8, engine={"gpuMemoryUtilization": 0.9, "args": ["--gpu-memory-utilization=0.8"]})
    assert plan_inputs(spec).gpu_memory_utilization == 0.8
    # spec.engine.args come last on the command line, so they win
    spec = kimi(8, engine={"maxSeqLen": 32768, "args": ["--max-seq-len=4096", "--dtype", "float16"]})
    inputs = plan_inputs(spec)
    assert (inputs.max_context, inputs.dtype) == (4096, "float16")


def test_budget_per_batch_size_plans_the_largest_tree():
    steps = [{"maxBatchSize": 1, "budget": 64}, {"maxBatchSize": 8, "budget": 8}]
    spec = with_drafter(8, speculation={"method": "ddtree", "budgetByBatchSize": steps})
    assert plan_inputs(spec).budget == 64
    assert plan_inputs(with_drafter(8, speculation={"method": "dflash"})).budget is None  # one block, no tree


def test_engine_flag_takes_the_last_value():
    assert engine_flag(["--max-seq-len", "1", "--max-seq-len=2"], "--max-seq-len") == "2"
    assert engine_flag(["--max-seq-len"], "--max-seq-len") is None
    assert engine_flag(["--max-seq-lenx=3"], "--max-seq-len") is None


def test_kimi_on_one_h200_does_not_fit_and_on_eight_fits():
    one = decide(plan_inputs(kimi(1)), {KIMI_REF: KIMI})
    expected = plan_memory(KIMI, gpus=1, gpu_memory=H200, max_context=2048, max_batch=8)
    assert (one.result, one.message, one.blocks) == ("DoesNotFit", expected.reason, True)
    assert one.per_rank_bytes == expected.per_rank_bytes
    eight = decide(plan_inputs(kimi(8)), {KIMI_REF: KIMI})
    assert eight.result == "Fits" and not eight.blocks and eight.max_context_that_fits > 2048
    assert eight.status()["perRankBytes"]["routed_experts"] > 0


def test_the_context_is_the_engines_default_and_no_more_than_the_models():
    """Without maxSeqLen the plan is the engine's: 2048 tokens, or the model's context where shorter; a
    maxSeqLen past the model's context does not fit, since the engine refuses it."""
    short = {**KIMI, "text_config": {**KIMI["text_config"], "max_position_embeddings": 1024}}
    default = decide(plan_inputs(kimi(8)), {KIMI_REF: short})
    expected = plan_memory(short, gpus=8, gpu_memory=H200, max_context=1024, max_batch=8)
    assert (default.result, default.message) == ("Fits", expected.reason)
    assert default.max_context_that_fits == 1024
    longer = decide(plan_inputs(kimi(8, engine={"maxSeqLen": 4096})), {KIMI_REF: short})
    assert longer.result == "DoesNotFit" and longer.blocks
    assert "max_context 4,096 is more than the model's context of 1,024 tokens" in longer.message
    assert (
        decide(plan_inputs(kimi(8)), {KIMI_REF: KIMI}).message
        == plan_memory(KIMI, gpus=8, gpu_memory=H200, max_context=2048, max_batch=8).reason
    )


def test_the_drafter_counts_when_its_config_is_there():
    check = decide(plan_inputs(with_drafter(8)), {KIMI_REF: KIMI, DRAFTER_REF: DRAFTER})
    alone = decide(plan_inputs(kimi(8)), {KIMI_REF: KIMI})
    assert check.result == "Fits" and check.per_rank_bytes["drafter_weights"] > 0
    assert sum(check.per_rank_bytes.values()) > sum(alone.per_rank_bytes.values())


def test_without_the_drafters_config_the_target_alone_is_a_lower_bound():
    missing = "HTTP 404 from http://127.0.0.1:1/z-lab/Kimi-K2.6-DFlash/resolve/main/config.json"
    eight = decide(plan_inputs(with_drafter(8)), {KIMI_REF: KIMI, DRAFTER_REF: missing})
    assert eight.result == "Skipped" and not eight.blocks
    assert eight.message.startswith("memory plan skipped: cannot get the config of z-lab/Kimi-K2.6-DFlash: HTTP 404")
    assert "the target alone fits" in eight.message
    one = decide(plan_inputs(with_drafter(1)), {KIMI_REF: KIMI, DRAFTER_REF: missing})
    assert one.result == "DoesNotFit" and "the drafter is not counted" in one.message
    # a drafter that is not on the hub (a built-in or a volume) is not counted either
    spec = kimi(1, speculation={"method": "dflash"}, drafter={"uri": "pvc://models/drafter"})
    check = decide(plan_inputs(spec), {KIMI_REF: KIMI})
    assert check.result == "DoesNotFit" and "pvc://models/drafter is not on the hub" in check.message


def test_a_config_that_cannot_be_had_or_read_never_blocks():
    unreachable = decide(plan_inputs(kimi(1)), {KIMI_REF: "Cannot connect to host 127.0.0.1:9"})
    assert unreachable.result == "Skipped" and not unreachable.blocks
    assert unreachable.message == (
        "memory plan skipped: cannot get the config of moonshotai/Kimi-K2.6: Cannot connect to host 127.0.0.1:9"
    )
    unreadable = decide(plan_inputs(kimi(1)), {KIMI_REF: {"model_type": "deepseek_v3"}})
    assert unreadable.result == "Skipped" and unreadable.message.startswith("memory plan skipped: no plan for")
    odd = decide(plan_inputs(kimi(1)), {KIMI_REF: {"model_type": "llama"}})  # missing keys: any error skips
    assert odd.result == "Skipped"


@pytest.mark.parametrize("gpu_memory", ["141Gi", "288G"], ids=["8xH200", "8xB300"])
def test_the_kimi_example_fits_its_node(gpu_memory):
    """examples/kimi-ddtree.yaml as written (its context, batch, budget and parallelism) against the
    published Kimi K2.6 config and its drafter's, on 8 H200s and on 8 B300s."""
    import yaml

    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    spec["resources"]["gpuMemory"] = gpu_memory
    inputs = plan_inputs(SpeculativeDeploymentSpec.model_validate(spec))
    assert isinstance(inputs, PlanInputs) and inputs.drafter is not None
    assert (inputs.gpus, inputs.max_context, inputs.max_batch) == (8, 16384, 16)
    check = decide(inputs, {inputs.target: KIMI, inputs.drafter: DRAFTER})
    assert check.result == "Fits", check.message
