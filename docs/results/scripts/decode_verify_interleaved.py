# Session 7: the plain decode step and the 33-token verify forward (8B shape, batch 1, ctx 1024, --kernels
# triton, one CUDA graph each over one cache) timed alternately, 50 replays per sample, 20 samples each,
# after `bench --micro` had measured decode first in its process and found it faster than later samples.
# Prints every sample pair; the SM clock, temperature and power are logged by nvidia-smi next to it.
import statistics, time, torch
from ddtree.loading import random_model

t = random_model("qwen3-8b", "cuda", torch.bfloat16)
t.fuse(kernels=True)
ctx = 1024
t.setup_caches(1, ctx + 65)
graphs, inputs = {}, {}  # the graphs read their inputs' memory at replay: keep them alive
with torch.inference_mode():
    for T in (1, 33):
        span = ctx + T
        ids = torch.randint(0, t.config.vocab_size, (1, T), device="cuda")
        pos = (ctx + torch.arange(T, device="cuda"))[None].contiguous()
        j = torch.arange(span, device="cuda")
        mask = (j[None, :] <= pos[0, :, None]).view(1, 1, T, span).contiguous()
        inputs[T] = ids, pos, mask
        for _ in range(3):
            t(ids, pos, pos, mask)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            t(ids, pos, pos, mask)
        graphs[T] = g


def sample(T, reps=50):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        graphs[T].replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1000


ms = {1: [], 33: []}
for i in range(20):
    for T in ((1, 33) if i % 2 == 0 else (33, 1)):
        ms[T].append(sample(T))
    print(f"{time.strftime('%H:%M:%S')} sample {i}: decode {ms[1][-1]:.3f} ms, verify33 {ms[33][-1]:.3f} ms, "
          f"ratio {ms[33][-1] / ms[1][-1]:.3f}", flush=True)
med = {T: statistics.median(v) for T, v in ms.items()}
print(f"median decode {med[1]:.3f} ms, verify33 {med[33]:.3f} ms, ratio of medians {med[33] / med[1]:.3f}; "
      f"min decode {min(ms[1]):.3f}, min verify33 {min(ms[33]):.3f}, ratio of minima {min(ms[33]) / min(ms[1]):.3f}")
