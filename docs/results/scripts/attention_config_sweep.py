# Session 5: kernels.attention configurations for verify / drafter widths (8B shape: 32 heads, 8 KV heads,
# head dim 128, 1024 cached tokens), 36 layers' caches per CUDA graph; us per call. Plus M=33 GEMMs cuBLAS vs cuBLASLt.
import functools, itertools, json, sys, torch, torch.nn.functional as F
from graph_timing import timed
from attention_timing import attention_case
torch.manual_seed(0)
dev = "cuda"
res = {}
grid = [dict(chunk=c, max_rows=mr, block_n=bn, num_warps=w, num_stages=st)
        for c, mr, bn, w, st in itertools.product((64, 128, 256), (64, 128), (32, 64), (4, 8), (2, 3))]
default = dict(chunk=128, max_rows=64, block_n=64, num_warps=4, num_stages=2)
def case(bs, T, configs):
    row, ok = attention_case(bs, T, configs, sdpa=True)
    print(f"bs={bs} T={T}: sdpa {row['sdpa']:.2f}  default {row.get(json.dumps(default))}  best {ok[:4]}", flush=True)
    res[f"bs{bs} T{T}"] = row
    return [json.loads(k) for _, k in ok[:6]]
best = case(1, 33, grid)
short = best + [default]
for bs, T in ((1, 17), (1, 65), (16, 9), (16, 17), (4, 33), (1, 129)):
    case(bs, T, short)
# M=33 GEMMs
for name, (n, k) in {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}.items():
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(max(2, int(6 * 60e6 // (n * k * 2)) + 1))]
    x = torch.randn(33, k, device=dev, dtype=torch.bfloat16)
    a = timed([functools.partial(F.linear, x, w) for w in ws])
    torch.backends.cuda.preferred_blas_library("cublaslt")
    b = timed([functools.partial(F.linear, x, w) for w in ws])
    torch.backends.cuda.preferred_blas_library("cublas")
    print(f"M=33 {name}: cublas {a:.2f} us, cublaslt {b:.2f} us, bound {n*k*2/4.25e12*1e6:.2f}", flush=True)
    res[f"gemm33 {name}"] = [a, b]
    del ws
json.dump(res, open(sys.argv[1], "w"), indent=1)
