"""`ddtree bench`: ar / dflash / ddtree side by side, with and without CUDA graphs, plus the
Hugging Face `generate` baseline, in one process; and micro-benchmarks of single target forwards.

`--kernels torch|triton|both` picks the element-wise path of the target (model.py's PyTorch ops or the
Triton kernels of kernels.py); with `both`, every measurement runs for each, in one process.

Models: a real model id (acceptance is real when the drafter is trained) or `random:qwen3-8b`, a
Qwen3-8B-shaped model with random bf16 weights generated on the device (the cost side: its
acceptance is meaningless and labelled so).
"""

from __future__ import annotations

import gc
import itertools
import json
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import SpeculationConfig
from ..models.llama import Transformer
from .build import make_engine
from .engine import Engine, SamplingParams
from .fused import use_backend
from .graphs import median_replay_ms, plan_buckets
from .round_profile import matmul_throughput, round_phases, stored_weights


@dataclass(frozen=True)
class BenchPlan:
    """What `ddtree bench` measures (its sweep flags, parsed); what it loads is an EngineConfig."""

    methods: list[str]
    budgets: list[int]
    batch_sizes: list[int]
    graph_modes: list[bool]
    kernel_variants: list[str]
    rounds: int = 16
    ctx: int = 1024
    micro: bool = False
    capture_all: bool = False
    hf_baseline: bool = False
    out: str | None = None
    policies: list[dict[int, int]] = field(default_factory=list)  # ddtree under a budget per batch size


