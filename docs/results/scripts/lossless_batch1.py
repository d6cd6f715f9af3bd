# SmolLM2 fp32 at batch 1 (the one-row GEMVs and the one-token attention kernel), Triton + CUDA graphs:
# ar (kernels) vs ar at batch 8 (cuBLAS, batch-8 path) and ddtree B=32 vs ar, token for token, all 8 prompts.
import torch
from ddtree.cli import BENCH_PROMPTS, load_target, load_drafter_ref
from ddtree.engine import Engine, SamplingParams
target, tok = load_target("smollm2-135m-instruct", "cuda", torch.float32, kernels="triton")
drafter = load_drafter_ref("smollm2-135m-instruct-dflash", target, "cuda", torch.float32)
prompts = [tok.encode(t) if t.startswith(("def ", "class ", "import ")) else
           tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False)
           for t in BENCH_PROMPTS]
sp = SamplingParams(max_new_tokens=96)
def run(method, budget, batch):
    e = Engine(target, drafter if method != "ar" else None, method, budget, max_batch_size=batch, max_seq_len=512)
    e.capture_graphs([batch])
    res = [r for i in range(0, len(prompts), batch) for r in e.generate(prompts[i:i + batch], sp)]
    assert e.eager_rounds == 0, e.eager_rounds
    return res
ref8 = [r.token_ids for r in run("ar", None, 8)]
for method, budget in (("ar", None), ("ddtree", 32), ("dflash", None)):
    res = run(method, budget, 1)
    eq = [r.token_ids == e for r, e in zip(res, ref8)]
    print(f"fp32 graphs triton batch 1 {method} budget={budget}: equal to ar at batch 8 on {sum(eq)}/8 prompts {eq}", flush=True)
