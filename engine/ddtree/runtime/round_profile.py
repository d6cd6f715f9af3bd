"""Where a round's time goes under CUDA graphs, phase by phase, against what each phase must cost.

A graph replay is one launch, so host-side timing cannot split it. `profile_round` captures the round
once more with a marker kernel at each phase boundary (`Engine._mark`: start, draft, tree, verify, walk,
commit), replays it under the profiler, and splits the device trace at the markers: per phase the kernels
it launched, their time, and the gaps between them (launch latency inside the graph, dependencies). A
kernel's time runs from the end of the kernel before it, where it started earlier (programmatic
dependent launch), so kernel time plus gaps is the phase's span.

`phase_floors` gives each phase's lower bound from the bytes it must move and the FLOPs it must do, at
the device's measured copy bandwidth and matmul throughput: the draft reads the drafter's weights, the
target's LM head and the drafter's cache; the verify reads the target's weights and its cache (of a
mixture of experts' routed experts, as many as its tokens are expected to reach when the router picks
uniformly; each token multiplies with its k experts only); the tree reads the draft logits; the commit
moves the accepted path's cache entries and features. The floors count dense bf16 weights (a quantized
model's FLOPs are counted per stored element).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

from .graphs import median_replay_ms

MARKER = "spin_kernel"  # the kernel torch.cuda._sleep launches: nothing else in a round runs it


def mark_phase() -> None:
    """Launch the marker kernel on the current stream (a node of the graph being captured)."""
    torch.cuda._sleep(0)


def split_phases(events: list[tuple[str, float, float]], marks: list[str], replays: int) -> dict:
    """Per-phase statistics of `replays` replays of a marked round from device events (name, start, end;
    microseconds, any order): each phase is what ran between the marker that opens it and the one named
    after it (marks[i] closes phase i), averaged over the replays; times in ms."""
    events = sorted(events, key=lambda e: e[1])
    markers = [i for i, e in enumerate(events) if MARKER in e[0]]
    if len(markers) != replays * len(marks):
        raise RuntimeError(
            f"the trace has {len(markers)} phase markers for {replays} replays of {len(marks)} marks: the "
            f"profiler did not see the graph's kernels (found {len(events)} device events)"
        )
    phases: dict[str, dict] = {name: {"kernels": 0, "kernel_ms": 0.0, "wall_ms": 0.0} for name in marks[1:]}
    # per phase, each kernel name's total time and launches: the whole phase, so that two rounds' phases
    # can be compared kernel by kernel (bench.json), not only by their heaviest kernels
    by_kernel: dict[str, dict[str, list[float]]] = {name: defaultdict(lambda: [0.0, 0]) for name in marks[1:]}
    round_ms = 0.0
    for r in range(replays):
        at = markers[r * len(marks) : (r + 1) * len(marks)]
        round_ms += (events[at[-1]][1] - events[at[0]][2]) / 1000
        for j in range(1, len(marks)):
            name, inside = marks[j], events[at[j - 1] + 1 : at[j]]
            stats = phases[name]
            stats["kernels"] += len(inside)
            stats["wall_ms"] += (events[at[j]][1] - events[at[j - 1]][2]) / 1000
            # a kernel counts from the end of the one before it: launched early (kernels.pdl), its programs
            # wait for that one first, so the phase's kernel time is the span its kernels keep the GPU busy
            busy_until = events[at[j - 1]][2]
            for kernel, start, end in inside:
                ms = max(0.0, end - max(start, busy_until)) / 1000
                busy_until = max(busy_until, end)
                stats["kernel_ms"] += ms
                entry = by_kernel[name][kernel[:90]]
                entry[0] += ms
                entry[1] += 1
    out = {}
    for name, stats in phases.items():
        kernel_ms, wall_ms = stats["kernel_ms"] / replays, stats["wall_ms"] / replays
        heaviest = sorted(by_kernel[name].items(), key=lambda kv: -kv[1][0])
        out[name] = {
            "kernels": round(stats["kernels"] / replays, 1),
            "kernel_ms": round(kernel_ms, 4),
            "gap_ms": round(wall_ms - kernel_ms, 4),
            "wall_ms": round(wall_ms, 4),
            # every kernel name, heaviest first: [name (90 characters), ms, launches] per round
            "heaviest": [[kernel, round(ms / replays, 4), round(n / replays, 1)] for kernel, (ms, n) in heaviest],
        }
    return {"phases": out, "marked_round_ms": round(round_ms / replays, 4)}


class Rewind:
    """The rows' committed lengths and staged context counts as they are now, put back before each replay, so
    that any number of replays runs on the same texts and none writes past the caches."""

    def __init__(self, engine):
        self.engine = engine
        self.lengths, self.ctx_count = engine.lengths.clone(), engine.ctx_count.clone()

    def __call__(self) -> None:
        self.engine.lengths.copy_(self.lengths)
        self.engine.ctx_count.copy_(self.ctx_count)


@torch.inference_mode()
def profile_round(engine, n: int, span: int, replays: int = 10, sampling: bool = False) -> dict:
    """Capture `engine.round(n, span, sampling)` with phase markers, replay it `replays` times under the
    profiler (each on the rows as they are now) and split the trace (split_phases)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    rewind = Rewind(engine)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    engine.phase_markers = []
    try:
        with torch.cuda.stream(stream):
            engine.round(n, span, sampling)  # warm-up: allocator and kernel selection
            rewind()
        torch.cuda.current_stream().wait_stream(stream)
        engine.phase_markers = []
        graph = torch.cuda.CUDAGraph()
        if sampling:
            graph.register_generator_state(engine.generator)
        pool = engine.graphs.pool if engine.graphs is not None else None
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            engine.round(n, span, sampling)
        marks = engine.phase_markers
    finally:
        engine.phase_markers = None
    graph.replay()
    rewind()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            rewind()  # a copy outside the markers: no phase counts it
        torch.cuda.synchronize()
    events = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    out = split_phases(events, marks, replays)
    out["markers_per_round"] = len(marks)
    del graph
    return out