def copy_bandwidth(device) -> float:
    """Measured device copy bandwidth in bytes/s (read + write of a 2 GiB buffer)."""
    src = torch.empty(1 << 30, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / reps
    del src, dst
    return 2 * (1 << 31) / seconds


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def forward_ms(target: Transformer, batch: int, ctx: int, tokens: int, graphs: bool, reps: int = 50) -> float:
    """Time of one target forward of `tokens` new tokens per sequence after `ctx` cached ones."""
    dev = target.lm_head.weight.device
    target.setup_caches(batch, ctx + tokens)
    span = ctx + tokens
    ids = torch.randint(0, target.config.vocab_size, (batch, tokens), device=dev)
    pos = (ctx + torch.arange(tokens, device=dev)).expand(batch, -1).contiguous()
    j = torch.arange(span, device=dev)
    mask = (j[None, :] <= pos[0, :, None]).view(1, 1, tokens, span).expand(batch, 1, tokens, span).contiguous()
    run = lambda: target(ids, pos, pos, mask)  # noqa: E731
    for _ in range(3):
        run()
    if graphs:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        run = g.replay
    _sync(dev)
    start = time.perf_counter()
    for _ in range(reps):
        run()
    _sync(dev)
    return (time.perf_counter() - start) / reps * 1000


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights (round_profile.stored_weights), each storage once."""
    return stored_weights(model)[0]


def use_kernels(target: Transformer, variant: str) -> None:
    """Fused GEMMs (as the Engine runs them) with the PyTorch ("torch") or Triton ("triton") element-wise path."""
    use_backend(target, variant)


@torch.inference_mode()
def logits_difference(target: Transformer, ctx: int, tokens: int = 17) -> dict:
    """The same prefill of `ctx` tokens and verify step of `tokens` under both variants: max |logit
    difference| (bf16 rounding differs, a wrong kernel shows as a large one) and argmax agreement."""
    dev = target.lm_head.weight.device
    ids = torch.randint(0, target.config.vocab_size, (1, ctx + tokens), generator=torch.Generator().manual_seed(0))
    ids, j = ids.to(dev), torch.arange(ctx + tokens, device=dev)
    logits = {}
    for variant in ("torch", "triton"):
        use_kernels(target, variant)
        target.setup_caches(1, ctx + tokens)
        target(ids[:, :ctx], j[None, :ctx], j[None, :ctx], (j[:ctx, None] >= j[None, :ctx])[None, None], logits=False)
        mask = (j[None, :] <= j[ctx:, None])[None, None]
        logits[variant] = target(ids[:, ctx:], j[None, ctx:], j[None, ctx:], mask)[0].float()
    a, b = logits["torch"], logits["triton"]
    return {
        "ctx": ctx,
        "tokens": tokens,
        "max_abs_diff": round((a - b).abs().max().item(), 5),
        "max_abs_logit": round(a.abs().max().item(), 4),
        "argmax_agreement": round((a.argmax(-1) == b.argmax(-1)).float().mean().item(), 4),
    }


def expert_bytes(target: Transformer) -> tuple[int, int]:
    """(bytes of the routed experts' weights, bytes a batch-1 decode step reads of them: top k of each
    MoE layer's experts); (0, 0) for a dense model."""
    from ..models.moe import SparseMoE

    total = active = 0
    for module in target.modules():
        if isinstance(module, SparseMoE):
            layer = weight_bytes(module.experts)
            total += layer
            active += layer * module.gate.top_k // len(module.experts)
    return total, active


MOE_BATCHES, MOE_TOKENS = (1, 8, 32), (1, 9, 17, 33, 65)


def moe_micro(target: Transformer, ctx: int, bandwidth: float | None) -> dict:
    """The MoE verify tax: forward ms for 1 (decode) and 9/17/33/65 (verify) tokens per sequence at
    batch 1, 8 and 32, and the decode step's HBM bound counting only the chosen experts' bytes (a tree of
    B + 1 tokens activates up to (B + 1) x k experts per layer, so verify grows faster than on a dense
    model of the same active size)."""
    cuda = target.lm_head.weight.is_cuda
    total, active = expert_bytes(target)
    dense = weight_bytes(target) - total
    out: dict[str, Any] = {"expert_bytes": total, "active_expert_bytes": active, "other_bytes": dense}
    if bandwidth:
        out["active_bound_ms"] = round((dense + active) / bandwidth * 1000, 3)
        out["all_experts_bound_ms"] = round((dense + total) / bandwidth * 1000, 3)
    out["forward_ms"] = {
        batch: {
            tokens: round(forward_ms(target, batch, ctx, tokens, graphs=cuda, reps=20 if cuda else 1), 3)
            for tokens in MOE_TOKENS
        }
        for batch in MOE_BATCHES
    }
    if bandwidth:
        out["decode_over_active_bound"] = round(out["forward_ms"][1][1] / out["active_bound_ms"], 3)
    return out


def micro(target: Transformer, ctx: int = 1024, variants: tuple[str, ...] = ("torch",)) -> dict:
    """Plain decode step and verify widths at batch 1 against the HBM bound, per kernel variant.
    On CUDA each shape is one CUDA graph; on CPU (a check of the code path) eager, with no bound."""
    dev = target.lm_head.weight.device
    cuda = dev.type == "cuda"
    out: dict[str, Any] = {
        "ctx": ctx,
        "kernels": list(variants),
        "tensor_parallel": target.tp.world if target.tp else 1,
    }
    if cuda:  # under tensor parallelism: this rank's shard against this rank's HBM
        bw, wbytes = copy_bandwidth(dev), weight_bytes(target)
        out.update(
            weight_bytes=wbytes, copy_bandwidth_GBps=round(bw / 1e9, 1), hbm_bound_ms=round(wbytes / bw * 1000, 3)
        )
    out.update(forward_ms={}, decode_over_hbm_bound={}, verify33_over_decode={})
    for variant in variants:
        use_kernels(target, variant)
        ms = {
            tokens: round(forward_ms(target, 1, ctx, tokens, graphs=cuda, reps=50 if cuda else 2), 3)
            for tokens in (1, 17, 33, 65)
        }
        out["forward_ms"][variant] = ms
        if cuda:
            out["decode_over_hbm_bound"][variant] = round(ms[1] / out["hbm_bound_ms"], 3)
        out["verify33_over_decode"][variant] = round(ms[33] / ms[1], 3)
    if expert_bytes(target)[0]:  # a mixture of experts: the verify tax, with the last variant
        out["moe"] = moe_micro(target, ctx, bw if cuda else None)
    if len(variants) > 1:
        out["logits_torch_vs_triton"] = logits_difference(target, ctx)
    return out


# (N, K) of quantized layers as published: Kimi K2.6's INT4 routed experts, DeepSeek-V3's FP8 attention and MLP
QUANT_SHAPES: dict[str, tuple[str, int, int]] = {
    "kimi expert gate+up": ("int4", 2 * 2048, 7168),
    "kimi expert down": ("int4", 7168, 2048),
    "deepseek q_b_proj": ("fp8", 24576, 1536),
    "deepseek o_proj": ("fp8", 7168, 16384),
    "deepseek dense gate+up": ("fp8", 2 * 18432, 7168),
}
QUANT_ROWS = (1, 9, 17, 33, 65, 264)  # decode; verify of budget 8 / 16 / 32 / 64 trees; 8 x 33


def _graph_ms(fn, reps: int = 50) -> float:
    """Time of fn() replayed from one CUDA graph (launch overhead out of the figure)."""
    for _ in range(3):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1000


@torch.no_grad()
def quant_gemm_micro(device="cuda") -> dict:
    """The W4A16 (INT4 group 32) and FP8 block GEMMs of runtime/quant_kernels.py at decode and verify widths,
    against the HBM bound of the bytes they must read (weights, scales, activations) and against a bf16
    cuBLAS GEMM of the same shape (which reads 4x or 2x the weight bytes); INT4 in each way of unpacking
    (INT4_UNPACK); and the grouped INT4 experts of one Kimi K2.6 MoE layer."""
    from .quant_kernels import INT4_UNPACK

    bw = copy_bandwidth(device)
    shapes = {}
    for name, (kind, n, k) in QUANT_SHAPES.items():
        for unpack in INT4_UNPACK if kind == "int4" else (None,):
            label = f"{name} ({unpack})" if unpack else name
            shapes[label] = _quant_gemm_rows(kind, n, k, bw, device, unpack)
    return {
        "copy_bandwidth_GBps": round(bw / 1e9, 1),
        "rows": list(QUANT_ROWS),
        "shapes": shapes,
        "kimi_moe_layer": _kimi_moe_layer(bw, device),
    }


def _quant_gemm_rows(kind: str, n: int, k: int, bw: float, device, unpack: str | None) -> dict:
    from ..models.quant import quantize_fp8_block
    from .quant_kernels import fp8_block_linear, int4_linear

    dense = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    if kind == "int4":
        packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device=device)
        scale = torch.full((n, k // 32), 0.004, dtype=torch.bfloat16, device=device)
        stored = packed.nbytes + scale.nbytes

        def run(x):
            return int4_linear(x, packed, scale, 32, unpack=unpack or "planes")
    else:
        fp8, scale_inv = quantize_fp8_block(dense)
        stored = fp8.nbytes + scale_inv.nbytes

        def run(x):
            return fp8_block_linear(x, fp8, scale_inv)

    rows = {}
    for m in QUANT_ROWS:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        moved = stored + x.nbytes + m * n * 2
        ms = _graph_ms(lambda: run(x))  # noqa: B023 - timed before x changes
        rows[m] = {
            "ms": round(ms, 4),
            "bound_ms": round(moved / bw * 1000, 4),
            "over_bound": round(ms / (moved / bw * 1000), 2),
            "GBps": round(moved / ms / 1e6, 1),
            "bf16_cublas_ms": round(_graph_ms(lambda: torch.nn.functional.linear(x, dense)), 4),  # noqa: B023
        }
    return {"kind": kind, "n": n, "k": k, "weight_bytes": stored, "by_rows": rows}


def _random_int4_experts(
    experts: int, rows: int, cols: int, device, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Random INT4 experts (group 32) in the checkpoints' layout: packed words [experts, rows, cols / 8] and
    bf16 scales [experts, rows, cols / 32]."""
    shape = (experts, rows, cols // 8)
    words = torch.randint(-(2**31), 2**31 - 1, shape, generator=generator, device=device, dtype=torch.int32)
    scale = torch.rand(experts, rows, cols // 32, generator=generator, device=device) * 0.01
    return words, scale.to(torch.bfloat16)


def _kimi_moe_layer(bw: float, device, experts: int = 384, hidden: int = 7168, inter: int = 2048) -> dict:
    """One Kimi K2.6 MoE layer's routed experts (INT4 group 32, top 8 of 384) through moe_experts_int4, for
    1 / 9 / 33 tokens and 8 x 33, against the bound of reading the chosen experts once."""
    from .quant_kernels import INT4_UNPACK, moe_experts_int4

    gate_up, down = (
        _random_int4_experts(experts, 2 * inter, hidden, device),
        _random_int4_experts(experts, hidden, inter, device),
    )
    per_expert = sum(t[0].nbytes for t in (*gate_up, *down))
    out: dict[str, Any] = {}
    for tokens in (1, 9, 33, 264):
        x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
        ids = torch.rand(tokens, experts, device=device).topk(8, dim=-1).indices.int()
        weights = torch.rand(tokens, 8, device=device, dtype=torch.bfloat16)
        bound = (ids.unique().numel() * per_expert + 2 * x.nbytes) / bw * 1000
        row: dict[str, Any] = {"experts_read": ids.unique().numel(), "bound_ms": round(bound, 4)}
        for unpack in INT4_UNPACK:
            ms = _graph_ms(lambda: moe_experts_int4(x, weights, ids, *gate_up, *down, 32, unpack=unpack))  # noqa: B023
            row[unpack] = {"ms": round(ms, 4), "over_bound": round(ms / bound, 2)}
        out[str(tokens)] = row
    return out


def _device_ms(fn, calls: int = 10, reps: int = 9) -> float:
    """Device time of one fn() in ms: a CUDA graph of `calls` calls (so that host launches do not set the
    pace), median of `reps` replays, after two eager warm-up calls."""
    fn()
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    return median_replay_ms(graph, reps) / calls


def _topk_less_logsumexp(logits: Tensor, budget: int) -> tuple[Tensor, Tensor]:
    """The Triton tree builder's candidate step (fused.build_ddtree_triton)."""
    from . import kernels

    top, tok = logits.topk(budget, dim=-1)
    return top.float() - kernels.row_logsumexp(logits)[..., None], tok


@torch.inference_mode()
def tree_candidates_micro(device="cuda", vocab: int = 151936, depth: int = 15) -> list[dict]:
    """The DDTree candidate step (each draft row's top-K log-probabilities) both ways, on bf16 draft
    logits of the Qwen3-8B vocabulary: the tensorised builder's fp32 log_softmax + top-k
    (tree.top_candidates), and the Triton builder's two ways (kernels.row_top_applies picks): top-k of
    the logits as they are less kernels.row_logsumexp, and kernels.row_top_logprobs (at each run length;
    its default's among them)."""
    from ..speculative.tree import top_candidates
    from . import kernels

    rows = []
    for batch in (1, 16):
        logits = torch.randn(batch, depth, vocab, device=device, dtype=torch.bfloat16) * 3
        for budget in (8, 32):
            kp = max(2, 1 << (budget - 1).bit_length())
            by_group = {
                g: round(_device_ms(partial(kernels.row_top_logprobs, logits, budget, group=g)), 4)
                for g in (1, 4, 8, 16, 32, 64)
            }
            group = kernels.row_top_group(4096, kp)  # row_top_logprobs' default at its default chunk
            rows.append(
                {
                    "batch": batch,
                    "budget": budget,
                    "log_softmax_topk_ms": round(_device_ms(partial(top_candidates, logits, budget)), 4),
                    "topk_logsumexp_ms": round(_device_ms(partial(_topk_less_logsumexp, logits, budget)), 4),
                    "row_top_logprobs_ms": by_group[group],
                    "group": group,
                    "row_top_logprobs_ms_by_group": by_group,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


@torch.inference_mode()
def attention_sweep(
    device="cuda",
    shapes=None,
    chunks: tuple[int, ...] | None = None,
    max_rows: tuple[int, ...] = (64, 128),
    warps: tuple[int, ...] = (4,),
    stages: tuple[int, ...] = (2, 3),
    block_ns: tuple[int, ...] = (64,),
    layers: int = 8,
    round_like: bool = False,
) -> list[dict]:
    """kernels.attention's tuning knobs (chunk: key slots per program, 64 to one chunk for the whole span
    unless `chunks` names them; max_rows; num_warps; num_stages; block_n: keys per step, where the
    default tile spills registers) swept at the Qwen3-8B geometry (32 query heads, 8 KV heads of 128)
    over `shapes` (batch, query tokens, cached tokens, span of the graph bucket; default: decode, draft
    and verify widths at batch 1 to 64): per shape, the default's time and every configuration's, in ms
    a layer. Each timing runs one attention over each of `layers` caches in turn, as a forward does: one
    cache replayed alone (layers=1) stays partly in L2 (a batch-16 cache of 1200 slots is 79 MB).
    round_like: the query tokens form a random tree (each sees its ancestors) instead of a chain, the cache
    is paged (16-slot pages in a random order across the pool) instead of one block per row, q is a
    view of a [batch, tokens, heads, 128] tensor and the cache rows are given, as in a round's verify."""
    from ..models.layers import identity_slot_map
    from . import kernels

    heads, kv_heads, hd = 32, 8, 128
    shapes = shapes or [  # (batch, tokens, context, span)
        *((1, T, 1200, 2048) for T in (1, 9, 16, 33)),
        (4, 33, 1200, 2048),
        *((16, T, 1200, 2048) for T in (1, 9, 16, 33)),
        (64, 1, 1200, 2048),
        (64, 9, 1200, 2048),
        *((b, T, 3000, 4096) for b, T in ((1, 33), (16, 1), (16, 9), (16, 33))),
    ]
    out = []
    for batch, T, context, span in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        if round_like:  # the layout of the attention's input in a forward: [bs, T, heads, hd] transposed
            q = torch.randn(batch, T, heads, hd, device=device, dtype=torch.bfloat16, generator=g).transpose(1, 2)
        else:
            q = torch.randn(batch, heads, T, hd, device=device, dtype=torch.bfloat16, generator=g)
        caches = [
            [
                torch.randn(kv_heads, batch * span + 1, hd, device=device, dtype=torch.bfloat16, generator=g)
                for _ in "kv"
            ]
            for _ in range(layers)
        ]
        slot_map = identity_slot_map(batch, span, device)
        mask = _verify_mask(batch, T, context, span, device)
        if round_like:
            slot_map, mask = _shuffled_pages(slot_map, span, g), _tree_mask(mask, context, g)
        bounds = kernels.mask_bounds(mask)
        cache_rows = torch.arange(batch, device=device) if round_like else None

        default = partial(_attention_over_layers, q, caches, slot_map, mask, cache_rows, bounds)
        reference = default()
        default_ms = _device_ms(default) / layers
        knob_sets = []
        for chunk, rows, num_warps, num_stages, block_n in itertools.product(
            chunks or _doubling(64, span), max_rows, warps, stages, block_ns
        ):
            knobs = dict(chunk=chunk, max_rows=rows, num_stages=num_stages)
            if warps != (4,):
                knobs["num_warps"] = num_warps
            if block_ns != (64,):
                knobs["block_n"] = block_n
            knob_sets.append(knobs)
        configs = [{**c, "ms": round(c["ms"] / layers, 4)} for c in _timed_configs(default, knob_sets, reference)]
        best = min(configs, key=lambda c: c["ms"])
        out.append(
            {
                "batch": batch,
                "tokens": T,
                "context": context,
                "span": span,
                "layers": layers,
                "round_like": round_like,
                "default_ms": round(default_ms, 4),
                "best_ms": best["ms"],
                "best": {k: v for k, v in best.items() if k != "ms"},
                "configs": configs,
            }
        )
        print(json.dumps(out[-1]), flush=True)
    return out


def _attention_over_layers(
    q: Tensor, caches: list, slot_map: Tensor, mask: Tensor, rows: Tensor | None, bounds: Tensor, **knobs
) -> Tensor:
    """kernels.attention over each layer's (k, v) cache in turn; the first layer's output."""
    from . import kernels

    return [kernels.attention(q, k, v, slot_map, mask, rows, bounds, **knobs) for k, v in caches][0]


def _verify_mask(batch: int, T: int, context: int, span: int, device) -> Tensor:
    """[batch, 1, T, span]: `context` committed slots every query sees, then T causal ones (a chain)."""
    j = torch.arange(span, device=device)
    t = torch.arange(T, device=device)
    mask = (j[None, :] < context) | ((j[None, :] >= context) & (j[None, :] - context <= t[:, None]))
    return mask.view(1, 1, T, span).expand(batch, 1, T, span).contiguous()


def _tree_mask(chain: Tensor, context: int, g: torch.Generator) -> Tensor:
    """_verify_mask's mask with its T query tokens made a random tree: token i > 0 has a parent drawn from
    0..i-1 and sees its ancestors and itself; every row the same tree."""
    T = chain.shape[2]
    sees = torch.eye(T, dtype=torch.bool, device=chain.device)
    for i in range(1, T):
        parent = int(torch.randint(0, i, (1,), generator=g, device=g.device))
        sees[i] |= sees[parent]
    mask = chain.clone()
    mask[:, 0, :, context : context + T] = sees
    return mask


def _shuffled_pages(slot_map: Tensor, span: int, g: torch.Generator, page: int = 16) -> Tensor:
    """identity_slot_map's table with its `page`-slot pages in a random order across the pool (the trash
    slot kept), as a paged cache's pages are after sequences grow in turn."""
    rows = slot_map.shape[0]
    pages = rows * span // page
    order = torch.randperm(pages, generator=g, device=g.device).to(slot_map.device, torch.int32)
    table = slot_map.clone()
    slots = table[:, :span]
    table[:, :span] = order[slots // page] * page + slots % page
    return table


def _doubling(first: int, span: int) -> list[int]:
    """Chunk lengths from `first` slots up to the first that holds the whole span, doubling."""
    chunks = [first]
    while chunks[-1] < span:
        chunks.append(2 * chunks[-1])
    return chunks


def _timed_configs(default, knob_sets: list[dict], reference: Tensor) -> list[dict]:
    """Each knob set's device time (ms), its output checked against `reference`; a set that does not fit
    this GPU (out of shared memory or registers) is skipped."""
    configs = []
    for knobs in knob_sets:
        run = partial(default, **knobs)
        try:
            torch.testing.assert_close(run(), reference, atol=2e-2, rtol=2e-2)
            configs.append({**knobs, "ms": round(_device_ms(run), 4)})
        except Exception as exc:
            if "OutOfResources" not in type(exc).__name__ and "out of resource" not in str(exc):
                raise
    return configs


def _gathered_latent_sdpa(q: Tensor, latent: Tensor, slot_map: Tensor, mask: Tensor, rank: int, scale: float) -> Tensor:
    """MLA's attention as the torch backend runs it: the rows' latents gathered by the slot map, then SDPA
    with every head against them as one KV head; [bs, T, heads, rank]."""
    bs, span = mask.shape[0], mask.shape[-1]
    keys = latent[slot_map[:bs, :span]][:, None]
    out = F.scaled_dot_product_attention(q, keys, keys[..., :rank], attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


@torch.inference_mode()
def latent_sweep(
    device="cuda",
    shapes=None,
    heads: tuple[int, ...] = (8, 64),
    chunks: tuple[int, ...] | None = None,
    block_ms: tuple[int, ...] = (16, 32),
    block_ns: tuple[int, ...] = (16, 32),
    warps: tuple[int, ...] = (4, 8),
    stages: tuple[int, ...] = (2,),
) -> list[dict]:
    """mla_kernels.latent_attention's tuning knobs (chunk: 256 slots to one chunk for the span unless
    `chunks` names them; block_m; block_n; num_warps; num_stages) swept at Kimi K2's latent (kv_lora_rank
    512, RoPE 64) with `heads` query heads a rank (8 under TP=8, 64 on one GPU) over `shapes` (batch, query
    tokens, cached tokens, span of the graph bucket): per shape, the torch backend's path (SDPA over the
    latents gathered by the slot map), the default's time and every configuration's."""
    from ..models.layers import identity_slot_map
    from . import kernels
    from .mla_kernels import latent_attention

    rank, rope = 512, 64
    scale = (128 + rope) ** -0.5
    shapes = shapes or [  # (batch, tokens, context, span)
        *((1, T, 1200, 2048) for T in (1, 9, 33)),
        *((8, T, 1200, 2048) for T in (1, 33)),
        (1, 33, 3000, 4096),
    ]
    out = []
    for n_heads, (batch, T, context, span) in itertools.product(heads, shapes):
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(batch, n_heads, T, rank + rope, device=device, dtype=torch.bfloat16, generator=g)
        latent = torch.randn(batch * span + 1, rank + rope, device=device, dtype=torch.bfloat16, generator=g)
        slot_map = identity_slot_map(batch, span, device)
        mask = _verify_mask(batch, T, context, span, device)

        gathered_sdpa = partial(_gathered_latent_sdpa, q, latent, slot_map, mask, rank, scale)
        default = partial(latent_attention, q, latent, slot_map, mask, None, rank, scale, kernels.mask_bounds(mask))
        reference = default()
        torch.testing.assert_close(reference, gathered_sdpa(), atol=2e-2, rtol=2e-2)
        sdpa_ms, default_ms = _device_ms(gathered_sdpa), _device_ms(default)
        knob_sets = [
            dict(chunk=chunk, block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
            for chunk, block_m, block_n, num_warps, num_stages in itertools.product(
                chunks or _doubling(256, span), block_ms, block_ns, warps, stages
            )
        ]
        configs = _timed_configs(default, knob_sets, reference)
        best = min(configs, key=lambda c: c["ms"])
        out.append(
            {
                "heads": n_heads,
                "batch": batch,
                "tokens": T,
                "context": context,
                "span": span,
                "gathered_sdpa_ms": round(sdpa_ms, 4),
                "default_ms": round(default_ms, 4),
                "best_ms": best["ms"],
                "best": {k: v for k, v in best.items() if k != "ms"},
                "configs": configs,
            }
        )
        print(json.dumps(out[-1]), flush=True)
    return out


@torch.inference_mode()
def int4_experts_sweep(
    device="cuda",
    tokens: tuple[int, ...] = (1, 9, 33, 264),
    block_ns: tuple[int, ...] = (32, 64, 128),
    warps: tuple[int, ...] = (4, 8),
    stages: tuple[int, ...] = (2, 3, 4),
    split_columns: tuple[bool, ...] = (False, True),
    fragment_order: tuple[bool, ...] = (False, True),
    experts: int = 384,
    hidden: int = 7168,
    inter: int = 2048,
    top_k: int = 8,
) -> list[dict]:
    """quant_kernels.grouped_gemm_int4's knobs (block_n, num_warps, num_stages, split_columns, fragment_order)
    swept over one Kimi K2.6 MoE layer's experts (INT4 group 32, top 8 of 384 under uniform random routing,
    bf16) at `tokens` tokens, gate/up (with its SiLU product) and down apart: per width and GEMM, the
    default's time, every configuration's, and the bound of reading the chosen experts' weights and scales
    once. The full grid is 576 timings (about 10 minutes on an H100, most of it compiling)."""
    from .moe_kernels import align_pairs
    from .quant_kernels import grouped_gemm_int4

    g = torch.Generator(device=device).manual_seed(0)
    gemms = {
        "gate_up": (*_random_int4_experts(experts, 2 * inter, hidden, device, g), hidden, True),
        "down": (*_random_int4_experts(experts, hidden, inter, device, g), inter, False),
    }
    seconds_per_byte = 1 / copy_bandwidth(device)
    out = []
    for count in tokens:
        ids = torch.rand(count, experts, generator=g, device=device).topk(top_k, dim=-1).indices.int()
        rows, block_expert = align_pairs(ids, experts, block_m=16)
        reached = ids.unique().numel()
        for name, (words, scale, width, silu_mul) in gemms.items():
            a = torch.randn(count if silu_mul else count * top_k, width, generator=g, device=device).to(torch.bfloat16)
            default = partial(
                grouped_gemm_int4,
                a,
                words,
                scale,
                32,
                rows,
                block_expert,
                count * top_k,
                top_k if silu_mul else 1,
                silu_mul,
            )
            reference = default()
            knob_sets = [
                dict(block_n=bn, num_warps=w, num_stages=st, split_columns=split, fragment_order=frag)
                for bn, w, st, split, frag in itertools.product(block_ns, warps, stages, split_columns, fragment_order)
            ]
            configs = _timed_configs(default, knob_sets, reference)
            best = min(configs, key=lambda c: c["ms"])
            expert_bytes = (words.nbytes + scale.nbytes) / experts
            out.append(
                {
                    "tokens": count,
                    "gemm": name,
                    "experts_reached": reached,
                    "bound_ms": round(reached * expert_bytes * seconds_per_byte * 1000, 4),
                    "default_ms": round(_device_ms(default), 4),
                    "best_ms": best["ms"],
                    "best": {k: v for k, v in best.items() if k != "ms"},
                    "configs": configs,
                }
            )
            print(json.dumps(out[-1]), flush=True)
    return out


@torch.inference_mode()
def skinny_sweep(device="cuda", hidden: int = 4096, inter: int = 12288) -> list[dict]:
    """kernels.skinny_linear's gate/up configurations (block_n, block_k, warps, stages) swept at the Qwen3-8B
    MLP (and its drafter's) for the row counts of a verify at batch 1 (9 and 33 rows) and a draft block
    (16 rows), timed in CUDA graphs against the copy-bandwidth time of the weight: per row count, the
    configuration in use (fused.TritonMLP) and the fastest."""
    from . import kernels
    from .fused import TritonMLP

    weight = torch.randn(2 * inter, hidden, device=device, dtype=torch.bfloat16) * 0.02
    seconds_per_byte = 1 / copy_bandwidth(device)
    out = []
    for rows in (9, 16, 33):
        x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
        reference = kernels.silu_mul(x @ weight.T)
        in_use = TritonMLP.config_for(rows)
        assert in_use is not None
        timed: dict[tuple, float] = {}
        for config in {in_use} | {
            (block_n, block_k, 1, warps, stages)
            for block_n in (16, 32, 64)
            for block_k in (64, 128, 256)
            for warps in (4, 8)
            for stages in (3, 4, 5)
        }:
            run = partial(kernels.skinny_linear, x, weight, config, gate_up=True)
            try:
                torch.testing.assert_close(run(), reference, atol=3e-2, rtol=3e-2)
                timed[config] = _device_ms(run)
            except Exception as exc:  # a configuration that does not fit this GPU: skipped
                if "OutOfResources" not in type(exc).__name__ and "out of resource" not in str(exc):
                    raise
        best = min(timed, key=timed.__getitem__)
        bound_ms = weight.numel() * weight.element_size() * seconds_per_byte * 1000
        out.append(
            {
                "rows": rows,
                "in_use": list(in_use),
                "in_use_ms": round(timed[in_use], 4),
                "best": list(best),
                "best_ms": round(timed[best], 4),
                "copy_bound_ms": round(bound_ms, 4),
            }
        )
        print(json.dumps(out[-1]), flush=True)
    return out


def _cycled_ms(fns: list) -> float:
    """Device time of one call in ms, the calls cycling through fns (one per copy of a weight, so that L2
    holds none of them from the call before): a CUDA graph of three passes, median of 7 replays."""
    for fn in fns:
        fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(3):
            for fn in fns:
                fn()
    return median_replay_ms(graph, 7) / (3 * len(fns))


def _projected(project, w: Tensor, residual: Tensor | None, norm: Tensor) -> Tensor:
    """project(w), then the add_rms_norm that follows o and down in a decoder layer (residual None: none)."""
    from . import kernels

    y = project(w)
    return y if residual is None else kernels.add_rms_norm(y, residual, norm, 1e-6)[0]


def wide_sweep(device="cuda", rows_list: tuple[int, ...] = (144,), hidden: int = 4096, inter: int = 12288) -> list:
    """kernels.wide_linear's configurations (block_n, block_k, K splits, warps, stages) against cuBLAS for the
    q/k/v, o and down projections of the Qwen3-8B shape at `rows_list` rows (144: a batch-16 B=8 verify),
    timed in CUDA graphs over 8 copies of the weight. o and down are timed with the add_rms_norm after them
    (which adds up the K-split partial products, and which follows cuBLAS too): the forward's cost. Per
    projection: the copy-bandwidth time of the weight, cuBLAS's time and the four fastest configurations."""
    from . import kernels

    seconds_per_byte = 1 / copy_bandwidth(device)
    norm = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    out = []
    for rows in rows_list:
        for name, n, k in (("qkv", 6144, hidden), ("o", hidden, hidden), ("down", hidden, inter)):
            weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(8)]
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            residual = None if name == "qkv" else torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
            cublas = [partial(_projected, partial(F.linear, x), w, residual, norm) for w in weights]
            reference = cublas[0]().float()
            timings: list[tuple[float, tuple]] = []
            for config in itertools.product((64, 128), (64, 128), (1, 2, 4), (4, 8), (3, 4)):
                if not kernels.wide_applies(rows, n, k, config, torch.bfloat16) or (name == "qkv" and config[2] > 1):
                    continue
                wide = partial(kernels.wide_linear, x, config=config)
                fns = [partial(_projected, wide, w, residual, norm) for w in weights]
                try:
                    torch.testing.assert_close(fns[0]().float(), reference, atol=3e-2, rtol=3e-2)
                    timings.append((_cycled_ms(fns), config))
                except Exception as exc:  # a configuration that does not fit this GPU: skipped
                    if "OutOfResources" not in type(exc).__name__ and "out of resource" not in str(exc):
                        raise
            timings.sort()
            out.append(
                {
                    "rows": rows,
                    "proj": name,
                    "copy_bound_ms": round(weights[0].numel() * 2 * seconds_per_byte * 1000, 4),
                    "cublas_ms": round(_cycled_ms(cublas), 4),
                    "best": [[round(ms, 4), list(config)] for ms, config in timings[:4]],
                }
            )
            print(json.dumps(out[-1]), flush=True)
            del weights
    return out


def load_time(folder, device, dtype, rank: int = 0, world: int = 1) -> dict:
    """Seconds and peak host memory of loading a checkpoint folder as rank `rank` of `world` (each rank reads
    only its slices: loading needs no process group, so the ranks can be timed one after another)."""
    from ..models.registry import load_pretrained
    from .parallel import shard

    status = lambda: dict(line.split(":", 1) for line in open("/proc/self/status"))  # noqa: E731
    before = int(status()["VmRSS"].split()[0]) * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident size restarts here
    start = time.perf_counter()
    cut = (lambda m: shard(m, rank, world)) if world > 1 else None
    target = load_pretrained(folder, dtype, device, shard=cut, label=f"rank {rank}")
    _sync(torch.device(device))
    seconds = time.perf_counter() - start
    peak = int(status()["VmHWM"].split()[0]) * 1024
    loaded = weight_bytes(target)
    return {
        "rank": rank,
        "world": world,
        "seconds": round(seconds, 2),
        "rank_bytes": loaded,
        "GBps": round(loaded / seconds / 1e9, 2),
        "host_peak_growth_bytes": peak - before,
    }


def count_host_syncs(engine: Engine, n: int, rounds: tuple[int, int] = (8, 3)) -> float:
    """Host synchronisations per round from profiler traces: (syncs in 8 rounds - syncs in 3 rounds) / 5
    (`rounds`), so that the profiler's own start/stop synchronisation cancels out."""
    from torch.profiler import ProfilerActivity, profile

    names = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")

    def syncs(rounds: int) -> int:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(rounds):
                engine.step(n)
        return sum(e.count for e in prof.key_averages() if e.key in names)

    more, fewer = rounds
    return (syncs(more) - syncs(fewer)) / (more - fewer)


@torch.inference_mode()
def run_config(target, drafter, method, budget, batch, prompts, graphs, rounds, profile_phases, rates=None) -> dict:
    """One (method, budget, batch, graphs) measurement: round time, acceptance and tokens/s over every
    prompt; with profile_phases, the phase split (eager: CUDA events; graphs: round_profile's per-phase
    table against the floors at `rates`, (bytes/s, FLOP/s) measured on the device)."""
    # room for warm-up, timed and profiled rounds at up to block_size tokens each
    block = drafter.block_size if drafter is not None and method != "ar" else 1
    max_seq = max(len(p) for p in prompts) + (rounds + 16) * block + 64
    engine = make_engine(target, drafter, SpeculationConfig(method, budget), max_batch_size=batch, max_seq_len=max_seq)
    plan = engine.plan(batch)
    row = {"method": method, "budget": plan.budget, "batch": batch, "graphs": graphs, "tree_size": plan.tree_size}
    if isinstance(budget, dict):  # a budget per batch size: this batch size's budget, and the policy
        row["policy"] = policy_text(budget)
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    if graphs:
        # under a budget per batch size, the buckets where its plans end below `batch` too (graphs refuses
        # a plan that ends between buckets); the rounds below run `batch` rows only
        row["capture_seconds"] = round(engine.capture_graphs(plan_buckets(engine, batch), [engine.max_slots]), 3)
    params = SamplingParams(max_new_tokens=max_seq - max(len(p) for p in prompts))

    def start_group(group: int, engine: Engine = engine) -> None:  # bound now: `engine` is deleted below
        for i in range(batch):
            engine.release(i)
            engine.add(i, prompts[(group * batch + i) % len(prompts)], params)
        for _ in range(2):  # warm-up (and, in group 0, the first replays)
            engine.step(batch)

    start_group(0)
    if profile_phases and cuda and not graphs:
        engine.phase_events = []
        engine.step(batch)
        torch.cuda.synchronize()
        marks = engine.phase_events
        engine.phase_events = None
        row["phase_ms"] = {name: round(start.elapsed_time(end), 3) for (_, start), (name, end) in zip(marks, marks[1:])}
    # every prompt takes part: below len(prompts) sequences, the groups of `batch` prompts run in turn
    groups = max(1, len(prompts) // batch)
    emitted, seconds = 0, 0.0
    for group in range(groups):
        if group:
            start_group(group)
        start = time.perf_counter()
        for _ in range(rounds):
            emitted += sum(len(t) for t in engine.step(batch))  # each step ends with the host readout: synced
        seconds += time.perf_counter() - start
    row.update(
        ms_per_round=round(seconds / (rounds * groups) * 1000, 3),
        acceptance_length=round(emitted / (rounds * groups * batch), 3),
        tokens_per_second=round(emitted / seconds, 1),
        prompts=min(len(prompts), groups * batch),
    )
    if cuda:
        row["peak_memory_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if graphs:
        row["host_syncs_per_round"] = count_host_syncs(engine, batch)
        row["eager_fallbacks"] = engine.graphs.fallbacks
    if graphs and profile_phases and rates and target.tp is None:
        start_group(0)
        try:
            row["graph_phases"] = round_phases(engine, batch, *rates)
            row["host_timed_minus_replay_ms"] = round(row["ms_per_round"] - row["graph_phases"]["replay_ms"], 4)
        except RuntimeError as exc:  # a profiler that sees no kernels inside graphs: say so, keep the row
            row["graph_phases"] = {"error": str(exc)}
    del engine
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


@torch.inference_mode()
def hf_baseline(target: Transformer, batch: int, prompts, new_tokens: int) -> dict:
    """transformers `generate` (greedy) on the same weights: what a user would otherwise run."""
    import transformers

    cfg = target.config
    kind = {"qwen3": transformers.Qwen3Config, "qwen2": transformers.Qwen2Config}.get(
        cfg.model_type, transformers.LlamaConfig
    )
    hf_cfg = kind(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings,
    )
    dev, dtype = target.lm_head.weight.device, target.lm_head.weight.dtype
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            hf = getattr(transformers, kind.__name__.replace("Config", "ForCausalLM"))(hf_cfg).eval()
    finally:
        torch.set_default_dtype(default)
    hf.load_state_dict(target.state_dict(), strict=False)
    length = min(len(p) for p in prompts)
    ids = torch.tensor([prompts[i % len(prompts)][:length] for i in range(batch)], device=dev)
    hf.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    torch.cuda.synchronize()
    start = time.perf_counter()
    hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del hf
    return {
        "method": "hf-generate",
        "batch": batch,
        "graphs": False,
        "budget": None,
        "tokens_per_second": round(batch * new_tokens / seconds, 1),
        "ms_per_round": round(seconds / new_tokens * 1000, 3),
        "acceptance_length": 1.0,
    }


@torch.inference_mode()
def capture_all(target, drafter, ctx: int, budget: int = 32) -> dict:
    """Capture time of every batch bucket (1..64) and span bucket for a ddtree engine."""
    engine = make_engine(target, drafter, SpeculationConfig("ddtree", budget), max_batch_size=64, max_seq_len=2 * ctx)
    torch.cuda.reset_peak_memory_stats()
    seconds = engine.capture_graphs()
    out = {
        "budget": budget,
        "graphs": len(engine.graphs.graphs),
        "batch_buckets": engine.graphs.batch_buckets,
        "span_buckets": engine.graphs.span_buckets,
        "capture_seconds": round(seconds, 2),
        "peak_memory_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return out


def policy_text(policy: dict[int, int]) -> str:
    """A budget per batch size as --budget and --policy take it: 1:32,16:8."""
    return ",".join(f"{n}:{b}" for n, b in sorted(policy.items()))


def recommend_budget(rows: list[dict]) -> dict | None:
    """The measured fastest `ddtree` budget per batch size, as a `--budget` value for serve/generate,
    with how it compares to `dflash` and `ar` at that batch size (graph rows when there are any; the
    fixed budgets' rows, not those of a --policy)."""
    timed = [r for r in rows if "tokens_per_second" in r and "policy" not in r]
    if any(r.get("graphs") for r in timed):
        timed = [r for r in timed if r.get("graphs")]
    per_batch = {}
    for batch in sorted({r["batch"] for r in timed if r["method"] == "ddtree"}):
        at = [r for r in timed if r["batch"] == batch]
        best = max((r for r in at if r["method"] == "ddtree"), key=lambda r: r["tokens_per_second"])
        entry = {"budget": best["budget"], "tokens_per_second": best["tokens_per_second"]}
        for other in ("dflash", "ar"):
            speeds = [r["tokens_per_second"] for r in at if r["method"] == other]
            if speeds:
                entry[f"vs_{other}"] = round(best["tokens_per_second"] / max(speeds), 3)
        per_batch[batch] = entry
    if not per_batch:
        return None
    # batch sizes where plain decoding beats every measured budget: speculation does not pay there, and
    # the flag switches it off (budget 0)
    ar_faster = [batch for batch, e in per_batch.items() if e.get("vs_ar", 1.0) < 1.0]
    flag = ",".join(f"{batch}:{0 if batch in ar_faster else e['budget']}" for batch, e in per_batch.items())
    return {"flag": f"--budget {flag}", "per_batch": per_batch, "ar_faster_at": ar_faster}


def markdown(rows: list[dict], title: str) -> str:
    cols = [
        "method",
        "kernels",
        "budget",
        "batch",
        "graphs",
        "acceptance_length",
        "tokens_per_second",
        "ms_per_round",
        "phase_ms",
        "capture_seconds",
        "host_syncs_per_round",
        "peak_memory_GiB",
    ]
    lines = [f"### {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            if isinstance(v, dict):
                v = " / ".join(f"{k} {x}" for k, x in v.items())
            if c == "budget" and "policy" in r:
                v = f"{v} (`{r['policy']}`)"
            cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def phase_markdown(rows: list[dict]) -> str:
    """The per-phase tables of graph rows (round_profile.round_phases), one line per phase."""
    profiled = [r for r in rows if "phases" in r.get("graph_phases", {})]
    if not profiled:
        return ""
    lines = [
        "",
        "### Round phases under CUDA graphs (device time per replay, ms)",
        "",
        "A **round** line gives the graph replay, the host-timed round less the replay (what the host adds;",
        "below zero, the two timings' spread) and the round's floor.",
        "",
        "| method | budget | batch | phase | kernels | kernel ms | gaps ms | floor ms | heaviest kernel |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in profiled:
        p = r["graph_phases"]
        budget = f"{r['budget']} (`{r['policy']}`)" if "policy" in r else r["budget"]
        for name, ph in p["phases"].items():
            kernel, ms = ph["heaviest"][0][:2] if ph["heaviest"] else ("", 0)
            lines.append(
                f"| {r['method']} | {budget} | {r['batch']} | {name} | {ph['kernels']} | {ph['kernel_ms']} | "
                f"{ph['gap_ms']} | {ph['floor_ms']} | `{kernel[:48]}` {ms} |"
            )
        lines.append(
            f"| {r['method']} | {budget} | {r['batch']} | **round** | | {p['replay_ms']} (replay) | "
            f"{r.get('host_timed_minus_replay_ms', '')} (host timed − replay) | {p['floor_ms']} | |"
        )
    return "\n".join(lines) + "\n"


def run_bench(plan: BenchPlan, target, drafter, prompts, label: str, report: bool = True) -> dict:
    """Every measurement asked for by the plan; prints JSON lines and writes --out when `report` (under
    tensor parallelism every rank runs the same measurements in step, rank 0 reports)."""
    device = (
        torch.cuda.get_device_name() if target.lm_head.weight.is_cuda else f"cpu ({torch.get_num_threads()} threads)"
    )
    world = target.tp.world if target.tp else 1
    results: dict[str, Any] = {
        "label": label,
        "device": device,
        "torch": torch.__version__,
        "tensor_parallel": world,
        "rows": [],
    }

    def emit(record: dict) -> None:
        if report:
            print(json.dumps(record), flush=True)

    if plan.micro:
        results["micro"] = micro(target, plan.ctx, tuple(plan.kernel_variants))
        emit({"micro": results["micro"]})
    if plan.capture_all and drafter is not None:
        results["capture_all"] = {}
        for variant in plan.kernel_variants:
            use_kernels(target, variant)
            results["capture_all"][variant] = capture_all(target, drafter, plan.ctx)
        emit({"capture_all": results["capture_all"]})
    rates = None
    if True in plan.graph_modes and target.lm_head.weight.is_cuda:  # the floors of round_profile's phase table
        rates = (copy_bandwidth(target.lm_head.weight.device), matmul_throughput(target.lm_head.weight.device))
        results["copy_bandwidth_GBps"] = round(rates[0] / 1e9, 1)
        results["matmul_TFLOPs"] = round(rates[1] / 1e12, 1)
        emit({"copy_bandwidth_GBps": results["copy_bandwidth_GBps"], "matmul_TFLOPs": results["matmul_TFLOPs"]})
    methods = []
    for m in plan.methods:
        if m == "ddtree":
            methods += [("ddtree", b) for b in plan.budgets] + [("ddtree", policy) for policy in plan.policies]
        else:
            methods.append((m, None))
    for batch in plan.batch_sizes:
        for method, budget in methods:
            for graphs in plan.graph_modes:
                if method != "ar" and drafter is None:
                    continue
                for variant in plan.kernel_variants:
                    use_kernels(target, variant)  # the Engine keeps an already fused target as it is
                    try:
                        row = run_config(
                            target,
                            drafter,
                            method,
                            budget,
                            batch,
                            prompts,
                            graphs,
                            plan.rounds,
                            profile_phases=True,
                            rates=rates,
                        )
                    except torch.OutOfMemoryError as exc:
                        row = {
                            "method": method,
                            "budget": budget,
                            "batch": batch,
                            "graphs": graphs,
                            "error": f"out of memory: {str(exc).splitlines()[0]}",
                        }
                        gc.collect()
                        torch.cuda.empty_cache()
                    row = {"method": row.pop("method"), "kernels": variant, **row}
                    results["rows"].append(row)
                    emit(row)
        if plan.hf_baseline:
            row = hf_baseline(target, batch, prompts, plan.rounds)
            results["rows"].append(row)
            emit(row)
    results["recommended_budget"] = recommend_budget(results["rows"])
    if results["recommended_budget"]:
        emit({"recommended_budget": results["recommended_budget"]})
    if plan.out and report:
        out = Path(plan.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(results, indent=1))
        md = markdown(results["rows"], label)
        best = results["recommended_budget"]
        if best:
            md += f"\nFastest `ddtree` budget per batch size: `{best['flag']}`\n"
            if best["ar_faster_at"]:
                md += (
                    "\n`ar` is faster than every measured `ddtree` budget at batch size "
                    + ", ".join(f"{b} ({best['per_batch'][b]['vs_ar']} ×)" for b in best["ar_faster_at"])
                    + ": the flag has budget 0 there (plain decoding)\n"
                )
        md += phase_markdown(results["rows"])
        (out / "bench.md").write_text(md)
    return results
