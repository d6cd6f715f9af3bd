# Session 8: the 8B shape (random bf16, whose LM head copies the embedding so that greedy choices have wide
# margins), Triton kernels and CUDA graphs at batch 1: dflash and ddtree (B=8/16/32/64: verify forwards of
# 9-65 rows, skinny_linear at 9-64) against ar (one-row GEMVs), token for token, on 4 random prompts. A weak
# check: the model repeats its last token by construction, so only a badly broken kernel changes the tokens.
import torch
from ddtree.cli import load_drafter_ref, load_target
from ddtree.engine import Engine, SamplingParams

target, _ = load_target("random:qwen3-8b", "cuda", torch.bfloat16, kernels="triton")
drafter = load_drafter_ref("random:5", target, "cuda", torch.bfloat16)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, target.config.vocab_size, (n,), generator=g).tolist() for n in (40, 73, 128, 200)]
sp = SamplingParams(max_new_tokens=64)


def run(method, budget):
    e = Engine(target, drafter if method != "ar" else None, method, budget, max_batch_size=1, max_seq_len=512)
    e.capture_graphs([1])
    out = [e.generate([p], sp)[0].token_ids for p in prompts]
    assert e.eager_rounds == 0, e.eager_rounds
    return out


ref = run("ar", None)
for method, budget in (("dflash", None), ("ddtree", 8), ("ddtree", 16), ("ddtree", 32), ("ddtree", 64)):
    got = run(method, budget)
    print(method, budget, "identical to ar:", [a == b for a, b in zip(got, ref)], flush=True)
