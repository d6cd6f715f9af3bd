# torch.profiler over 10 CUDA-graph replays of one decode step and one 33-token verify forward
# (Qwen3-8B shape, random bf16, batch 1, ctx 1024, --kernels triton as the engine runs it).
import torch
from ddtree.loading import random_model
from graph_timing import captured_forward, profiled_replays
t = random_model("qwen3-8b", "cuda", torch.bfloat16)
t.fuse(kernels=True)
for tokens in (1, 33):
    prof = profiled_replays(captured_forward(t, 1024, tokens), 10)
    print(f"=== T={tokens}: 10 graph replays ===")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
