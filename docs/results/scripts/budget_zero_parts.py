# Session 6: where the budget-0 round's time goes at batch 64 (8B shape): the policy engine as is, without
# the drafter context append, and ar; graph rounds, same prompts as budget_zero_rounds.py
import gc, time, torch
from ddtree.engine import Engine, SamplingParams
from ddtree.loading import random_drafter, random_model
t = random_model("qwen3-8b", "cuda", torch.bfloat16)
t.fuse(kernels=True)
d = random_drafter(t, 5)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, t.config.vocab_size, (1024,), generator=g).tolist() for _ in range(4)]


def time_rounds(eng, batch, rounds=16):
    for i in range(batch):
        eng.add(i, prompts[i % 4], SamplingParams(max_new_tokens=100))
    for _ in range(2):
        eng.step(batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(rounds):
        eng.step(batch)
    return round((time.perf_counter() - start) / rounds * 1000, 3)


real_append = d.append_context
for rep in range(2):
    for name in ("policy", "policy, no drafter append", "ar"):
        d.append_context = (lambda *a, **k: None) if "no drafter" in name else real_append
        eng = Engine(t, None if name == "ar" else d, "ar" if name == "ar" else "ddtree", None if name == "ar" else {1: 32, 64: 0},
                     max_batch_size=64, max_seq_len=1024 + 160)
        eng.capture_graphs([1, 64], [eng.max_slots])
        print(name, "ms per round at batch 64:", time_rounds(eng, 64), flush=True)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
