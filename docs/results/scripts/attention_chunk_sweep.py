# Session 7, after the token-major rows and the mask extent: kernels.attention key chunks per shape (8B
# shape, 1024 cached tokens, 36 layers' caches per CUDA graph, us per call; attention_timing.py).
# Usage: OUT.json
import json, sys, torch
from attention_timing import attention_case

torch.manual_seed(0)
res = {}
for bs, T in ((1, 33), (1, 17), (1, 65), (1, 16), (1, 9), (4, 33), (16, 9), (16, 17), (1, 1), (16, 1)):
    row, ranked = attention_case(bs, T, [{}] + [dict(chunk=c) for c in (32, 64, 128, 256)])
    res[f"bs{bs} T{T}"] = row
    print(f"bs={bs} T={T}: default {row['{}']}  ranked {ranked}", flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
