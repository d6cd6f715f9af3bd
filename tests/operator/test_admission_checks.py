"""The config checks' pure part (admission.py): which configs a spec needs and what the checks say of the
published configs (tests/data/model_configs), the built-in model and drafter, and configs made wrong on
purpose; the Compatible condition they give the status."""

import copy
import datetime
import json
import pathlib

import pytest

from ddtree.models.builtin import builtin_config
from ddtree_operator.admission import Compatibility, SpecChecks, check_configs, config_refs, run_checks
from ddtree_operator.api import SpeculativeDeploymentSpec
from ddtree_operator.fit import ConfigRef, MemoryCheck
from ddtree_operator.status import compute_status

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "data" / "model_configs"
KIMI = json.loads((CONFIGS / "kimi-k2.6.json").read_text())
KIMI_DRAFTER = json.loads((CONFIGS / "dflash-kimi-k2.6.json").read_text())
QWEN_MOE = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())
KIMI_REF = ConfigRef("moonshotai/Kimi-K2.6", "main")
DRAFTER_REF = ConfigRef("z-lab/Kimi-K2.6-DFlash", "main")
QWEN_REF = ConfigRef("Qwen/Qwen3-30B-A3B", "main")
SMOLLM2 = "smollm2-135m-instruct"


def spec(model: str, drafter: str | None = None, tensor: int = 1, **overrides) -> SpeculativeDeploymentSpec:
    doc: dict = {
        "model": {"uri": model},
        "speculation": {"method": "ddtree" if drafter else "none"},
        "parallelism": {"tensor": tensor},
        "resources": {"gpus": tensor},
    }
    if drafter:
        doc["drafter"] = {"uri": drafter}
    doc.update(overrides)
    return SpeculativeDeploymentSpec.model_validate(doc)


def kimi_drafter(**changes) -> dict:
    config = copy.deepcopy(KIMI_DRAFTER)
    config["dflash_config"].update(changes)
    return config


def test_the_built_in_model_and_its_drafter_pass_without_fetching_anything():
    s = spec(SMOLLM2, f"{SMOLLM2}-dflash")
    assert config_refs(s) == []
    assert check_configs(s, {}) == Compatibility()
    assert Compatibility().condition() == (
        "True",
        "Compatible",
        "the drafter fits the model and the model splits over its GPUs",
    )


def test_the_published_kimi_drafter_fits_kimi_on_eight_gpus():
    s = spec("moonshotai/Kimi-K2.6", "z-lab/Kimi-K2.6-DFlash", tensor=8)
    assert config_refs(s) == [KIMI_REF, DRAFTER_REF]
    assert check_configs(s, {KIMI_REF: KIMI, DRAFTER_REF: KIMI_DRAFTER}) == Compatibility()


def test_a_drafter_of_another_model_is_refused_naming_every_mismatch():
    s = spec("moonshotai/Kimi-K2.6", f"{SMOLLM2}-dflash", tensor=8)
    (problem,) = check_configs(s, {KIMI_REF: KIMI}).problems
    assert problem == (
        f"spec.drafter {SMOLLM2}-dflash does not fit spec.model moonshotai/Kimi-K2.6: vocabulary 49152 != "
        "target's 163840; hidden size 576 != target's 7168"
    )


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"target_layer_ids": [1, 12, 24, 61, 70]}, "target_layer_ids [61, 70] outside the target's 61 layers"),
        ({"mask_token_id": 163840}, "mask_token_id 163840 outside the vocabulary"),
        ({"block_size": 1}, "block_size 1 < 2"),
    ],
)
def test_taps_mask_token_and_block_the_target_does_not_have(changes, expected):
    s = spec("moonshotai/Kimi-K2.6", "z-lab/Kimi-K2.6-DFlash", tensor=8)
    compatibility = check_configs(s, {KIMI_REF: KIMI, DRAFTER_REF: kimi_drafter(**changes)})
    assert compatibility.problems == (
        f"spec.drafter z-lab/Kimi-K2.6-DFlash does not fit spec.model moonshotai/Kimi-K2.6: {expected}",
    )
    assert compatibility.blocks and compatibility.condition() == ("False", "Incompatible", compatibility.message)