def cache_bytes_per_token(model: Any) -> float:
    """Bytes one cached token of one sequence takes in `model`'s caches (every layer, keys and values or
    latents), from the cache buffers themselves."""
    seen, total = set(), 0
    for module in model.modules():
        for name in ("k", "v", "latent"):
            t = getattr(module, name, None)
            if isinstance(t, torch.Tensor) and name in module._non_persistent_buffers_set and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total / (model.max_batch * (model.max_slots + 1))


def stored_weights(model: torch.nn.Module, skip: frozenset[int] = frozenset()) -> tuple[int, int]:
    """(bytes, matrix elements) of a model's stored weights: parameters and persistent buffers (quantized
    weights and their scales are buffers; caches are not persistent), each storage once, less the storages
    in `skip`."""
    seen, nbytes, elements = set(skip), 0, 0
    for t in model.state_dict().values():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        nbytes += t.numel() * t.element_size()
        if t.dim() >= 2:
            elements += t.numel()
    return nbytes, elements


def unreached_experts(model: torch.nn.Module, tokens: int) -> tuple[float, float]:
    """(bytes, matrix elements) of `stored_weights` that a forward of `tokens` tokens leaves alone in its
    mixture-of-experts blocks: of E routed experts, with k per token, a router that picks uniformly
    reaches E * (1 - (1 - k/E)^tokens) of them on average (the others' bytes are not read), and each
    token multiplies with k of them (the other elements cost it no FLOPs)."""
    from ..models.moe import SparseMoE

    unread_bytes = idle_elements = 0.0
    for block in model.modules():
        if isinstance(block, SparseMoE):
            left = 1 - min(block.gate.top_k, len(block.experts)) / len(block.experts)  # of a token's experts
            nbytes, elements = stored_weights(block.experts)
            unread_bytes += nbytes * left**tokens
            idle_elements += elements * left
    return unread_bytes, idle_elements


