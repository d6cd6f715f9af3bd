# Session 6 sweep (Qwen3-8B shape, bf16, H200): kernels.skinny_linear tiles against cuBLAS / cuBLASLt for
# the q/k/v, o and down (+ silu_mul) projections at 2-64 rows, then whole forwards with the fastest tiles
# (skinny on / off, cuBLAS / cuBLASLt preferred for the GEMMs that stay on cuBLAS). Usage: OUT.json
import itertools, json, sys, torch, torch.nn.functional as F
from ddtree import kernels as K
from graph_timing import timed
from ddtree.bench import copy_bandwidth, forward_ms, weight_bytes
from ddtree.loading import random_model
torch.manual_seed(0)
dev = "cuda"
res = {}
bw = copy_bandwidth(dev); res["copy_GBps"] = bw / 1e9
print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)
shapes = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "down": (4096, 12288, True)}
configs = [(bn, bk, w, st) for bn, bk, (w, st) in itertools.product((16, 32, 64), (128, 256), ((4, 3), (4, 5), (8, 4)))]


def blas(name, fn):
    torch.backends.cuda.preferred_blas_library(name)
    try:
        return fn()
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")


res["linear"], best_cfg = {}, {}
for name, (n, k, silu) in shapes.items():
    copies = max(2, int(6 * 60e6 // (n * k * 2)) + 1)  # weights rotate over more than 6 x L2
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    bound = n * k * 2 / bw * 1e6
    for m in (33, 2, 9, 17, 64):
        x = torch.randn(m, 2 * k if silu else k, device=dev, dtype=torch.bfloat16)
        xin = (F.silu(x[:, :k].float()) * x[:, k:].float()).bfloat16() if silu else x
        ref = F.linear(xin.float(), ws[0].float())
        cub = [(lambda w=w: F.linear(K.silu_mul(x) if silu else x, w)) for w in ws]
        row = {"bound_us": bound, "cublas": timed(cub), "cublaslt": blas("cublaslt", lambda: timed(cub))}
        tried = configs if m == 33 else [c for _, c in sorted(res["linear"][f"{name} M=33"]["ranked"])[:4]]
        ranked = []
        for cfg in tried:
            try:
                y = K.skinny_linear(x, ws[0], silu_mul=silu, config=cfg)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                us = timed([(lambda w=w: K.skinny_linear(x, w, silu_mul=silu, config=cfg)) for w in ws])
                ranked.append((round(us, 2), cfg))
                row[str(cfg)] = [round(us, 2), err]
            except Exception as exc:
                row[str(cfg)] = repr(exc)[:150]
        row["ranked"] = sorted(ranked)
        res["linear"][f"{name} M={m}"] = row
        top = row["ranked"][0]
        print(f"{name:5s} M={m:2d} bound {bound:6.2f} us  cublas {row['cublas']:6.2f}  lt {row['cublaslt']:6.2f}  "
              f"skinny {top[0]:6.2f} {top[1]}  next {row['ranked'][1:3]}", flush=True)
    best_cfg[name] = res["linear"][f"{name} M=33"]["ranked"][0][1]
    del ws
res["best"] = best_cfg
print("fastest at 33 rows:", best_cfg, flush=True)

# whole forwards: 1 / 17 / 33 / 65 tokens at batch 1 and one token at batch 16 / 64, ctx 1024, graphs
K.SKINNY_CONFIGS.update(best_cfg)
t = random_model("qwen3-8b", dev, torch.bfloat16)
t.fuse(kernels=True)
res["hbm_bound_ms"] = weight_bytes(t) / bw * 1000
max_rows = K.SKINNY_MAX_ROWS
res["forward"] = {}
for rep in range(2):
    for skinny, lib in ((True, "cublas"), (False, "cublas"), (True, "cublaslt"), (False, "cublaslt")):
        K.SKINNY_MAX_ROWS = max_rows if skinny else 1
        ms = blas(lib, lambda: {f"b{bs} T{T}": round(forward_ms(t, bs, 1024, T, graphs=True, reps=50), 3)
                                for bs, T in ((1, 1), (1, 17), (1, 33), (1, 65), (16, 1), (64, 1))})
        key = f"skinny {'on' if skinny else 'off'}, {lib}"
        res["forward"].setdefault(key, []).append(ms)
        print(f"{key}: {ms}  verify33/decode {ms['b1 T33'] / ms['b1 T1']:.3f}", flush=True)
K.SKINNY_MAX_ROWS = max_rows
json.dump(res, open(sys.argv[1], "w"), indent=1, default=str)
