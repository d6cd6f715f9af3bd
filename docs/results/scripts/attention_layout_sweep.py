# Session 7: kernels.attention row layouts and tile heights (8B shape, 1024 cached tokens, 36 layers' caches
# per CUDA graph, us per call): the head-major layout (a program's rows are one head's tokens) against
# token-major (a token's heads in consecutive rows, token_major=True), with 16/32/64-row tiles; then whole
# forwards (batch 1, 1/17/33/65 tokens) with the default and with the fastest configuration per shape, and
# a profile of the 33-token forward. Usage: OUT.json
# It ran on the session's working tree, where kernels.attention still took token_major= (False: the head-major
# layout, the default until then). The kept kernel has only token-major rows and no such argument, so on later
# commits every configuration here fails with a TypeError (recorded per configuration by attention_case).
import itertools, json, sys, torch
from attention_timing import attention_case
from graph_timing import captured_forward, profiled_replays
from ddtree import kernels as K
from ddtree.bench import copy_bandwidth, forward_ms, weight_bytes
from ddtree.loading import random_model

torch.manual_seed(0)
res = {"shapes": {}}
full = [dict(token_major=tm, max_rows=mr, chunk=c, block_n=bn, num_warps=w)
        for tm, mr, c, bn, w in itertools.product((False, True), (16, 32, 64), (64, 128, 256), (32, 64), (4, 8))]
small = [dict(token_major=tm, max_rows=mr, chunk=c, block_n=min(64, c), num_warps=w)
         for tm, mr, c, w in itertools.product((False, True), (16, 32, 64), (32, 64, 128, 256), (4, 8))]
best = {}
for bs, T in ((1, 33), (1, 1), (1, 9), (1, 16), (1, 17), (1, 65), (4, 33), (16, 1), (16, 9), (16, 17)):
    row, ranked = attention_case(bs, T, [{}] + (full if (bs, T) == (1, 33) else small))
    res["shapes"][f"bs{bs} T{T}"] = row
    best[(bs, T)] = json.loads(ranked[0][1])
    print(f"bs={bs} T={T}: default {row['{}']}  best {ranked[:5]}", flush=True)

# whole forwards with the fastest configuration per swept shape
attention = K.attention
def tuned(q, k, v, mask, rows, **kw):
    return attention(q, k, v, mask, rows, **{**best.get((q.shape[0], q.shape[2]), {}), **kw})

t = random_model("qwen3-8b", "cuda", torch.bfloat16)
t.fuse(kernels=True)
bound = weight_bytes(t) / copy_bandwidth("cuda") * 1000
res["hbm_bound_ms"], res["forward"] = bound, {}
for rep in range(2):
    for name, fn in (("default", attention), ("best", tuned)):
        K.attention = fn
        ms = {T: round(forward_ms(t, 1, 1024, T, graphs=True, reps=50), 3) for T in (1, 17, 33, 65)}
        res["forward"].setdefault(name, []).append(ms)
        print(f"{name}: {ms}  decode/bound {ms[1] / bound:.3f}  verify33/decode {ms[33] / ms[1]:.3f}", flush=True)

for name, fn in (("default", attention), ("best", tuned)):
    K.attention = fn
    prof = profiled_replays(captured_forward(t, 1024, 33), 10)
    print(f"=== {name}, T=33: 10 graph replays ===")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
res["best"] = {f"bs{b} T{T}": c for (b, T), c in best.items()}
json.dump(res, open(sys.argv[1], "w"), indent=1, default=str)
