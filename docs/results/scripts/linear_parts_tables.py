# Session 7: whole forwards (8B shape, ctx 1024, graphs; batch 1 at 1/17/33/65 tokens, batch 16 and 64 at
# one token) per kernels.LINEAR_PARTS table, and with the down projection on cuBLASLt instead (the
# preferred BLAS library switched around that one call). ms per forward, two rounds. Usage: OUT.json
# It ran on the session's working tree, where kernels.LINEAR_PARTS (projection -> parts, for 2..LINEAR_PARTS_MAX_ROWS
# = 64 rows) could split q/k/v (qk_norm_rope_kv summed the parts) and down as well as o. Only o was kept
# (kernels.O_PARTS, up to 48 rows), so on later commits the tables other than o's no longer apply.
import json, sys, torch, torch.nn.functional as F
from ddtree import kernels as K
from ddtree.bench import copy_bandwidth, forward_ms, weight_bytes
from ddtree.loading import random_model

t = random_model("qwen3-8b", "cuda", torch.bfloat16)
t.fuse(kernels=True)
bound = weight_bytes(t) / copy_bandwidth("cuda") * 1000


def down_on_cublaslt(on: bool) -> None:
    for layer in t.model.layers:
        proj = layer.mlp.down_proj
        if on:
            def lt(x, proj=proj):
                torch.backends.cuda.preferred_blas_library("cublaslt")
                try:
                    return F.linear(x, proj.weight)
                finally:
                    torch.backends.cuda.preferred_blas_library("cublas")
            proj.forward = lt
        else:
            proj.__dict__.pop("forward", None)


variants = {"o2 (shipped)": ({"o": 2}, False), "o2 down2": ({"o": 2, "down": 2}, False),
            "o2 qkv2": ({"o": 2, "qkv": 2}, False), "o4": ({"o": 4}, False), "o4 down2": ({"o": 4, "down": 2}, False),
            "o2 down4": ({"o": 2, "down": 4}, False), "o2, down on cuBLASLt": ({"o": 2}, True)}
res = {"hbm_bound_ms": bound, "forward": {}}
for rep in range(2):
    for name, (table, lt) in variants.items():
        K.LINEAR_PARTS = table
        down_on_cublaslt(lt)
        ms = {f"b{bs} T{T}": round(forward_ms(t, bs, 1024, T, graphs=True, reps=50), 3)
              for bs, T in ((1, 1), (1, 17), (1, 33), (1, 65), (16, 1), (64, 1))}
        res["forward"].setdefault(name, []).append(ms)
        print(f"{name:22s}: {ms}  verify33/decode {ms['b1 T33'] / ms['b1 T1']:.3f}", flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
