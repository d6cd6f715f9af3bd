# Session 5 sweep (Qwen3-8B shape, bf16, H200): (1) one-row GEMV configs vs cuBLAS / cuBLASLt per projection,
# (2) T=1 attention: SDPA vs kernels.attention chunks at batch 1/16/64, (3) whole decode forward variants.
# Part (3) ran against the session's intermediate code, whose module switches kernels.GEMV_ONE_ROW and
# kernels.ATTENTION_MIN_TOKENS (flipped below) were removed once the measurement chose the defaults.
import functools, json, sys, time, torch, torch.nn.functional as F
from ddtree import kernels as K
from graph_timing import timed
from ddtree.bench import copy_bandwidth, forward_ms, weight_bytes
from ddtree.loading import random_model
torch.manual_seed(0)
dev = "cuda"
res = {}
bw = copy_bandwidth(dev); res["copy_GBps"] = bw / 1e9
print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)


# ---- (1) GEMV
shapes = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (24576, 4096, False),
          "down": (4096, 12288, False), "down+silu": (4096, 12288, True), "lm_head": (151936, 4096, False)}
configs = [(bn, bk, w, st) for bn in (8, 16, 32) for bk in (256, 512, 1024) for w, st in ((4, 3), (8, 3))
           if bn * bk <= 16384]
res["gemv"] = {}
for name, (n, k, silu) in shapes.items():
    copies = max(2, int(6 * 60e6 // (n * k * 2)) + 1)
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, 2 * k if silu else k, device=dev, dtype=torch.bfloat16)
    xin = (F.silu(x[:, :k].float()) * x[:, k:].float()).bfloat16() if silu else x
    bound = n * k * 2 / bw * 1e6
    row = {"bound_us": bound}
    if silu:
        row["cublas+silu_mul"] = timed([(lambda w=w: F.linear(K.silu_mul(x), w)) for w in ws])
    else:
        row["cublas"] = timed([(lambda w=w: F.linear(x, w)) for w in ws])
        torch.backends.cuda.preferred_blas_library("cublaslt")
        row["cublaslt"] = timed([(lambda w=w: F.linear(x, w)) for w in ws])
        torch.backends.cuda.preferred_blas_library("cublas")
    ref = F.linear(xin.float(), ws[0].float())
    best = (1e9, None)
    for cfg in configs:
        try:
            y = K.gemv(x, ws[0], silu_mul=silu, config=cfg)
            err = ((y.float() - ref).norm() / ref.norm()).item()
            us = timed([(lambda w=w: K.gemv(x, w, silu_mul=silu, config=cfg)) for w in ws])
            row[str(cfg)] = [round(us, 2), err]
            best = min(best, (us, cfg))
        except Exception as exc:
            row[str(cfg)] = repr(exc)[:150]
    row["best"] = best
    res["gemv"][name] = row
    base = row.get("cublas", row.get("cublas+silu_mul"))
    print(f"{name:9s} bound {bound:7.2f} us  cublas {base:7.2f} ({base/bound:.2f}x)  lt {row.get('cublaslt', 0):7.2f}  "
          f"gemv best {best[0]:7.2f} ({best[0]/bound:.2f}x) {best[1]}", flush=True)
    del ws

# ---- (2) attention, one query token, 36 layers' caches
base_attention = K.attention
res["attention"] = {}
for bs in (1, 16, 64):
    ctx = 1024; span = ctx + 1
    store = torch.randn(36, 2, bs, 8, span + 1, 128, device=dev, dtype=torch.bfloat16)
    q = torch.randn(bs, 32, 1, 128, device=dev, dtype=torch.bfloat16)
    mask = torch.ones(bs, 1, 1, span, dtype=torch.bool, device=dev)
    row = {}
    def sdpa(l):
        k, v = store[l, 0, :bs, :, :span], store[l, 1, :bs, :, :span]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    row["sdpa"] = timed([functools.partial(sdpa, l) for l in range(36)])
    ref = sdpa(0).transpose(1, 2).reshape(bs, 1, -1).float()
    for chunk in (16, 32, 64, 128, 256):
        fns = [functools.partial(base_attention, q, store[l, 0], store[l, 1], mask, None, chunk=chunk) for l in range(36)]
        err = (fns[0]().float() - ref).abs().max().item()
        row[f"chunk{chunk}"] = [round(timed(fns), 2), err]
    res["attention"][bs] = row
    print(f"attention T=1 bs={bs}: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    del store

# ---- (3) decode forward variants (8B shape, ctx 1024, graphs)
t = random_model("qwen3-8b", dev, torch.bfloat16)
t.fuse(kernels=True)
hbm = weight_bytes(t) / bw * 1000
res["hbm_bound_ms"] = hbm
print(f"HBM bound {hbm:.3f} ms", flush=True)
variants = {"gemv off, sdpa": (False, 2, None), "gemv on, sdpa": (True, 2, None),
            "gemv on, attn chunk32": (True, 1, 32), "gemv on, attn chunk64": (True, 1, 64), "gemv on, attn chunk128": (True, 1, 128)}
res["decode"] = {}
for rep in range(2):
    for name, (gemv, amin, chunk) in variants.items():
        K.GEMV_ONE_ROW, K.ATTENTION_MIN_TOKENS = gemv, amin
        K.attention = functools.partial(base_attention, chunk=chunk) if chunk else base_attention
        ms = forward_ms(t, 1, 1024, 1, graphs=True, reps=100)
        res["decode"].setdefault(name, []).append(ms)
        print(f"decode {name}: {ms:.3f} ms ({ms/hbm:.3f}x)", flush=True)
for bs in (16, 64):
    for name, (amin, chunk) in {"sdpa": (2, None), "chunk64": (1, 64), "chunk128": (1, 128)}.items():
        K.ATTENTION_MIN_TOKENS = amin
        K.attention = functools.partial(base_attention, chunk=chunk) if chunk else base_attention
        ms = forward_ms(t, bs, 1024, 1, graphs=True, reps=50)
        res["decode"][f"bs{bs} {name}"] = ms
        print(f"decode bs={bs} {name}: {ms:.3f} ms", flush=True)
K.GEMV_ONE_ROW, K.ATTENTION_MIN_TOKENS, K.attention = True, 2, base_attention
for tokens in (17, 33):
    ms = forward_ms(t, 1, 1024, tokens, graphs=True, reps=50)
    res["decode"][f"T={tokens}"] = ms
    print(f"forward T={tokens}: {ms:.3f} ms", flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1, default=str)
