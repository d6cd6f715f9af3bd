"""Shared by the sweeps here: microseconds per call of `fns`, replayed as one CUDA graph (best of `reps`)."""
import torch


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
