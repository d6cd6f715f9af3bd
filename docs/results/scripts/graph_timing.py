"""Shared by the sweeps here: microseconds per call of `fns` replayed as one CUDA graph (`timed`), and one
captured target forward to profile (`captured_forward`), and a profiler over its replays (`profiled_replays`)."""
import torch
from torch.profiler import profile, ProfilerActivity


def timed(fns, reps=5):
    for f in fns[:2]:  # warm-up outside the capture (cuBLAS handles, Triton compiles)
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    best = 1e9
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / len(fns))
    return best * 1000


def captured_forward(target, ctx: int, tokens: int) -> torch.cuda.CUDAGraph:
    """One forward of `tokens` new tokens after `ctx` cached ones at batch 1 (random ids, causal mask),
    captured as a CUDA graph after 3 eager warm-ups and replayed 5 times."""
    target.setup_caches(1, ctx + tokens)
    ids = torch.randint(0, target.config.vocab_size, (1, tokens), device="cuda")
    pos = (ctx + torch.arange(tokens, device="cuda"))[None].contiguous()
    j = torch.arange(ctx + tokens, device="cuda")
    mask = (j[None, :] <= pos[0, :, None]).view(1, 1, tokens, ctx + tokens).contiguous()
    with torch.inference_mode():
        for _ in range(3):
            target(ids, pos, pos, mask)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            target(ids, pos, pos, mask)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    return g


def profiled_replays(graph: torch.cuda.CUDAGraph, replays: int) -> profile:
    """torch.profiler (CUDA activity) over `replays` replays of `graph`, synchronised before it stops."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return prof
