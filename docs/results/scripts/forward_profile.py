# torch.profiler over 10 CUDA-graph replays of one decode step and one 33-token verify forward
# (Qwen3-8B shape, random bf16, batch 1, ctx 1024, --kernels triton as the engine runs it).
import torch
from torch.profiler import profile, ProfilerActivity
from ddtree.loading import random_model
t = random_model("qwen3-8b", "cuda", torch.bfloat16)
t.fuse(kernels=True)
ctx = 1024
for tokens in (1, 33):
    t.setup_caches(1, ctx + tokens)
    ids = torch.randint(0, t.config.vocab_size, (1, tokens), device="cuda")
    pos = (ctx + torch.arange(tokens, device="cuda")).expand(1, -1).contiguous()
    j = torch.arange(ctx + tokens, device="cuda")
    mask = (j[None, :] <= pos[0, :, None]).view(1, 1, tokens, ctx + tokens).contiguous()
    with torch.inference_mode():
        for _ in range(3): t(ids, pos, pos, mask)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g): t(ids, pos, pos, mask)
    for _ in range(5): g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10): g.replay()
        torch.cuda.synchronize()
    print(f"=== T={tokens}: 10 graph replays ===")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
