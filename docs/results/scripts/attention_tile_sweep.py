# Session 7, after the token-major rows: kernels.attention tiles (chunk, keys per step, warps, rows per
# program) with and without the check that skips key blocks no row sees, 8B shape, 1024 cached tokens,
# 36 layers' caches per CUDA graph, us per call (docs/results/scripts/attention_timing.py). Usage: OUT.json
# It ran on the session's working tree, where kernels.attention took skip_unseen= (True: skip a key block when
# the mask tile shows no row sees it, the kernel until then). The kept kernel replaced that test with the
# mask extent (kernels.mask_extent) and has no such argument: on later commits those configurations fail.
import itertools, json, sys, torch
from attention_timing import attention_case

torch.manual_seed(0)
res = {}
full = [dict(chunk=c, block_n=bn, num_warps=w, max_rows=mr, skip_unseen=sk)
        for c, bn, w, mr, sk in itertools.product((64, 128, 256), (32, 64), (4, 8), (64, 128), (True, False))
        if not (mr == 128 and w == 4)]
small = [dict(chunk=c, skip_unseen=sk) for c, sk in itertools.product((64, 128, 256), (True, False))]
for bs, T in ((1, 33), (1, 17), (1, 65), (4, 33), (16, 9), (1, 16)):
    row, ranked = attention_case(bs, T, [{}] + (full if (bs, T) == (1, 33) else small))
    res[f"bs{bs} T{T}"] = row
    print(f"bs={bs} T={T}: default {row['{}']}  best {ranked[:6]}", flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
