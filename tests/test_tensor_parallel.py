"""Tensor parallelism on CPU (gloo, separate processes): the split target emits exactly the tokens of
the unsplit one, and a split that does not divide the model is refused."""

import pytest
import torch

from ddtree.drafter import DrafterConfig, init_drafter
from ddtree.engine import Engine, SamplingParams
from ddtree.parallel import check_divisible, launch, shard
from tiny_models import random_target

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]]
METHODS = [("ar", None), ("dflash", None), ("ddtree", 8)]


def generate_all(target, drafter, prompts, new_tokens):
    out = {}
    for method, budget in METHODS:
        eng = Engine(target, drafter, method, budget, max_batch_size=len(prompts), max_seq_len=96)
        out[method] = [r.token_ids for r in eng.generate(prompts, SamplingParams(max_new_tokens=new_tokens))]
    return out


def tiny_rank(rank, world):
    torch.set_num_threads(1)
    target = random_target(vocab=64, hidden=64, layers=3, heads=4, kv_heads=2, seed=3)
    drafter = init_drafter(DrafterConfig.for_target(target.config, block_size=8), seed=1)
    shard(target, rank, world)
    return generate_all(target, drafter, PROMPTS, 16)


def test_tp2_equals_tp1_on_a_tiny_model():
    target = random_target(vocab=64, hidden=64, layers=3, heads=4, kv_heads=2, seed=3)
    drafter = init_drafter(DrafterConfig.for_target(target.config, block_size=8), seed=1)
    expected = generate_all(target, drafter, PROMPTS, 16)
    assert launch(2, tiny_rank) == expected


def smollm2_rank(rank, world, folder, prompts):
    from ddtree.model import Transformer

    torch.set_num_threads(1)
    target = Transformer.from_pretrained(folder, dtype=torch.float32)
    drafter = init_drafter(DrafterConfig.for_target(target.config), seed=0)
    shard(target, rank, world)
    return generate_all(target, drafter, prompts, 12)


@pytest.mark.slow
def test_tp3_equals_tp1_on_smollm2(smollm2):
    """SmolLM2 has 9 attention heads and 3 KV heads: 3 is the split that divides it (2 is refused)."""
    model, tok, folder = smollm2
    prompts = [tok.encode("The capital of France is"), tok.encode("def add(a, b):\n")]
    drafter = init_drafter(DrafterConfig.for_target(model.config), seed=0)
    expected = generate_all(model, drafter, prompts, 12)
    assert launch(3, smollm2_rank, str(folder), prompts) == expected


def test_a_split_that_does_not_divide_the_model_is_refused(smollm2):
    model = smollm2[0]
    with pytest.raises(ValueError, match=r"tensor parallel 2 does not divide the model: 9 attention heads, "
                                         r"3 KV heads \(each must be a multiple of 2\)"):
        check_divisible(model.config, 2)
    with pytest.raises(ValueError, match="5 attention heads"):
        shard(random_target(hidden=80, heads=5, kv_heads=5), 0, 2)