def test_a_drafter_config_without_its_dflash_keys_is_refused_as_the_engine_refuses_it():
    drafter = copy.deepcopy(KIMI_DRAFTER)
    del drafter["dflash_config"]["mask_token_id"]
    s = spec("moonshotai/Kimi-K2.6", "z-lab/Kimi-K2.6-DFlash", tensor=8)
    assert check_configs(s, {KIMI_REF: KIMI, DRAFTER_REF: drafter}).problems == (
        "spec.drafter z-lab/Kimi-K2.6-DFlash: drafter config has no mask_token_id",
    )


def test_a_chain_only_drafter_is_refused_under_ddtree_and_admitted_under_dflash():
    """A DFlash2 drafter drafts a chain (each position's distribution depends on the token before it): the
    engine refuses it under ddtree at load, and the webhook refuses that spec with the engine's words."""
    drafter = {**copy.deepcopy(KIMI_DRAFTER), "architectures": ["DFlash2DraftModel"]}
    configs = {KIMI_REF: KIMI, DRAFTER_REF: drafter}
    tree = spec("moonshotai/Kimi-K2.6", "z-lab/Kimi-K2.6-DFlash", tensor=8)
    (problem,) = check_configs(tree, configs).problems
    assert problem.startswith("spec.drafter z-lab/Kimi-K2.6-DFlash: method 'ddtree' cannot run a DFlash2DraftModel")
    assert problem.endswith("(use method dflash)")
    chain = spec("moonshotai/Kimi-K2.6", "z-lab/Kimi-K2.6-DFlash", tensor=8, speculation={"method": "dflash"})
    assert check_configs(chain, configs) == Compatibility()


def test_a_tensor_split_that_does_not_divide_heads_or_experts_is_refused():
    assert check_configs(spec(SMOLLM2, tensor=2), {}).problems == (
        "tensor parallel 2 does not divide the model: 9 attention heads, 3 KV heads (each must be a multiple of 2)",
    )
    qwen = spec("Qwen/Qwen3-30B-A3B", tensor=3)
    assert check_configs(qwen, {QWEN_REF: QWEN_MOE}).problems == (
        "tensor parallel 3 does not divide the model: 32 attention heads, 4 KV heads, 128 experts, 151936 "
        "vocabulary (each must be a multiple of 3)",
    )
    # Experts whole per rank (the default) or each expert's width split (expert 1): each has its own size.
    odd = {**QWEN_MOE, "num_experts": 130, "moe_intermediate_size": 770}
    assert check_configs(spec("Qwen/Qwen3-30B-A3B", tensor=4), {QWEN_REF: odd}).problems == (
        "tensor parallel 4 does not divide the model: 130 experts (each must be a multiple of 4)",
    )
    by_width = spec("Qwen/Qwen3-30B-A3B", tensor=4, parallelism={"tensor": 4, "expert": 1})
    assert check_configs(by_width, {QWEN_REF: odd}).problems == (
        "tensor parallel 4 does not divide the model: 770 expert width (each must be a multiple of 4)",
    )


def test_an_unsupported_model_type_is_refused_as_the_engine_refuses_it():
    gpt2 = {ConfigRef("openai-community/gpt2", "main"): {"model_type": "gpt2"}}
    (problem,) = check_configs(spec("openai-community/gpt2"), gpt2).problems
    assert problem.startswith("spec.model openai-community/gpt2: unsupported model_type 'gpt2' (supported: ")


