# Session 8: torch.profiler over 10 CUDA-graph replays of one 33-token (and 17-token) verify forward of the 8B
# shape (batch 1, ctx 1024, Triton kernels) per set of projections on skinny_linear: kernel times in situ.
# It ran on the session's working tree, where SKINNY_CONFIGS could route down; later commits ignore "down".
import torch
from ddtree import kernels as K
from ddtree.loading import random_model
from graph_timing import captured_forward, profiled_replays

t = random_model("qwen3-8b", "cuda", torch.bfloat16)
t.fuse(kernels=True)
ctx = 1024
o2, gu, d2, d4 = (64, 128, 2, 4, 5), (32, 64, 1, 4, 4), (64, 128, 2, 4, 5), (64, 128, 4, 4, 3)
tables = {"off": {}, "o2 gu": {"o": o2, "gate_up": gu}, "o2 gu d2": {"o": o2, "gate_up": gu, "down": d2},
          "o2 gu d4": {"o": o2, "gate_up": gu, "down": d4}}
for tokens in (33, 17):
    for name, table in tables.items():
        K.SKINNY_CONFIGS = table
        prof = profiled_replays(captured_forward(t, ctx, tokens), 10)
        total = sum(e.self_device_time_total for e in prof.key_averages()) / 10 / 1000
        print(f"=== T={tokens} {name}: kernel time per forward {total:.3f} ms ===")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
