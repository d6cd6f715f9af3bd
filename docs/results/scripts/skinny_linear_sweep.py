# Session 8: kernels.skinny_linear (each program streams BLOCK_N weight rows through one tl.dot with all the
# rows; K splits leave fp32 partial products for add_rms_norm; gate_up writes silu(gate) * up) against the
# shipped path (cuBLAS F.linear; o as linear_parts(2); gate_up as F.linear + silu_mul) for the projections
# of the 8B shape, weights rotating over 6 x L2, us per call: every configuration at 33 rows, the best five at
# 17 and 64. Then whole forwards (batch 1 at 1/17/33/65 tokens, batch 4 x 16, ctx 1024, graphs) with the
# skinny path off, with the fastest configurations, and with each projection back on the shipped path.
# Usage: OUT.json [seconds for the configuration sweep]
# It ran on the session's working tree: its "shipped" o path (kernels.linear_parts) is the seventh session's
# (053bcbe, deleted since), and SKINNY_CONFIGS could also route q/k/v and down, which later commits ignore.
import itertools, json, sys, time, torch, torch.nn.functional as F
from graph_timing import timed
from ddtree import kernels as K
from ddtree.bench import copy_bandwidth, forward_ms, weight_bytes
from ddtree.loading import random_model

torch.manual_seed(0)
dev = "cuda"
budget = float(sys.argv[2]) if len(sys.argv) > 2 else 300
bw = copy_bandwidth(dev)
res = {"copy_GBps": bw / 1e9, "linear": {}}
shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (12288, 4096), "down": (4096, 12288)}
grid = {
    "qkv": itertools.product((16, 32, 64), (64, 128, 256), (1,), (4,), (3, 4, 6)),
    "o": itertools.product((32, 64, 128), (128, 256), (1, 2, 4), (4,), (3, 5)),
    "gate_up": itertools.product((16, 32, 64), (64, 128), (1,), (4, 8), (3, 4)),
    "down": itertools.product((32, 64, 128), (128, 256), (1, 2, 3, 4, 6), (4,), (3, 5)),
}


def shipped(name, x, w):
    if name == "o":
        return K.linear_parts(x, w, 2)
    if name == "gate_up":
        return K.silu_mul(F.linear(x, w))
    return F.linear(x, w)


def reference(name, x, w):
    y = F.linear(x.float(), w.float())
    if name == "gate_up":
        g, u = y.to(x.dtype).float().chunk(2, dim=-1)
        y = F.silu(g) * u
    return y


best = {}
start = time.time()
for name, (n, k) in shapes.items():
    rows_w = 2 * n if name == "gate_up" else n
    ws = [torch.randn(rows_w, k, device=dev, dtype=torch.bfloat16) * 0.02
          for _ in range(max(2, int(6 * 60e6 // (rows_w * k * 2)) + 1))]
    bound = rows_w * k * 2 / bw * 1e6
    configs = [(bn, bk, s, wp, st) for bn, bk, s, wp, st in grid[name]
               if n % bn == 0 and k % (bk * s) == 0 and not (name == "gate_up" and s > 1)]
    timings = {}
    for m in (33, 17, 64):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = reference(name, x, ws[0])
        row = {"bound_us": round(bound, 2), "shipped": round(timed([lambda w=w: shipped(name, x, w) for w in ws]), 2)}
        todo = configs if m == 33 else sorted(timings, key=timings.get)[:5]
        for cfg in todo:
            if m == 33 and time.time() - start > budget * (list(shapes).index(name) + 1) / len(shapes):
                row["cut"] = "time budget"
                break
            try:
                out = K.skinny_linear(x, ws[0], cfg, gate_up=name == "gate_up")
                out = out.sum(0) if cfg[2] > 1 else out
                err = ((out.float() - ref).norm() / ref.norm()).item()
                us = timed([lambda w=w: K.skinny_linear(x, w, cfg, gate_up=name == "gate_up") for w in ws])
            except Exception as e:  # e.g. out of shared memory
                row[str(cfg)] = repr(e)[:120]
                continue
            row[str(cfg)] = [round(us, 2), round(err, 5)]
            if m == 33:
                timings[cfg] = us
        res["linear"][f"{name} M={m}"] = row
        top = sorted(((v[0], c) for c, v in row.items() if c.startswith("(") and isinstance(v, list)))[:5]
        print(f"{name:7s} M={m:2d} bound {bound:.1f} shipped {row['shipped']} best {top} ({time.time() - start:.0f} s)",
              flush=True)
    best[name] = min(timings, key=timings.get)
    del ws
print("fastest at 33 rows:", best, flush=True)
res["best"] = {k: list(v) for k, v in best.items()}

t = random_model("qwen3-8b", dev, torch.bfloat16)
t.fuse(kernels=True)
bound = weight_bytes(t) / bw * 1000
res["hbm_bound_ms"], res["forward"] = bound, {}
shipped_configs = dict(K.SKINNY_CONFIGS)
tables = {"off": None, "best": best, "shipped_configs": shipped_configs}
for name in shapes:  # the best set with one projection on its old path (a config no shape fits)
    tables[f"best-{name}"] = {**best, name: (6144 * 4096, 64, 1, 4, 3)}
for rep in range(2):
    for label, table in tables.items():
        K.SKINNY_MAX_ROWS = 0 if table is None else 64
        K.SKINNY_CONFIGS = dict(table or shipped_configs)
        ms = {f"b{bs} T{T}": round(forward_ms(t, bs, 1024, T, graphs=True, reps=50), 3)
              for bs, T in ((1, 1), (1, 17), (1, 33), (1, 65), (4, 16))}
        res["forward"].setdefault(label, []).append(ms)
        print(f"{label:16s} {ms}  decode/bound {ms['b1 T1'] / bound:.3f}  verify33/decode {ms['b1 T33'] / ms['b1 T1']:.3f}",
              flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
