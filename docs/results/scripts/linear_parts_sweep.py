# Session 7: the projections of the 8B shape at 9-64 rows as one cuBLAS GEMM (F.linear; cuBLAS may split K
# itself and add a reduction kernel) against kernels.linear_parts with 2-4 partial products (one batched
# GEMM, fp32 out, summed later by the next kernel), weights rotating over 6 x L2, us per call; then whole
# forwards (batch 1 at 1/17/33/65 tokens, batch 16 and 64 at one token, ctx 1024, graphs) per LINEAR_PARTS
# table. Usage: OUT.json
# It ran on the session's working tree, where kernels.LINEAR_PARTS (projection -> parts, for 2..LINEAR_PARTS_MAX_ROWS
# = 64 rows) could split q/k/v (qk_norm_rope_kv summed the parts) and down as well as o. Only o was kept
# (kernels.O_PARTS, up to 48 rows), so on later commits the tables other than o's no longer apply.
import json, sys, torch, torch.nn.functional as F
from graph_timing import timed
from ddtree import kernels as K
from ddtree.bench import copy_bandwidth, forward_ms, weight_bytes
from ddtree.loading import random_model

torch.manual_seed(0)
dev = "cuda"
bw = copy_bandwidth(dev)
res = {"copy_GBps": bw / 1e9, "linear": {}}
best = {}
for name, (n, k) in {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 12288), "gate_up": (24576, 4096)}.items():
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(max(2, int(6 * 60e6 // (n * k * 2)) + 1))]
    for m in (33, 9, 16, 17, 64):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x.float(), ws[0].float())
        row = {"bound_us": round(n * k * 2 / bw * 1e6, 2), "cublas": round(timed([lambda w=w: F.linear(x, w) for w in ws]), 2)}
        for parts in (2, 3, 4):
            if k % parts == 0:
                err = ((K.linear_parts(x, ws[0], parts).sum(0) - ref).norm() / ref.norm()).item()
                row[f"parts{parts}"] = [round(timed([lambda w=w: K.linear_parts(x, w, parts) for w in ws]), 2), err]
        res["linear"][f"{name} M={m}"] = row
        print(f"{name:7s} M={m:2d} {row}", flush=True)
        if m == 33:
            options = {1: row["cublas"], **{int(key[5:]): v[0] for key, v in row.items() if key.startswith("parts")}}
            best[name] = min(options, key=options.get)
    del ws
print("fastest at 33 rows:", best, flush=True)

t = random_model("qwen3-8b", dev, torch.bfloat16)
t.fuse(kernels=True)
bound = weight_bytes(t) / bw * 1000
res["hbm_bound_ms"], res["forward"] = bound, {}
tables = {"none": {}, "shipped": dict(K.LINEAR_PARTS), "o2": {"o": 2}, "all2": {"qkv": 2, "o": 2, "down": 2},
          "best33": {p: v for p, v in best.items() if p != "gate_up"}}
for rep in range(2):
    for name, table in tables.items():
        K.LINEAR_PARTS = table
        ms = {f"b{bs} T{T}": round(forward_ms(t, bs, 1024, T, graphs=True, reps=50), 3)
              for bs, T in ((1, 1), (1, 17), (1, 33), (1, 65), (16, 1), (64, 1))}
        res["forward"].setdefault(name, []).append(ms)
        print(f"{name:8s} {table}: {ms}  decode/bound {ms['b1 T1'] / bound:.3f}  verify33/decode {ms['b1 T33'] / ms['b1 T1']:.3f}", flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
