# Session 6: budget 0 in a budget-per-batch-size policy on the 8B shape (random bf16 weights, random 5-layer
# drafter): the smoke test (graphs vs eager) with it, then graph rounds at batch 64 / 16 / 1 against ar.
import gc, json, time, torch
from dataclasses import asdict
from ddtree.engine import Engine, SamplingParams
from ddtree.loading import random_drafter, random_model
from ddtree.smoke import run_smoke
t = random_model("qwen3-8b", "cuda", torch.bfloat16)
t.fuse(kernels=True)
d = random_drafter(t, 5)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, t.config.vocab_size, (1024,), generator=g).tolist() for _ in range(4)]
policy = {1: 32, 16: 8, 64: 0}


def time_rounds(eng, batch, rounds=8):
    for i in range(eng.max_batch_size):
        eng.release(i)
    for i in range(batch):
        eng.add(i, prompts[i % 4], SamplingParams(max_new_tokens=100))
    for _ in range(2):
        eng.step(batch)
    torch.cuda.synchronize()
    start, emitted = time.perf_counter(), 0
    for _ in range(rounds):
        emitted += sum(len(x) for x in eng.step(batch))
    s = time.perf_counter() - start
    return {"batch": batch, "ms_per_round": round(s / rounds * 1000, 3), "tokens_per_second": round(emitted / s, 1),
            "acceptance_length": round(emitted / rounds / batch, 3), "eager_rounds": eng.eager_rounds}


for name, drafter, method, budget in (("ddtree " + str(policy), d, "ddtree", policy), ("ar", None, "ar", None)):
    eng = Engine(t, drafter, method, budget, max_batch_size=64, max_seq_len=1024 + 160)
    print(name, "capture_seconds", round(eng.capture_graphs([1, 16, 64]), 2), "graphs", len(eng.graphs.graphs), flush=True)
    if method == "ddtree":
        print(json.dumps(asdict(run_smoke(eng, [1, 16, 64]))), flush=True)
    for batch in (64, 16, 1):
        print(name, json.dumps(time_rounds(eng, batch)), flush=True)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
