# Session 8: where a 33-token verify forward of the 8B shape (batch 1, ctx 1024, graphs) spends its wall time
# per set of projections on skinny_linear: kernel durations and the idle gap before each kernel, from a
# torch.profiler trace of 5 graph replays, summed per (previous kernel -> kernel) pair; then forward_ms for
# down configurations with less shared memory.
# It ran on the session's working tree, where SKINNY_CONFIGS could route down; later commits ignore "down".
import json, os, tempfile, torch
from collections import defaultdict
from ddtree import kernels as K
from ddtree.bench import forward_ms
from ddtree.loading import random_model
from graph_timing import captured_forward, profiled_replays

t = random_model("qwen3-8b", "cuda", torch.bfloat16)
t.fuse(kernels=True)
ctx, tokens = 1024, 33
o2, gu = (64, 128, 2, 4, 5), (32, 64, 1, 4, 4)
tables = {"off": {}, "o2 gu": {"o": o2, "gate_up": gu}, "o2 gu d4": {"o": o2, "gate_up": gu, "down": (64, 128, 4, 4, 3)}}


def short(name):
    for key in ("skinny", "attention_partial", "attention_combine", "add_rms_norm", "qk_norm", "silu_mul",
                "splitKreduce", "mask_extent"):
        if key in name:
            return key
    return name[:40]


for name, table in tables.items():
    K.SKINNY_CONFIGS = table
    prof = profiled_replays(captured_forward(t, ctx, tokens), 5)
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    ev = sorted((e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    busy, gaps, count = defaultdict(float), defaultdict(float), defaultdict(int)
    for prev, e in zip(ev, ev[1:]):
        gap = e["ts"] - (prev["ts"] + prev["dur"])
        if gap < 50:  # not the host gap between replays
            gaps[(short(prev["name"]), short(e["name"]))] += gap / 5
            count[(short(prev["name"]), short(e["name"]))] += 1
    for e in ev:
        busy[short(e["name"])] += e["dur"] / 5
    span = (ev[-1]["ts"] + ev[-1]["dur"] - ev[0]["ts"]) / 5
    print(f"=== {name}: {span:.0f} us per replay (incl. host gaps), kernels {sum(busy.values()):.0f} us, "
          f"gaps {sum(gaps.values()):.0f} us", flush=True)
    for k, v in sorted(busy.items(), key=lambda kv: -kv[1])[:8]:
        print(f"   busy {k:45s} {v:8.1f} us")
    for k, v in sorted(gaps.items(), key=lambda kv: -abs(kv[1]))[:10]:
        print(f"   gap  {k[0]:>22s} -> {k[1]:22s} {v:8.1f} us over {count[k] // 5} per forward")

for down in [None, (64, 128, 4, 4, 3), (64, 128, 4, 4, 2), (64, 64, 4, 4, 3), (32, 128, 4, 4, 3), (64, 128, 6, 4, 3),
             (128, 64, 4, 4, 3)]:
    K.SKINNY_CONFIGS = {"o": o2, "gate_up": gu, **({"down": down} if down else {})}
    ms = [round(forward_ms(t, 1, 1024, T, graphs=True, reps=50), 3) for T in (1, 17, 33, 64)]
    print(f"down {down}: ms at 1/17/33/64 tokens {ms}", flush=True)