def test_configs_that_cannot_be_had_leave_their_checks_undone_and_admit():
    s = spec("moonshotai/Kimi-K2.6", "pvc://models/drafter", tensor=8)
    compatibility = check_configs(s, {KIMI_REF: "HTTP 503 from the hub"})
    assert compatibility.problems == () and not compatibility.blocks
    assert compatibility.unchecked == (
        "the config of spec.model moonshotai/Kimi-K2.6: HTTP 503 from the hub",
        "the config of spec.drafter pvc://models/drafter: pvc://models/drafter is not on the hub (a volume or a "
        "path in the image)",
    )
    message = "not checked: " + "; ".join(compatibility.unchecked)
    assert compatibility.condition() == ("Unknown", "ConfigUnavailable", message)
    # the target's own checks still run when only the drafter's config is missing
    assert check_configs(spec(SMOLLM2, "pvc://models/drafter", tensor=2), {}).blocks


def test_a_config_the_checks_cannot_read_is_unchecked_not_refused():
    broken = {k: v for k, v in QWEN_MOE.items() if k != "num_attention_heads"}
    compatibility = check_configs(spec("Qwen/Qwen3-30B-A3B"), {QWEN_REF: broken})
    assert not compatibility.blocks
    assert compatibility.unchecked == (
        "the split of spec.model Qwen/Qwen3-30B-A3B: its config cannot be read: config lacks 'num_attention_heads'",
    )


def test_the_refusal_is_one_message_with_the_memory_plan_said_once():
    kimi = spec(
        "moonshotai/Kimi-K2.6",
        f"{SMOLLM2}-dflash",
        tensor=1,
        resources={"gpus": 1, "gpuMemory": "141Gi"},
    )
    checks = run_checks(kimi, {KIMI_REF: KIMI})
    assert checks.memory.blocks and checks.compatibility.blocks
    assert checks.refusal() == (
        f"{checks.compatibility.problems[0]}; the model does not fit its GPUs: {checks.memory.message}"
    )
    # a split the plan also refuses is said once
    smol = spec(SMOLLM2, tensor=2, resources={"gpus": 2, "gpuMemory": "80Gi"})
    split = "tensor parallel 2 does not divide the model: 9 attention heads, 3 KV heads (each must be a multiple of 2)"
    both = SpecChecks(Compatibility((split,)), MemoryCheck("DoesNotFit", split))
    assert both.refusal() == split and run_checks(smol, {}).refusal() == split
    assert run_checks(spec(SMOLLM2, f"{SMOLLM2}-dflash"), {}).refusal() is None


def test_the_fit_checks_configs_are_fetched_once():
    s = spec("moonshotai/Kimi-K2.6", "z-lab/Kimi-K2.6-DFlash", tensor=8, resources={"gpus": 8, "gpuMemory": "141Gi"})
    assert config_refs(s) == [KIMI_REF, DRAFTER_REF]


def test_the_built_in_configs_are_the_packaged_ones():
    assert builtin_config(SMOLLM2)["num_hidden_layers"] == 30
    assert builtin_config(f"{SMOLLM2}-dflash")["dflash_config"]["target_layer_ids"] == [1, 14, 27]
    assert builtin_config("Qwen/Qwen3-8B") is None


def test_an_incompatible_spec_is_failed_with_a_compatible_condition():
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    s = spec(SMOLLM2, tensor=2)
    compatibility = check_configs(s, {})
    status = compute_status(
        name="smol",
        generation=3,
        spec=s,
        deployment=None,
        pods=[],
        samples={},
        window=None,
        previous={},
        now=now,
        compatibility=compatibility,
    )
    conditions = {c["type"]: c for c in status["conditions"]}
    assert status["phase"] == "Failed"
    assert conditions["Compatible"]["status"] == "False" and conditions["Compatible"]["reason"] == "Incompatible"
    assert conditions["Compatible"]["message"] == compatibility.message
    assert (conditions["Ready"]["reason"], conditions["Progressing"]["status"]) == ("Incompatible", "False")
    good = compute_status(
        name="smol",
        generation=3,
        spec=spec(SMOLLM2),
        deployment=None,
        pods=[],
        samples={},
        window=None,
        previous=status,
        now=now,
        compatibility=Compatibility(),
    )
    compatible = next(c for c in good["conditions"] if c["type"] == "Compatible")
    assert compatible["status"] == "True" and good["phase"] == "Pending"
