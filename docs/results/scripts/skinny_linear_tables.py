# Session 8: q/k/v through skinny_linear with K splits (qk_norm_rope_kv sums the fp32 partial products)
# against cuBLAS, us per call (weights rotating over 6 x L2); then whole forwards of the 8B shape (ctx 1024,
# graphs) at batch 1 x 1..64 tokens and batch 4 x 16 for sets of projections on skinny_linear, twice.
# Usage: OUT.json
# It ran on the session's working tree, where SKINNY_CONFIGS could route q/k/v (qk_norm_rope_kv summed the K
# splits) and down; later commits serve o and gate/up only, so the tables with q/k/v or down no longer apply.
import itertools, json, sys, torch, torch.nn.functional as F
from graph_timing import timed
from ddtree import kernels as K
from ddtree.bench import copy_bandwidth, forward_ms, weight_bytes
from ddtree.loading import random_model

torch.manual_seed(0)
dev = "cuda"
bw = copy_bandwidth(dev)
res = {"copy_GBps": bw / 1e9, "qkv": {}}
n, k = 6144, 4096
ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(int(6 * 60e6 // (n * k * 2)) + 1)]
timings = {}
for m in (33, 17, 64):
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    ref = F.linear(x.float(), ws[0].float())
    row = {"bound_us": round(n * k * 2 / bw * 1e6, 2), "cublas": round(timed([lambda w=w: F.linear(x, w) for w in ws]), 2)}
    configs = (list(itertools.product((32, 64, 128), (64, 128), (2, 4), (4,), (3, 5))) if m == 33
               else sorted(timings, key=timings.get)[:4])
    for cfg in configs:
        try:
            out = K.skinny_linear(x, ws[0], cfg).sum(0)
            us = timed([lambda w=w: K.skinny_linear(x, w, cfg) for w in ws])
        except Exception as e:
            row[str(cfg)] = repr(e)[:120]
            continue
        row[str(cfg)] = [round(us, 2), round(((out - ref).norm() / ref.norm()).item(), 5)]
        if m == 33:
            timings[cfg] = us
    res["qkv"][f"M={m}"] = row
    top = sorted((v[0], c) for c, v in row.items() if c.startswith("(") and isinstance(v, list))[:4]
    print(f"qkv M={m} bound {row['bound_us']} cublas {row['cublas']} best {top}", flush=True)
best_qkv = min(timings, key=timings.get)
del ws

t = random_model("qwen3-8b", dev, torch.bfloat16)
t.fuse(kernels=True)
bound = weight_bytes(t) / bw * 1000
res["hbm_bound_ms"], res["forward"] = bound, {}
o2, o4, gu, d2 = (64, 128, 2, 4, 5), (64, 128, 4, 4, 3), (32, 64, 1, 4, 4), (64, 128, 2, 4, 5)
tables = {"off": {}, "o2 gu": {"o": o2, "gate_up": gu}, "o4 gu": {"o": o4, "gate_up": gu},
          "o2 gu d2": {"o": o2, "gate_up": gu, "down": d2}, "o2 gu q": {"o": o2, "gate_up": gu, "qkv": best_qkv},
          "o2 gu d2 q": {"o": o2, "gate_up": gu, "down": d2, "qkv": best_qkv}}
res["tables"] = {name: {p: list(c) for p, c in table.items()} for name, table in tables.items()}
shapes = [(1, 1), (1, 9), (1, 17), (1, 25), (1, 33), (1, 49), (1, 64), (4, 16)]
for rep in range(2):
    for name, table in tables.items():
        K.SKINNY_CONFIGS = table
        ms = {f"b{bs} T{T}": round(forward_ms(t, bs, 1024, T, graphs=True, reps=50), 3) for bs, T in shapes}
        res["forward"].setdefault(name, []).append(ms)
        print(f"{name:11s} {ms}  verify33/decode {ms['b1 T33'] / ms['b1 T1']:.3f}", flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
