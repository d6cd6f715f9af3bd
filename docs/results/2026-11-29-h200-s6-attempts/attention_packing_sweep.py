# Session 6: kernels.attention with all query heads of a KV head in one program (pack_heads, its row blocks
# one after the other) against one program per row block, over chunk / tile configurations, at verify and
# drafter widths (8B shape: 32 heads, 8 KV heads, head dim 128, 1024 cached tokens, 36 layers' caches per
# CUDA graph; us per call, partial + combine); then whole target forwards with the fastest. Usage: OUT.json
import itertools, json, sys, torch
from ddtree import kernels as K
from attention_timing import attention_case
from ddtree.bench import forward_ms
from ddtree.loading import random_model
torch.manual_seed(0)
dev = "cuda"
res = {}
tiles = ((64, 64, 4, 2), (64, 32, 4, 3), (64, 64, 8, 2), (128, 64, 8, 2), (32, 32, 4, 2), (32, 64, 4, 2))
grid = [dict(pack_heads=p, chunk=c, max_rows=mr, block_n=bn, num_warps=w, num_stages=st)
        for p, c, (mr, bn, w, st) in itertools.product((False, True), (64, 128, 256), tiles)]
default = dict(pack_heads=False)


def case(bs, T, configs):
    row, ok = attention_case(bs, T, configs + [default])
    print(f"bs={bs} T={T}: default {row[json.dumps(default)]}  best {ok[:5]}", flush=True)
    res[f"bs{bs} T{T}"] = row
    return [json.loads(k) for _, k in ok[:6]]


best = case(1, 33, grid)
for bs, T in ((1, 17), (1, 65), (1, 9), (4, 33), (16, 9), (16, 17), (1, 129)):
    case(bs, T, best)

t = random_model("qwen3-8b", dev, torch.bfloat16)
t.fuse(kernels=True)
base = K.attention
res["forward"] = {}
for rep in range(2):
    for name, cfg in (("default", {}), ("best at bs1 T33", {k: v for k, v in best[0].items()})):
        # the one-token steps keep the default: the sweep above covers verify and drafter widths only
        K.attention = lambda q, *a, _c=cfg, **kw: base(q, *a, **({} if q.shape[2] == 1 else _c), **kw)
        ms = {f"b{bs} T{T}": round(forward_ms(t, bs, 1024, T, graphs=True, reps=50), 3)
              for bs, T in ((1, 1), (1, 17), (1, 33), (1, 65), (4, 33), (16, 9))}
        res["forward"].setdefault(name, []).append(ms)
        print(f"forward {name} {cfg}: {ms}  verify33/decode {ms['b1 T33'] / ms['b1 T1']:.3f}", flush=True)
K.attention = base
json.dump(res, open(sys.argv[1], "w"), indent=1, default=str)