def matmul_throughput(device, size: int = 8192, dtype=torch.bfloat16) -> float:
    """Measured dense matmul FLOP/s of a size^3 GEMM in `dtype`."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * size**3 * reps / (time.perf_counter() - start)


def phase_floors(engine, n: int, context: float, bandwidth: float, flops: float) -> dict:
    """The lower bound of each phase of a round on n rows whose texts hold `context` tokens on average:
    max(bytes / bandwidth, FLOPs / flops) (bytes/s and FLOP/s measured on the device), with both counts."""
    target, drafter, plan = engine.target, engine.drafter, engine.plan(n)
    cfg = target.config
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    elem = head.element_size()
    vocab, hidden, depth = cfg.vocab_size, cfg.hidden_size, engine.max_depth
    # the verify gathers embedding rows, it does not read the table (unless it is the LM head too)
    tied = embed.data_ptr() == head.data_ptr()
    stored_bytes, stored_elems = stored_weights(target, frozenset() if tied else frozenset({embed.data_ptr()}))
    head_width = getattr(cfg, "head_dim", None) or cfg.latent_dim  # MLA: each head reads the latents
    attention_width = cfg.num_attention_heads * head_width * cfg.num_hidden_layers
    tree, kv = plan.tree_size, cache_bytes_per_token(target)
    unread, idle = unreached_experts(target, n * tree)
    target_bytes, target_elems = stored_bytes - unread, stored_elems - idle
    logits = n * tree * vocab * 4  # fp32 verify logits, written by the LM head and read by the decision
    counts = {
        "verify": (
            target_bytes + n * (context + tree) * kv + 2 * logits,
            2 * n * tree * target_elems + 4 * n * tree * (context + tree) * attention_width,
        ),
        "walk": (n * tree * 8 * 4, 0),
        "commit": (
            2 * n * (depth + 1) * kv
            + 2 * n * (depth + 1) * engine.ctx_features.shape[-1] * elem
            + (2 * n * (depth + 1) * vocab * elem if engine.path_logits is not None else 0),
            0,
        ),
    }
    if plan.drafts and drafter is not None:
        drafter_bytes, drafter_elems = stored_weights(drafter)
        dcfg = drafter.config
        d_width = dcfg.num_attention_heads * dcfg.head_dim * dcfg.num_hidden_layers
        rows = engine.draft_depth(n)  # the block's positions the LM head and the tree read
        draft_logits = n * rows * vocab * elem
        counts["draft"] = (
            drafter_bytes
            + head.numel() * elem
            + n * (context + plan.block) * cache_bytes_per_token(drafter)
            + draft_logits,
            2 * n * plan.block * drafter_elems
            + 2 * n * rows * hidden * vocab
            + 4 * n * plan.block * (context + plan.block) * d_width,
        )
        counts["tree"] = (draft_logits, 0)
    out = {}
    for phase, (nbytes, nflops) in counts.items():
        out[phase] = {
            "bytes": int(nbytes),
            "flops": int(nflops),
            "floor_ms": round(max(nbytes / bandwidth, nflops / flops) * 1000, 4),
        }
    return out


@torch.inference_mode()
def round_phases(engine, n: int, bandwidth: float, flops: float, replays: int = 10) -> dict:
    """The per-phase table of the greedy graph `step(n)` replays now: each phase's kernels, kernel time,
    gaps and floor (phase_floors), the plain graph's replay time and the marked one's. Leaves the rows'
    lengths as they were; a caller that steps on should restart its rows (replays wrote their caches)."""
    graphs = engine.graphs
    batch = next(b for b in graphs.batch_buckets if b >= n)
    span = next(s for s in graphs.span_buckets if s >= engine.span_needed(n))
    graph = graphs.graphs[graphs.shape(batch, span, False)]
    rewind = Rewind(engine)
    plain = median_replay_ms(graph, 20, rewind)
    profiled = profile_round(engine, batch, span, replays)
    context = sum(engine.host_lengths[:n]) / n
    floors = phase_floors(engine, batch, context, bandwidth, flops)
    phases = {}
    for name, stats in profiled["phases"].items():
        floor = floors.get(name, {"bytes": 0, "flops": 0, "floor_ms": 0.0})
        phases[name] = {**stats, **floor}
    return {
        "replay_ms": round(plain, 4),
        "marked_round_ms": profiled["marked_round_ms"],
        "floor_ms": round(sum(p["floor_ms"] for p in phases.values()), 4),
        "phases": phases,
    }
