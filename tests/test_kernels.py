"""The Triton kernels (ddtree.runtime.kernels), and the fused modules that use them (ddtree.runtime.fused),
equal the reference forwards of ddtree.models.

On CPU they run under the Triton interpreter, which must be switched on (TRITON_INTERPRET=1) before
triton is imported: the checks marked `interp` (pytest marker `triton_interpreter`) run in their own
pytest process, `make test-triton-interpreter`, and are skipped anywhere else (conftest.py). The same
checks run compiled on a GPU (`gpu`).
Note the interpreter rounds fp32 -> bf16 toward zero where compiled Triton rounds to nearest, so the
bf16 tolerances allow a unit in the last place either way.
"""

import copy
import dataclasses
import functools
import inspect
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from ddtree.models.layers import MLP, KVCache, apply_rope
from ddtree.models.llama import Attention, ModelConfig, Transformer
from ddtree.runtime.fused import (
    FusedAttention,
    FusedMLP,
    TritonAttention,
    TritonDrafterAttention,
    TritonMLP,
    build_ddtree_triton,
    use_backend,
    use_drafter_backend,
)
from sm90 import compile_sm90, tool

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.triton_interpreter  # skipped unless TRITON_INTERPRET=1 (conftest.py)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton)")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


# ---- checks, parametrised by device --------------------------------------------------------------


def check_qk_norm_rope_kv(device, dtype, norm, T, heads, kv_heads, head_dim):
    from ddtree.runtime.kernels import qk_norm_rope_kv

    g = torch.Generator().manual_seed(T * 100 + heads * 10 + head_dim)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    bs, pool = 2, 3 * max(12, T + 4)  # room for T distinct slots per sequence
    # q, k, v as views of one fused projection output, as Attention.forward makes them
    qkv = rnd(bs, T, (heads + 2 * kv_heads) * head_dim)
    q, k, v = qkv.view(bs, T, -1, head_dim).split([heads, kv_heads, kv_heads], dim=2)
    angles = torch.rand(bs, T, head_dim // 2, generator=g) * 50
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    qw, kw = (rnd(head_dim), rnd(head_dim)) if norm else (None, None)
    # distinct physical slots, anywhere in the pool (duplicates would make the reference's index_put
    # order-dependent)
    slots = torch.randperm(pool, generator=g)[: bs * T].view(bs, T).to(device)
    ref_cache = KVCache(kv_heads, pool, head_dim, dtype, device, slot_map=torch.zeros(0, 0, dtype=torch.int32))
    ref_cache.k.copy_(rnd(*ref_cache.k.shape))  # not zeros: slots not addressed must keep these values
    ref_cache.v.copy_(rnd(*ref_cache.v.shape))
    k_cache, v_cache = ref_cache.k.clone(), ref_cache.v.clone()

    out = qk_norm_rope_kv(q, k, v, cos, sin, qw, kw, 1e-6, k_cache, v_cache, slots)

    # reference in fp32 from the same inputs (the kernel computes in fp32 and rounds once)
    f = lambda t: t.float()  # noqa: E731
    qr, kr = f(q), f(k)
    if norm:
        qr, kr = F.rms_norm(qr, (head_dim,), f(qw), 1e-6), F.rms_norm(kr, (head_dim,), f(kw), 1e-6)
    qr = apply_rope(qr.transpose(1, 2), f(cos), f(sin))
    kr = apply_rope(kr.transpose(1, 2), f(cos), f(sin))
    ref_cache.update(slots, kr.to(dtype), v.transpose(1, 2))
    assert out.shape == (bs, heads, T, head_dim) and out.is_contiguous() and out.dtype == dtype
    torch.testing.assert_close(f(out), qr, **TOL[dtype])
    torch.testing.assert_close(f(k_cache), f(ref_cache.k), **TOL[dtype])
    assert torch.equal(v_cache, ref_cache.v), "v is copied, not computed"
    # every slot not written keeps its old value, bit for bit
    written = torch.zeros(pool + 1, dtype=torch.bool, device=device)
    written[slots] = True
    assert torch.equal(k_cache[:, ~written], ref_cache.k[:, ~written])


def check_silu_mul(device, dtype, inter):
    from ddtree.runtime.kernels import silu_mul

    gate_up = torch.randn(2, 3, 2 * inter).to(device, dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    out = silu_mul(gate_up)
    assert out.shape == (2, 3, inter) and out.dtype == dtype
    torch.testing.assert_close(out.float(), F.silu(gate) * up, **TOL[dtype])


GEMV_CASES = [  # (N, K, silu_mul, bias, config): block-aligned and ragged, one and several K blocks
    (8, 32, False, False, (4, 16, 1, 1)),
    (10, 40, False, True, (4, 16, 1, 1)),
    (12, 48, True, False, (4, 16, 1, 1)),
    (7, 20, True, True, (8, 32, 1, 1)),
]


def check_gemv(device, dtype, n, k, silu_mul, bias, config):
    from ddtree.runtime.kernels import gemv

    g = torch.Generator().manual_seed(n * k)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)  # outputs of order 1 at any K
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    x = torch.randn(1, 1, 2 * k if silu_mul else k, generator=g).to(device, dtype)
    if silu_mul:  # the reference rounds silu(gate) * up to the model dtype, as silu_mul's output is
        gate, up = x.float().chunk(2, dim=-1)
        ref_in = (F.silu(gate) * up).to(dtype).float()
    else:
        ref_in = x.float()
    ref = F.linear(ref_in, w.float(), None if b is None else b.float())
    out = gemv(x, w, b, silu_mul=silu_mul, config=config)
    assert out.shape == (1, 1, n) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    with pytest.raises(AssertionError, match="one row"):
        gemv(torch.cat([x, x], dim=1), w, b, silu_mul=silu_mul, config=config)


SKINNY_CASES = [  # (rows, N, K, config, gate_up): tl.dot's 16-row minimum and ragged rows, K splits, silu(gate) * up
    (2, 32, 64, (16, 16, 1, 4, 2), False),
    (17, 48, 96, (16, 32, 3, 4, 2), False),
    (33, 32, 64, (32, 16, 2, 4, 3), False),
    (5, 48, 32, (16, 16, 1, 4, 2), True),
    (64, 32, 64, (32, 32, 1, 4, 2), True),
]


def check_skinny_linear(device, dtype, rows, n, k, config, gate_up):
    from ddtree.runtime.kernels import skinny_applies, skinny_linear

    g = torch.Generator().manual_seed(rows * n)
    w = (torch.randn(2 * n if gate_up else n, k, generator=g) / k**0.5).to(device, dtype)
    x = torch.randn(1, rows, k, generator=g).to(device, dtype)
    ref = F.linear(x.float(), w.float())
    if gate_up:  # gate and up rounded to the model dtype, as the unfused GEMM's output is
        gate, up = ref.to(dtype).float().chunk(2, dim=-1)
        ref = F.silu(gate) * up
    splits = config[2]
    # the interpreter truncates fp32 to bf16 where compiled Triton rounds: twice the rounding error
    tol = (
        dict(atol=1e-2, rtol=1e-2)
        if dtype == torch.float16
        else TOL[dtype]
        if device == "cuda"
        else dict(atol=4e-2, rtol=4e-2)
    )
    for tma in (True, False):  # loads through TMA descriptors, and through pointers
        out = skinny_linear(x, w, config, gate_up=gate_up, tma=tma)
        if splits > 1:  # unsummed fp32 partial products
            assert out.shape == (splits, 1, rows, n) and out.dtype == torch.float32
            out = out.sum(0)
        assert out.shape == (1, rows, n) and out.dtype == (dtype if splits == 1 else torch.float32)
        torch.testing.assert_close(out.float(), ref, **tol)
    assert not skinny_applies(1, n, k, config, dtype) and not skinny_applies(65, n, k, config, dtype)
    assert not skinny_applies(rows, n + 8, k, config, dtype) and not skinny_applies(rows, n, k, None, dtype)
    assert not skinny_applies(rows, n, k, config, torch.float32)  # 16-bit configurations only
    with pytest.raises(AssertionError):
        skinny_linear(x[:, :1], w, config, gate_up=gate_up)


WIDE_CASES = [  # (rows, N, K, config): a head tile of 64 or 128 rows and a tail of 16 to 128, ragged, K splits
    (65, 32, 64, (16, 16, 1, 4, 2)),
    (100, 48, 96, (16, 32, 3, 4, 2)),
    (144, 32, 64, (32, 16, 2, 4, 3)),
    (192, 32, 32, (32, 16, 1, 4, 2)),
]


def check_wide_linear(device, dtype, rows, n, k, config):
    from ddtree.runtime.kernels import wide_applies, wide_linear, wide_row_tiles

    g = torch.Generator().manual_seed(rows * n)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
    x = torch.randn(1, rows, k, generator=g).to(device, dtype)
    head, tail = wide_row_tiles(rows)
    assert head + tail >= rows and (head + tail // 2 < rows or tail == 16)  # the smallest tail that covers
    out = wide_linear(x, w, config)
    splits = config[2]
    if splits > 1:  # unsummed fp32 partial products
        assert out.shape == (splits, 1, rows, n) and out.dtype == torch.float32
        out = out.sum(0)
    assert out.shape == (1, rows, n) and out.dtype == (dtype if splits == 1 else torch.float32)
    tol = (
        dict(atol=1e-2, rtol=1e-2)
        if dtype == torch.float16
        else TOL[dtype]
        if device == "cuda"
        else dict(atol=4e-2, rtol=4e-2)
    )
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), **tol)
    assert not wide_applies(64, n, k, config, dtype) and not wide_applies(193, n, k, config, dtype)
    assert not wide_applies(rows, n + 8, k, config, dtype) and not wide_applies(rows, n, k, None, dtype)
    assert not wide_applies(rows, n, k, config, torch.float32)  # 16-bit configurations only
    with pytest.raises(AssertionError):
        wide_linear(x[:, :64], w, config)


def check_add_rms_norm(device, dtype, n):
    from ddtree.runtime.kernels import add_rms_norm

    x, r = torch.randn(2, 5, n).to(device, dtype), torch.randn(2, 5, n).to(device, dtype)
    w = (torch.rand(n) + 0.5).to(device, dtype)
    normed, res = add_rms_norm(x, r, w, 1e-6)
    total = x.float() + r.float()
    torch.testing.assert_close(res.float(), total, **TOL[dtype])
    # the norm reads the residual as stored (rounded to the model dtype), like the unfused path
    torch.testing.assert_close(normed.float(), F.rms_norm(res.float(), (n,), w.float(), 1e-6), **TOL[dtype])
    assert torch.equal(x, x.clone()) and normed.data_ptr() != x.data_ptr() != res.data_ptr()


def attention_masks(g: torch.Generator, bs: int, T: int, span: int, broadcast: bool, device) -> list[Tensor]:
    """[bs or 1, 1, T, span] masks for the attention kernels: random; the same cut at a live length per
    sequence, as in a graph's span bucket (whole key chunks that no row sees, which the kernels skip); and
    a verify's (committed text every query sees, then the tree's slots, then slots past it)."""
    mask = torch.rand(1 if broadcast else bs, 1, T, span, generator=g) < 0.6
    mask[..., 0] = True  # every query sees a key (as in the engine: itself at least)
    cut = mask.clone()
    for b in range(cut.shape[0]):
        cut[b, ..., 1 + b + span // 4 :] = False
    tree = mask.clone()
    for b in range(tree.shape[0]):
        tree[b, ..., : span // 2 + 3 * b + 5] = True
        tree[b, ..., span // 2 + 3 * b + 5 + T :] = False
    return [mask.to(device), cut.to(device), tree.to(device)]


def check_attention(device, dtype, cases, key_growth=0.0):
    """The chunked attention equals SDPA over the cache rows and span the mask selects, the rows' slots
    scattered over the physical pool by a random slot map. key_growth > 0 scales the keys by 1 + key_growth
    times their position, so that the rows' score maxima grow along the span, past the first key block."""
    from ddtree.runtime.kernels import attention

    g = torch.Generator().manual_seed(7)
    for bs, heads, kv_heads, T, hd, span, rows_given, broadcast in cases:
        max_batch, slots = bs + 1, span + 9
        pool = max_batch * slots + 5
        kc = torch.randn(kv_heads, pool, hd, generator=g).to(device, dtype)
        vc = torch.randn(kv_heads, pool, hd, generator=g).to(device, dtype)
        slot_map = torch.randperm(pool, generator=g)[: max_batch * slots].view(max_batch, slots)
        slot_map = slot_map.to(device, torch.int32)
        if key_growth:
            kc[:, slot_map[:, :span]] *= rising(span, key_growth, device, dtype)
        q = torch.randn(bs, heads, T, hd, generator=g).to(device, dtype)
        rows = torch.randperm(max_batch, generator=g)[:bs].to(device) if rows_given else None
        # chunks by attention_launch, then one chunk for every key (the output written without a combine)
        for m, chunk in itertools.product(attention_masks(g, bs, T, span, broadcast, device), (None, 2 * span)):
            out = attention(q, kc, vc, slot_map, m, rows, chunk=chunk)
            sel = rows if rows_given else torch.arange(bs, device=device)
            table = slot_map[sel, :span]
            ref = F.scaled_dot_product_attention(
                q.float(),
                kc[:, table].transpose(0, 1).float(),
                vc[:, table].transpose(0, 1).float(),
                attn_mask=m,
                enable_gqa=heads != kv_heads,
            )
            assert out.shape == (bs, T, heads * hd) and out.dtype == dtype
            torch.testing.assert_close(out.float(), ref.transpose(1, 2).reshape(bs, T, -1), **TOL[dtype])


def rising(span, key_growth, device, dtype):
    """[span, 1] factors 1 + key_growth * position, for keys whose scores grow along the span."""
    return (1 + key_growth * torch.arange(span, dtype=torch.float32))[:, None].to(device, dtype)


def check_latent_attention(device, dtype, cases, key_growth=0.0):
    """MLA's kernel equals SDPA of every head over the latents the mask selects (keys: compressed kv and
    RoPE key; values: the compressed kv), the rows' slots scattered over the pool by a random slot map.
    key_growth as in check_attention."""
    from ddtree.runtime.mla_kernels import latent_attention

    g = torch.Generator().manual_seed(11)
    for bs, heads, T, rank, rope, span, rows_given, broadcast in cases:
        max_batch, slots = bs + 1, span + 9
        pool = max_batch * slots + 5
        latent = torch.randn(pool, rank + rope, generator=g).to(device, dtype)
        slot_map = torch.randperm(pool, generator=g)[: max_batch * slots].view(max_batch, slots)
        slot_map = slot_map.to(device, torch.int32)
        if key_growth:
            latent[slot_map[:, :span], rank:] *= rising(span, key_growth, device, dtype)  # RoPE keys, not values
        q = torch.randn(bs, heads, T, rank + rope, generator=g).to(device, dtype)
        rows = torch.randperm(max_batch, generator=g)[:bs].to(device) if rows_given else None
        scale = 0.7 * (rank + rope) ** -0.5  # not the kernel's default: YaRN's mscale changes it
        # the default chunks, short ones (more splits to merge), and one chunk for every key
        for m, chunk in itertools.product(attention_masks(g, bs, T, span, broadcast, device), (None, 32, 2 * span)):
            out = latent_attention(q, latent, slot_map, m, rows, rank, scale, chunk=chunk)
            sel = rows if rows_given else torch.arange(bs, device=device)
            keys = latent[slot_map[sel, :span]].float()[:, None]  # [bs, 1, span, rank + rope]
            ref = F.scaled_dot_product_attention(
                q.float(), keys, keys[..., :rank], attn_mask=m, scale=scale, enable_gqa=True
            )
            assert out.shape == (bs, T, heads, rank) and out.dtype == dtype
            torch.testing.assert_close(out.float(), ref.transpose(1, 2), **TOL[dtype])


def check_latent_rope_cache(device, dtype, cases):
    """TritonLatentAttention's rotate-and-cache step (mla_kernels.latent_rope_cache) writes the reference's
    latents at the tokens' slots and returns its absorbed queries, with and without interleaved RoPE."""
    from ddtree.models import deepseek_v3
    from ddtree.models.layers import rope_cos_sin, rope_inv_freq
    from ddtree.runtime.fused import TritonLatentAttention, swap

    for heads, nope, rope, rank, T, interleave in cases:
        torch.manual_seed(heads + T)
        cfg = deepseek_v3.ModelConfig(
            vocab_size=32,
            hidden_size=64,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=heads,
            q_lora_rank=None,
            kv_lora_rank=rank,
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=16,
            n_routed_experts=2,
            n_shared_experts=1,
            num_experts_per_tok=1,
            first_k_dense_replace=1,
            routed_scaling_factor=1.0,
            rope_interleave=interleave,
        )
        attn = deepseek_v3.Attention(cfg)
        with torch.no_grad():
            for p in attn.parameters():
                p.normal_(1.0 if p.dim() == 1 else 0.0, 0.3)
        attn = attn.to(device, dtype)
        bs = 2
        pool = bs * T + 7
        q = torch.randn(bs, T, heads, nope + rope).to(device, dtype)
        kv = torch.randn(bs, T, rank + rope).to(device, dtype)
        positions = torch.randint(0, 500, (bs, T)).to(device)
        cos, sin = rope_cos_sin(rope_inv_freq(rope, 10000.0, None).to(device), positions, dtype, 1.1)
        slots = torch.randperm(pool)[: bs * T].view(bs, T).to(device)
        caches = []
        for cls in (deepseek_v3.Attention, TritonLatentAttention):
            swap(attn, cls)
            attn.cache = deepseek_v3.LatentCache(torch.zeros(pool + 1, rank + rope, device=device, dtype=dtype), None)
            with torch.no_grad():
                out = attn.rotate_and_cache(q, kv, cos, sin, slots, None)
            caches.append((out, attn.cache.latent))
        (ref, ref_cache), (got, got_cache) = caches
        assert got.shape == (bs, heads, T, rank + rope) and got.dtype == dtype
        torch.testing.assert_close(got, ref, **TOL[dtype])
        torch.testing.assert_close(got_cache, ref_cache, **TOL[dtype])
        untouched = torch.ones(pool + 1, dtype=torch.bool, device=device)
        untouched[slots.flatten()] = False
        assert not got_cache[untouched].any()


def check_mask_bounds(device):
    """Per sequence, one past the last slot any query sees and the leading slots every query sees: masks
    that end early, all-False ones, a verify's (a prefix all queries see, then the tree), broadcast over
    the batch, one query and more queries than a row tile holds."""
    from ddtree.runtime.kernels import mask_bounds

    def want(mask: Tensor) -> list[list[int]]:
        out = []
        for m in mask[:, 0]:
            seen_by_any, seen_by_all = m.any(0).tolist(), m.all(0).tolist()
            end = max((j + 1 for j, s in enumerate(seen_by_any) if s), default=0)
            out.append([end, next((j for j, s in enumerate(seen_by_all) if not s), len(seen_by_all))])
        return out

    g = torch.Generator().manual_seed(3)
    for bs, T, span in ((3, 33, 1100), (2, 1, 300), (1, 130, 9000), (4, 9, 17)):
        mask = torch.rand(bs, 1, T, span, generator=g) < 0.2
        for b in range(bs):
            mask[b, ..., : (b * 331) % span] = True  # a prefix every query sees (none for sequence 0)
            mask[b, ..., (b * 997) % span :] = False  # sequence 0 sees nothing
        assert mask_bounds(mask.to(device)).tolist() == want(mask), (bs, T, span)
        row = mask[1:2] if bs > 1 else mask
        assert mask_bounds(row.to(device).expand(bs, 1, T, span)).tolist() == want(row) * bs


def check_move_slots(device, dtype):
    """One launch moves an accepted path's cache slots as the models' gather-then-scatter `compact` does:
    paths whose slots overlap their destinations, the latent layout (one head, a width past the column
    block) and rows whose paths differ, each row's slots scattered over the pool."""
    from ddtree.runtime.kernels import move_slots

    g = torch.Generator().manual_seed(7)
    for planes, batch, heads, slots, width, n in ((6, 3, 2, 40, 16, 5), (3, 2, 1, 30, 576, 9), (2, 4, 8, 70, 128, 16)):
        pool = batch * slots
        storage = torch.randn(planes, heads, pool, width, generator=g).to(dtype)
        slot_map = torch.randperm(pool, generator=g).view(batch, slots)  # disjoint rows
        bs = batch - 1  # the last row is not moved
        lengths = torch.randint(0, slots - 3 * n, (bs, 1), generator=g)
        # a tree path: node indices from the root, non-decreasing, each at least its depth, so that
        # node k's slot is often the destination of a later step
        steps = torch.arange(n)
        path = torch.maximum(torch.sort(torch.randint(0, 2 * n, (bs, n), generator=g), dim=1).values, steps)
        path[:, 0] = 0
        src, dst = slot_map[:bs].gather(1, lengths + path), slot_map[:bs].gather(1, lengths + steps)
        want = storage.clone()
        want[:, :, dst] = want[:, :, src]
        got = storage.to(device)
        move_slots(got, src.to(device), dst.to(device))
        assert torch.equal(got.cpu(), want), (planes, batch, heads, slots, width, n)


def check_row_logsumexp(device, dtype):
    """fp32 logsumexp of each row in one pass, from logits of the draft's dtype: rows longer than a block
    and not a multiple of it, large logits (a probability-one row) and -inf entries."""
    from ddtree.runtime.kernels import row_logsumexp

    g = torch.Generator().manual_seed(5)
    for shape in ((3, 15, 151936), (2, 1, 5000), (4, 33), (1, 1, 7)):
        x = (torch.randn(*shape, generator=g) * 4).to(dtype)
        x.view(-1, shape[-1])[0, 3] = 200.0
        x.view(-1, shape[-1])[-1, : shape[-1] // 2] = float("-inf")
        got = row_logsumexp(x.to(device)).cpu()
        assert got.shape == shape[:-1] and got.dtype == torch.float32
        torch.testing.assert_close(got, torch.logsumexp(x.float(), dim=-1), atol=2e-5, rtol=2e-6)


def top_logprobs_reference(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Each row's k largest fp64 log_softmax values of its fp32 values, equal values lower index first."""
    x = x.float()
    ids = torch.sort(-x, dim=-1, stable=True).indices[..., :k]
    return torch.log_softmax(x.double(), dim=-1).gather(-1, ids).float(), ids


def check_row_top_logprobs(device, dtype):
    """Each row's top-k log-probabilities and ids from logits of the draft's dtype: rows shorter than a
    chunk and not a multiple of it, k from 1 to 64 (row_top_applies' largest; up to V), a row of many
    exact ties (lower index first), a probability-one row (one logit 200) and a half -inf row; each
    chunk's top k from its runs' maxima (the default run length, and runs of 2, so that equal maxima
    abound) and from a sort of the whole chunk."""
    from ddtree.runtime.kernels import row_top_logprobs

    g = torch.Generator().manual_seed(5)
    for shape, ks in (
        ((1, 2, 151936), (8, 64)),
        ((3, 5000), (1, 5, 32, 64)),
        ((4, 33), (1, 5, 32, 33)),
        ((3, 7), (1, 5, 7)),
    ):
        x = (torch.randn(*shape, generator=g) * 4).to(dtype)
        rows = x.view(-1, shape[-1])
        rows[0, 3] = 200.0
        rows[1] = rows[1].round()  # integers: a few dozen distinct values, ties at every length
        rows[-1, : shape[-1] // 2] = float("-inf")
        for k, group in itertools.product(ks, (None, 2, 1)):
            kp = max(2, 1 << (k - 1).bit_length())
            if group == 2 and min(4096, 1 << (shape[-1] - 1).bit_length()) < 2 * kp:
                continue  # the chunk has fewer runs of 2 than k
            lp, ids = row_top_logprobs(x.to(device), k, group=group)
            want_lp, want_ids = top_logprobs_reference(x, k)
            assert lp.shape == ids.shape == (*shape[:-1], k) and lp.dtype == torch.float32 and ids.dtype == torch.int64
            assert torch.equal(ids.cpu(), want_ids), (shape, k, group)
            torch.testing.assert_close(lp.cpu(), want_lp, atol=2e-5, rtol=2e-6)


def check_row_argmax(device, dtype):
    """Each row's argmax in one read equals torch's (the first of equal values): vocabularies shorter than
    a chunk and not a multiple of it, a row of many exact ties, an all -inf row, the largest value in the
    last chunk; and the first row of each group's largest value."""
    from ddtree.runtime.kernels import row_argmax

    g = torch.Generator().manual_seed(9)
    for shape, chunk in (((2, 3, 151936), 4096), ((3, 2, 5000), 256), ((2, 4, 33), 4096), ((1, 5, 7), 4096)):
        x = (torch.randn(*shape, generator=g) * 4).to(dtype)
        rows = x.view(-1, shape[-1])
        rows[1] = rows[1].round()  # integers: ties between chunks and inside them
        rows[2] = float("-inf")
        rows[-1, -1] = 50.0  # in the last, partial chunk
        assert torch.equal(row_argmax(x.to(device), chunk=chunk).cpu(), x.argmax(-1)), shape
        first_max = torch.full(shape[:1], -1.0, device=device)
        got = row_argmax(x.to(device), first_max, chunk=chunk)
        assert got.dtype == torch.int64 and torch.equal(got.cpu(), x.argmax(-1)), shape
        assert torch.equal(first_max.cpu(), x[:, 0].amax(-1).float()), shape


def check_walk(device):
    """The one-launch walk equals verify.walk field for field: DDTree trees with padding (fewer prefixes
    than the budget), one of them cut by Tree.prefix (strided views), chains (dflash), the root alone
    (ar), decisions that mostly follow the tree, and a max_depth past the tree's depth."""
    from ddtree.runtime.kernels import walk as walk_kernel
    from ddtree.speculative.tree import build_chain, build_ddtree, root_only
    from ddtree.speculative.verify import walk

    g = torch.Generator().manual_seed(11)
    roots = torch.tensor([3, 1, 4, 1, 5])
    trees = []
    for vocab, depth, budget in ((3, 6, 4), (4, 6, 40), (50, 15, 32), (7, 4, 130)):
        tree = build_ddtree(roots, torch.randn(5, depth, vocab, generator=g) * 3, budget)
        trees += [(tree, depth + 2), (tree.prefix(budget // 2 + 1), depth)]
    trees += [
        (build_chain(roots, torch.randn(5, 15, 9, generator=g)), 15),
        (root_only(roots), 0),
        (root_only(roots), 3),
    ]
    for case, (tree, max_depth) in enumerate(trees):
        vocab = int(tree.tokens.max()) + 2
        decisions = torch.randint(0, vocab, tree.tokens.shape, generator=g)
        follow = torch.rand(tree.tokens.shape, generator=g) < 0.8
        for r in range(tree.tokens.shape[0]):
            for i in range(tree.size):
                kids = [j for j in range(tree.size) if tree.valid[r, j] and tree.parents[r, j] == i]
                if kids and follow[r, i]:
                    decisions[r, i] = tree.tokens[r, kids[-1]]
        want = walk(tree, decisions, max_depth)
        t = [x.to(device) for x in (tree.tokens, tree.parents, tree.depth, tree.valid, tree.visible, decisions)]
        got = walk_kernel(*t, max_depth)
        for field, value in zip(("path", "accepted", "bonus", "emitted"), got):
            assert torch.equal(value.cpu(), getattr(want, field)), (case, field)


def check_commit_path(device):
    """The one-launch bookkeeping of a walk equals the round's tensor ops: lengths advance on active rows
    only, bonus, readout (accepted, then emitted; the forecast columns past them untouched) and the staged
    count, and the physical slots of the path and of its destinations through the slot map (an inactive
    row's all the trash slot), with and without moves and staging."""
    from ddtree.runtime.kernels import commit_path

    g = torch.Generator().manual_seed(13)
    bs, d1, slots = 4, 6, 40
    slot_map = torch.randperm((bs + 1) * (slots + 1), generator=g).view(bs + 1, slots + 1).int()  # one row spare
    trash = slots
    for moves, staged in itertools.product((False, True), (False, True)):
        path = torch.sort(torch.randint(0, 12, (bs, d1), generator=g), dim=1).values
        path[:, 0] = 0
        accepted = torch.randint(1, d1 + 1, (bs,), generator=g)
        bonus, emitted = torch.randint(0, 99, (bs,), generator=g), torch.randint(0, 99, (bs, d1), generator=g)
        lengths = torch.randint(0, slots - 12, (bs,), generator=g)
        active = torch.tensor([True, False, True, True])
        readout = torch.randint(0, 99, (bs, d1 + 3), generator=g)
        ctx_count = torch.full((bs,), -1)
        bonus_out = torch.full((bs,), -1)
        want_readout = readout.clone()
        want_readout[:, 0], want_readout[:, 1 : d1 + 1] = accepted, emitted
        live = active[:, None]
        want_src = slot_map[:bs].gather(1, torch.where(live, lengths[:, None] + path, trash))
        want_dst = slot_map[:bs].gather(1, torch.where(live, lengths[:, None] + torch.arange(d1), trash))
        want_lengths = torch.where(active, lengths + accepted, lengths)
        on = [t.to(device) for t in (lengths, readout, ctx_count, bonus_out)]
        moved = commit_path(
            *(t.to(device) for t in (path, accepted, bonus, emitted)),
            on[0],
            active.to(device),
            slot_map.to(device),
            trash,
            on[3],
            on[1],
            on[2] if staged else None,
            moves,
        )
        case = (moves, staged)
        assert torch.equal(on[0].cpu(), want_lengths), case
        assert torch.equal(on[1].cpu(), want_readout), case
        assert torch.equal(on[2].cpu(), accepted if staged else ctx_count), case
        assert torch.equal(on[3].cpu(), bonus), case
        if moves:
            assert moved is not None and torch.equal(moved[0].cpu(), want_src) and torch.equal(moved[1].cpu(), want_dst)
        else:
            assert moved is None


ATTENTION_CASES = [  # (bs, heads, kv_heads, T, head_dim, span, rows given, mask broadcast over the batch)
    (2, 4, 2, 5, 16, 200, False, False),
    (1, 4, 1, 33, 12, 130, False, True),
    (3, 2, 2, 1, 16, 64, True, False),
    (2, 8, 2, 1, 16, 100, True, False),
    (1, 8, 2, 16, 16, 150, False, True),  # 4 heads a KV head: 4 and 64 rows
    (1, 2, 1, 130, 16, 260, True, False),  # 5 blocks of rows (B = 129)
    (1, 4, 1, 9, 16, 300, False, False),  # few row programs: chunks of 64, most unseen once cut
    (2, 6, 2, 33, 16, 140, True, False),  # 3 heads a KV head (SmolLM2): a token's heads across two row blocks
]


def check_best_first_tree(device):
    """The one-launch tree equals the tensorised top-B (as sets of token paths) with the same structure
    rules; includes padding (fewer prefixes than the budget) and probability-one rows (score ties); with
    B < D, the tree from the first B rows is the same tree (Engine.draft_depth)."""
    from ddtree.speculative.tree import ancestor_mask, build_ddtree
    from test_tree import brute_force_top_b, check_structure, tree_paths

    cases = [(2, 3, 10), (3, 2, 4), (1, 4, 7), (4, 3, 40), (15, 50, 32), (15, 300, 128), (15, 50, 6)]  # (D, V, B)
    for case, (depth, vocab, budget) in enumerate(cases):
        g = torch.Generator().manual_seed(case)
        logits = torch.randn(3, depth, vocab, generator=g) * 2
        if depth > 4:
            logits[1, ::2, 3] = 200.0  # probability 1 in fp32: a child ties its parent's score
        logits = logits.to(device)
        roots = torch.tensor([5, 6, 7], device=device)
        ref = build_ddtree(roots, logits, budget)
        got = build_ddtree_triton(roots, logits, budget)
        assert got.tokens.shape == (3, budget + 1) and got.visible.shape == (3, budget + 1, budget + 1)
        if budget < depth:
            shallow = build_ddtree_triton(roots, logits[:, :budget], budget)
            for field in ("tokens", "parents", "depth", "valid", "visible", "scores"):
                assert torch.equal(getattr(shallow, field), getattr(got, field)), (case, field)
        got = type(got)(*(t.cpu() for t in (got.tokens, got.parents, got.depth, got.valid, got.visible, got.scores)))
        assert torch.equal(got.valid, ref.valid.cpu()), case
        # both best first: the same path scores in the same (non-increasing) order, padding -inf
        torch.testing.assert_close(got.scores, ref.scores.cpu(), atol=1e-4, rtol=1e-5)
        assert torch.all(got.scores[:, 2:] <= got.scores[:, 1:-1]), case
        for row in range(3):
            check_structure(got, row)
            assert set(tree_paths(got, row)) == set(tree_paths(ref, row)), (case, row)
            if vocab**depth <= 4000:
                logp = torch.log_softmax(logits[row].cpu().double(), -1)
                assert set(tree_paths(got, row)) == brute_force_top_b(logp, budget)
        valid = got.valid[:, :, None] & got.valid[:, None, :]
        eye = torch.eye(budget + 1, dtype=torch.bool)
        assert torch.equal(got.visible, torch.where(valid, ancestor_mask(got.parents.clamp(min=-1)), eye)), case
        assert got.tokens[:, 0].tolist() == [5, 6, 7] and got.parents[:, 0].tolist() == [-1] * 3


def tiny_qwen3(seed=0, qk_norm=True, bias=True, layers=3) -> Transformer:
    """Qwen3-like (q/k norm, GQA) with q/k/v biases (Qwen2), so every branch of the kernels is used."""
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        qk_norm=qk_norm,
        attention_bias=bias,
        model_type="qwen3" if qk_norm else "qwen2",
    )
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.3)
    return model.eval()


def run_model(model, kernels: bool):
    """A prefill of two sequences into cache rows 0, 1, then one decode step of both with the rows
    given in reverse order and the taps of two layers, then one of the first alone. Returns (logits,
    one-sequence logits, taps, k cache, v cache)."""
    use_backend(model, "triton" if kernels else "torch")
    dev = model.lm_head.weight.device
    model.setup_caches(max_batch=2, max_slots=16)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=g).to(dev)
    j = torch.arange(7, device=dev)
    causal = (j[:, None] >= j[None, :])[None, None].expand(2, 1, 7, 7)
    with torch.no_grad():
        prefill, _ = model(ids, j.expand(2, -1), j.expand(2, -1), causal, tap_layers=(0,))
        rows = torch.tensor([1, 0], device=dev)
        pos = torch.tensor([[7], [7]], device=dev)
        mask = torch.ones(2, 1, 1, 8, dtype=torch.bool, device=dev)
        step, taps = model(ids[:, :1], pos, pos, mask, tap_layers=(2, 0), rows=rows)
        # one sequence, one token: the batch-1 decode step (the kernels' one-row GEMVs)
        single, _ = model(
            ids[:1, 1:2], pos[:1] + 1, pos[:1] + 1, torch.ones(1, 1, 1, 9, dtype=torch.bool, device=dev), rows=rows[1:]
        )
    caches = [
        torch.stack([layer.self_attn.kv_cache.k for layer in model.model.layers]),
        torch.stack([layer.self_attn.kv_cache.v for layer in model.model.layers]),
    ]
    return torch.cat([prefill, step], dim=1), single, taps, *caches


def check_model(device, dtype, qk_norm):
    model = tiny_qwen3(qk_norm=qk_norm, bias=not qk_norm).to(device, dtype)
    ref = run_model(model, kernels=False)
    got = run_model(model, kernels=True)
    if dtype == torch.float32:
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        return
    # bf16: the two paths round at different points (the kernels compute in fp32 and round once), so
    # compare both with an fp32 run of the same weights: the kernels must be no less accurate than torch
    # (relative Frobenius error; the interpreter truncates to bf16 where compiled Triton rounds, hence 2.5x;
    # 3.5x for the taps, whose last layer is the final norm's output, where truncation costs most)
    exact = run_model(copy.deepcopy(model).float(), kernels=False)
    for name, a, b, x in zip(("logits", "one-row logits", "taps", "k cache", "v cache"), got, ref, exact):
        err_kernels, err_torch = ((t.float() - x).norm().item() / x.norm().item() for t in (a, b))
        slack = 3.5 if name == "taps" else 2.5
        assert err_kernels <= min(slack * err_torch, 0.05), (name, err_kernels, err_torch)


# ---- under the interpreter (CPU) -----------------------------------------------------------------

QK_CASES = [  # (T, heads, kv_heads, head_dim): decode and verify widths, GQA and MHA, a half of 6 (masked)
    (1, 4, 2, 16),
    (5, 4, 2, 16),
    (3, 2, 2, 12),
    (4, 6, 2, 8),
]


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("T,heads,kv_heads,head_dim", QK_CASES)
def test_qk_norm_rope_kv(dtype, norm, T, heads, kv_heads, head_dim):
    check_qk_norm_rope_kv("cpu", dtype, norm, T, heads, kv_heads, head_dim)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [20, 1500])  # 1500: two column blocks, the second masked
def test_silu_mul(dtype, inter):
    check_silu_mul("cpu", dtype, inter)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", GEMV_CASES)
def test_gemv(dtype, case):
    check_gemv("cpu", dtype, *case)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [48, 300])
def test_add_rms_norm(dtype, n):
    check_add_rms_norm("cpu", dtype, n)


@interp
@pytest.mark.parametrize("qk_norm", [True, False])
def test_model_with_kernels_equals_without(qk_norm):
    check_model("cpu", torch.float32, qk_norm)
    check_model("cpu", torch.bfloat16, qk_norm)


# skinny_linear configurations the tiny models' q/k/v (96 x 48), o (48 x 48) and gate/up (80 x 48) fit; the
# shipped ones are for the 8B shape, so that test_model_with_kernels_equals_without leaves these projections on torch
TINY_SKINNY = {
    "qkv": (32, 16, 1, 4, 2),
    "o": (16, 16, 3, 4, 2),
    "gate_up": (16, 16, 1, 4, 2),
    "down": (16, 16, 5, 4, 2),
}


def use_skinny(monkeypatch, configs: dict) -> None:
    """skinny_linear configurations of the q/k/v, o, gate/up and down projections (a missing one: cuBLAS)."""
    monkeypatch.setattr(TritonAttention, "qkv_skinny", configs.get("qkv"))
    monkeypatch.setattr(TritonAttention, "o_skinny", configs.get("o"))
    monkeypatch.setattr(TritonMLP, "gate_up_skinny", configs.get("gate_up"))
    monkeypatch.setattr(TritonMLP, "down_skinny", configs.get("down"))


@interp
@pytest.mark.parametrize("o_splits", [1, 3])
def test_model_with_kernels_and_skinny_linear(monkeypatch, o_splits):
    """o and down (as K-split partial products summed by add_rms_norm, or whole) and gate/up with silu_mul
    through kernels.skinny_linear on the prefill (14 rows) and the batch-2 decode step (2 rows); bf16 only."""
    from ddtree.runtime import kernels

    down = (16, 16, 5, 4, 2) if o_splits > 1 else (16, 16, 1, 2, 2)  # not the same as o
    use_skinny(monkeypatch, {**TINY_SKINNY, "o": (16, 16, o_splits, 4, 2), "down": down})
    skinny, configs = kernels.skinny_linear, []
    monkeypatch.setattr(
        kernels, "skinny_linear", lambda x, w, config, **kw: configs.append(config) or skinny(x, w, config, **kw)
    )
    check_model("cpu", torch.bfloat16, qk_norm=True)
    check_model("cpu", torch.bfloat16, qk_norm=False)
    assert down in configs  # down went through the kernel
    assert TINY_SKINNY["qkv"] in configs  # and q/k/v (the model without q/k/v biases)


@interp
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", SKINNY_CASES)
def test_skinny_linear(dtype, case):
    check_skinny_linear("cpu", dtype, *case)


@interp
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", WIDE_CASES)
def test_wide_linear(dtype, case):
    check_wide_linear("cpu", dtype, *case)


def use_wide(monkeypatch, down: tuple[int, int, int, int, int]) -> list:
    """wide_linear for the down projection with `down`, serving from 2 rows, so that the tiny models'
    forwards (2-14 rows) go through it; skinny_linear off. Returns the list of configurations it ran with."""
    from ddtree.runtime import kernels

    use_skinny(monkeypatch, {})
    monkeypatch.setattr(kernels, "WIDE_MIN_ROWS", 2)
    monkeypatch.setattr(TritonMLP, "down_wide", down)
    wide, configs = kernels.wide_linear, []
    monkeypatch.setattr(kernels, "wide_linear", lambda x, w, config: configs.append(config) or wide(x, w, config))
    return configs


@interp
@pytest.mark.parametrize("splits", [1, 5])
def test_model_with_kernels_and_wide_linear(monkeypatch, splits):
    """down through kernels.wide_linear, as K-split partial products that add_rms_norm sums or whole, on the
    prefill (14 rows) and the batch-2 decode step (2 rows); bf16 only."""
    configs = use_wide(monkeypatch, (16, 16, splits, 4, 2))
    check_model("cpu", torch.bfloat16, qk_norm=True)
    check_model("cpu", torch.bfloat16, qk_norm=False)
    assert configs.count((16, 16, splits, 4, 2)) == 2 * 2 * 3  # two forwards of 2+ rows, both models, 3 layers


@interp
def test_model_with_kernels_through_sdpa_over_gathered_keys(monkeypatch):
    """Forwards of more query tokens than TritonAttention.max_tokens (long prefill chunks) attend through
    SDPA over keys gathered by the slot map inside the kernels path; here every forward does."""
    monkeypatch.setattr(TritonAttention, "max_tokens", 0)
    check_model("cpu", torch.float32, qk_norm=True)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention(dtype):
    check_attention("cpu", dtype, ATTENTION_CASES)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_rising_scores(dtype):
    """Keys that grow along the span, so that the running maxima move by more than 2^8 after the first key
    block: the running sums' rescale there is exercised, and the output stays SDPA's."""
    check_attention("cpu", dtype, ATTENTION_CASES[:3], key_growth=0.2)


LATENT_CASES = [  # (bs, heads, T, kv_lora_rank, rope dims, span, rows given, mask broadcast over the batch)
    (2, 4, 5, 32, 16, 200, False, False),
    (1, 8, 33, 32, 16, 130, False, True),  # 264 rows: 17 tiles of 16
    (3, 16, 1, 64, 16, 64, True, False),  # decode steps
    (1, 3, 9, 48, 24, 300, True, False),  # a rank and RoPE width short of a power of two
    (2, 8, 1, 512, 64, 40, False, False),  # Kimi K2's latent over 8 ranks (8 heads each)
]


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_attention(dtype):
    check_latent_attention("cpu", dtype, LATENT_CASES)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_attention_over_rising_scores(dtype):
    """test_attention_over_rising_scores for MLA's kernel."""
    check_latent_attention("cpu", dtype, LATENT_CASES[:2], key_growth=0.2)


LATENT_ROPE_CASES = [  # (heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, T, interleaved RoPE)
    (4, 16, 16, 32, 5, True),
    (20, 8, 16, 48, 1, False),  # two programs of heads, the second 4 of 16; a rank short of a power of two
    (8, 128, 64, 512, 3, True),  # Kimi K2's sizes over 8 ranks
]


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_rope_cache(dtype):
    check_latent_rope_cache("cpu", dtype, LATENT_ROPE_CASES)


def test_latent_partials_fit_the_memory_plans_attention_workspace():
    """At Kimi K2's rank (512), for every launch shape of decode steps and trees, latent_attention's chunks
    are long enough that its partial sums take no more per key and row than the memory plan counts."""
    from ddtree.models.memory import ATTENTION_BYTES_PER_SCORE
    from ddtree.runtime.mla_kernels import latent_chunk

    pytest.importorskip("triton")
    for T, programs, span in itertools.product((1, 9, 33), (1, 17, 64, 136, 600), (1024, 262144)):
        assert 512 * 4 / latent_chunk(T, programs, span, 512) <= ATTENTION_BYTES_PER_SCORE, (T, programs, span)


@interp
def test_attention_sweeps_check_each_configuration(monkeypatch):
    """bench.latent_sweep and bench.attention_sweep (GPU tools) on CPU, their timer stubbed: every
    configuration runs and is checked against the default's output, and MLA's default against SDPA over
    the gathered latents."""
    from ddtree.runtime import bench

    monkeypatch.setattr(bench, "_device_ms", lambda fn: (fn(), 1.0)[1])
    (row,) = bench.latent_sweep("cpu", shapes=[(2, 3, 40, 300)], heads=(4,), block_ms=(16,), warps=(4,))
    assert row["gathered_sdpa_ms"] == row["default_ms"] == 1.0
    assert [(c["chunk"], c["block_n"]) for c in row["configs"]] == [(256, 16), (256, 32), (512, 16), (512, 32)]
    sweep = dict(shapes=[(1, 3, 40, 100)], max_rows=(16,), stages=(2,), block_ns=(32, 64), layers=2)
    (row,) = bench.attention_sweep("cpu", **sweep)
    assert [(c["chunk"], c["block_n"]) for c in row["configs"]] == [(64, 32), (64, 64), (128, 32), (128, 64)]
    assert row["default_ms"] == 0.5 and {c["ms"] for c in row["configs"]} == {0.5}  # a layer's share
    (row,) = bench.attention_sweep("cpu", **{**sweep, "round_like": True, "shapes": [(2, 5, 40, 96)]})
    assert row["round_like"] and len(row["configs"]) == 4


def test_the_round_like_attention_inputs_are_a_tree_and_a_page_permutation():
    """attention_sweep(round_like=True)'s inputs: each query token sees the context, itself and a chain of
    ancestors back to the root (each row of the tree part a parent's row plus itself), and the paged slot
    map is a permutation of the pool's slots that keeps 16-slot pages whole and the trash slot in place."""
    from ddtree.models.layers import identity_slot_map
    from ddtree.runtime import bench

    g = torch.Generator().manual_seed(0)
    batch, T, context, span = 3, 9, 20, 64
    mask = bench._tree_mask(bench._verify_mask(batch, T, context, span, "cpu"), context, g)
    tree = mask[0, 0, :, context : context + T]
    assert mask[:, 0, :, :context].all() and not mask[:, 0, :, context + T :].any()
    assert tree[0].tolist() == [True] + [False] * (T - 1)
    for i in range(1, T):
        parents = [p for p in range(i) if (tree[i] & ~tree[p]).sum() == 1 and tree[i, i] and (tree[p] <= tree[i]).all()]
        assert parents and tree[i, i + 1 :].sum() == 0, i
    table = bench._shuffled_pages(identity_slot_map(batch, span), span, g)
    slots = table[:, :span]
    assert sorted(slots.flatten().tolist()) == list(range(batch * span)) and (table[:, span] == batch * span).all()
    assert (slots.view(batch, -1, 16) - slots.view(batch, -1, 16)[..., :1] == torch.arange(16)).all()
    assert not torch.equal(slots, identity_slot_map(batch, span)[:, :span])


@interp
def test_int4_experts_sweep_checks_each_configuration(monkeypatch):
    """bench.int4_experts_sweep (a GPU tool) on CPU at a tiny MoE, its timer and bandwidth stubbed: every
    tile configuration of both GEMMs runs and is checked against the default's output."""
    from ddtree.runtime import bench

    monkeypatch.setattr(bench, "_device_ms", lambda fn: (fn(), 1.0)[1])
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: 1e9)
    sweep = dict(block_ns=(16, 32), warps=(4,), stages=(2,), experts=4, hidden=64, inter=32, top_k=2)
    rows = bench.int4_experts_sweep("cpu", tokens=(3,), **sweep)
    knobs = [(n, split, frag) for n in (16, 32) for split in (False, True) for frag in (False, True)]
    configs = [
        (r["gemm"], [(c["block_n"], c["split_columns"], c["fragment_order"]) for c in r["configs"]]) for r in rows
    ]
    assert configs == [
        ("gate_up", knobs),
        ("down", knobs),
    ]
    experts = rows[0]["experts_reached"]
    assert 2 <= experts <= 4 and rows[0]["bound_ms"] == round(experts * (2 * 32 * 8 * 4 + 2 * 32 * 2 * 2) / 1e6, 4)


@interp
def test_mask_bounds():
    check_mask_bounds("cpu")


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_move_slots(dtype):
    check_move_slots("cpu", dtype)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_logsumexp(dtype):
    check_row_logsumexp("cpu", dtype)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_top_logprobs(dtype):
    check_row_top_logprobs("cpu", dtype)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax(dtype):
    check_row_argmax("cpu", dtype)


@interp
def test_walk():
    check_walk("cpu")


@interp
def test_commit_path():
    check_commit_path("cpu")


@interp
def test_best_first_tree_kernel_equals_the_tensorised_tree():
    check_best_first_tree("cpu")


@interp
def test_engine_with_kernels_is_lossless():
    """ddtree and dflash rounds with the Triton kernels (tree kernel included) emit plain decoding's
    greedy tokens."""
    from ddtree.runtime.engine import Engine, SamplingParams
    from ddtree.speculative.drafter import DrafterConfig, init_drafter
    from tiny_models import random_target

    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    params = SamplingParams(max_new_tokens=8)
    target = random_target(seed=3)
    use_backend(target, "triton")
    expect = [r.token_ids for r in Engine(target, method="ar", max_batch_size=2).generate(prompts, params)]
    drafter = init_drafter(DrafterConfig.for_target(target.config, num_layers=1, block_size=8), seed=4)
    for method, budget in (("ddtree", 20), ("dflash", None)):
        engine = Engine(target, drafter, method=method, budget=budget, max_batch_size=2)
        assert [r.token_ids for r in engine.generate(prompts, params)] == expect, method


def run_drafter(
    kernels: bool, dtype: torch.dtype = torch.float32, layers: int = 2, window: int | None = None, prompt: int = 6
) -> tuple[Tensor, Tensor]:
    """A drafter's block output and its caches after a prompt's context append (prompt rows given) and a
    round (3 staged context rows, the last one padding sent to the trash slot, then a block of 4). With a
    window, the first layer is a causal sliding-window layer over it."""
    from ddtree.speculative.drafter import DrafterConfig, init_drafter
    from tiny_models import random_target

    target = random_target(seed=5)
    config = DrafterConfig.for_target(target.config, num_layers=layers, block_size=4)
    if window is not None:
        types = ["sliding_attention"] + ["full_attention"] * (layers - 1)
        config = dataclasses.replace(config, layer_types=types, sliding_window=window)
    drafter = init_drafter(config, seed=6)
    drafter = drafter.to(dtype)
    use_drafter_backend(drafter, "triton" if kernels else "torch")
    slots = prompt + 18  # the trash slot is the next one
    drafter.setup_caches(max_batch=3, max_slots=slots)
    g = torch.Generator().manual_seed(0)
    feat = torch.randn(2, prompt, drafter.fc.in_features, generator=g).to(dtype)
    j = torch.arange(prompt)
    with torch.no_grad():
        drafter.append_context(feat, j.expand(2, -1), j.expand(2, -1), rows=torch.tensor([2, 0]))
        ctx_pos = (prompt + torch.arange(3)).expand(2, -1)
        ctx_slots = torch.tensor([prompt, prompt + 1, slots]).expand(2, -1)
        block_pos = prompt + 2 + torch.arange(4).expand(2, -1)
        mask = torch.ones(2, 1, 4, prompt + 6, dtype=torch.bool)
        out = drafter(
            torch.randn(2, 4, target.config.hidden_size, generator=g).to(dtype),
            block_pos,
            block_pos,
            mask,
            torch.randn(2, 3, drafter.fc.in_features, generator=g).to(dtype),
            ctx_pos,
            ctx_slots,
        )
    caches = [
        torch.stack([torch.stack(layer.self_attn.kv_cache.row(r, slots)) for r in range(drafter.max_batch)])
        for layer in drafter.layers
    ]
    return out, torch.stack(caches)


@interp
@pytest.mark.parametrize("window,joint_rows", [(None, 64), (3, 64), (None, 0)])
def test_drafter_with_kernels_equals_without(monkeypatch, window, joint_rows):
    """The drafter's block forward and context append with the kernels (fused q/k/v, residual adds fused
    with the norms after them): outputs and caches as with the PyTorch path; with a sliding-window layer
    too, whose mask has its own bounds: the full layer's block sees the whole context, the windowed
    one's nothing of it before the window (key blocks of 16, so that the context spans two whole ones).
    The round's block and context rows (14) go through one q/k/v GEMM, or (joint_rows 0) two."""
    from ddtree.runtime import kernels

    monkeypatch.setattr(kernels, "attention", functools.partial(kernels.attention, block_n=16))
    monkeypatch.setattr(TritonDrafterAttention, "joint_rows", joint_rows)
    for a, b in zip(
        run_drafter(kernels=True, window=window, prompt=40), run_drafter(kernels=False, window=window, prompt=40)
    ):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@interp
def test_drafter_with_kernels_and_skinny_linear(monkeypatch):
    """bf16, o and down as K-split partial products (64 x 64 and 64 x 128: two splits) that the fused layer's
    add_rms_norm sums, and gate/up through skinny_linear: no less accurate than the PyTorch path against an
    fp32 run (as check_model)."""
    from ddtree.runtime import kernels

    use_skinny(monkeypatch, {**TINY_SKINNY, "o": (16, 16, 2, 4, 2), "down": (32, 16, 2, 4, 2)})
    skinny, configs = kernels.skinny_linear, []
    monkeypatch.setattr(
        kernels, "skinny_linear", lambda x, w, config, **kw: configs.append(config) or skinny(x, w, config, **kw)
    )
    exact = run_drafter(kernels=False)
    got, ref = run_drafter(True, torch.bfloat16), run_drafter(False, torch.bfloat16)
    assert configs.count((16, 16, 2, 4, 2)) == 2  # o of both layers went through the kernel
    assert configs.count((32, 16, 2, 4, 2)) == 2  # and down
    assert TINY_SKINNY["qkv"] in configs  # and q/k/v
    for name, a, b, x in zip(("block output", "caches"), got, ref, exact):
        err_kernels, err_torch = ((t.float() - x).norm().item() / x.norm().item() for t in (a, b))
        assert err_kernels <= min(2.5 * err_torch, 0.05), (name, err_kernels, err_torch)


@interp
def test_drafter_with_kernels_and_wide_linear(monkeypatch):
    """bf16, down through kernels.wide_linear as K-split partial products that the fused layer's
    add_rms_norm sums: no less accurate than the PyTorch path against an fp32 run (as check_model)."""
    configs = use_wide(monkeypatch, (16, 16, 2, 4, 2))
    exact = run_drafter(kernels=False)
    got, ref = run_drafter(True, torch.bfloat16), run_drafter(False, torch.bfloat16)
    assert configs.count((16, 16, 2, 4, 2)) == 2  # down of both layers went through the kernel
    for name, a, b, x in zip(("block output", "caches"), got, ref, exact):
        err_kernels, err_torch = ((t.float() - x).norm().item() / x.norm().item() for t in (a, b))
        assert err_kernels <= min(2.5 * err_torch, 0.05), (name, err_kernels, err_torch)


@interp
def test_switch_is_explicit_and_dropped_on_move():
    model = tiny_qwen3()
    assert model.backend == "reference"
    use_backend(model, "triton")
    layer = model.model.layers[0]
    assert (type(layer.self_attn), type(layer.mlp), model.backend) == (TritonAttention, TritonMLP, "triton")
    assert layer.mlp.partial_sums  # the fused layer adds up the down projection's K-split parts
    use_backend(model, "torch")
    assert (type(layer.self_attn), type(layer.mlp), model.backend) == (FusedAttention, FusedMLP, "torch")
    assert "partial_sums" not in vars(layer.mlp)
    use_backend(model, "triton")
    assert layer.mlp.partial_sums
    model.to(torch.float64)
    assert (type(layer.self_attn), type(layer.mlp), model.backend) == (Attention, MLP, "reference")


@interp
def test_bench_logit_difference_of_the_two_paths():
    from ddtree.models.random import random_model
    from ddtree.runtime.bench import logits_difference

    diff = logits_difference(random_model("tiny", "cpu", torch.float32), ctx=8, tokens=3)
    assert diff["max_abs_diff"] < 1e-4 and diff["argmax_agreement"] == 1.0, diff


# ---- everywhere --------------------------------------------------------------------------------


@pytest.mark.skipif(INTERPRETED, reason="checks the non-interpreted CPU refusal")
def test_kernels_on_cpu_are_refused_and_the_default_stays_pytorch():
    model = tiny_qwen3()
    with pytest.raises(RuntimeError, match="Triton kernels need"):
        use_backend(model, "triton")
    assert model.backend == "reference" and type(model.model.layers[0].self_attn) is Attention


@pytest.mark.skipif(INTERPRETED, reason="the CLI test runs once, outside the interpreter")
def test_bench_micro_kernels_flag_on_cpu():
    """`bench --micro --kernels` parses and runs its CPU (eager, PyTorch) path; triton is refused there."""
    base = [
        sys.executable,
        "-m",
        "ddtree",
        "bench",
        "--model",
        "random:tiny",
        "--device",
        "cpu",
        "--graphs",
        "off",
        "--micro",
        "--methods",
        "ar",
        "--batch-sizes",
        "1",
        "--ctx",
        "16",
        "--rounds",
        "1",
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    ok = subprocess.run(base + ["--kernels", "torch"], capture_output=True, text=True, env=env, timeout=300)
    assert ok.returncode == 0, ok.stderr
    micro = json.loads(ok.stdout.splitlines()[0])["micro"]
    assert micro["kernels"] == ["torch"] and set(micro["forward_ms"]["torch"]) == {"1", "17", "33", "65"}
    assert json.loads(ok.stdout.splitlines()[1])["kernels"] == "torch"
    bad = subprocess.run(base + ["--kernels", "both"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "--kernels both needs triton and a CUDA device" in bad.stderr, bad.stderr


@pytest.mark.skipif(INTERPRETED, reason="compiles, outside the interpreter")
def test_the_batch_16_verify_attention_fits_three_programs_an_sm(tmp_path):
    """The attention's launch for 33 tokens at batch 16 (32 keys a step, three stages, one chunk), with the
    argument values a round passes once the mask's rows are aligned (aligned_rows): few enough registers
    for three programs of 128 threads on an SM's 65,536, so that its 384 programs run in one wave of an
    H100's or H200's 132 SMs. With the mask strides of a 1505-slot span it took 220 (two an SM)."""
    from ddtree.runtime.kernels import _attention_partial_kernel as kernel

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = dict(H=32, GROUP=4, D=128, DIRECT=True, BLOCK_M=64, BLOCK_N=32, BLOCK_D=128, HAS_ROWS=False)
    consts |= dict(FP32_DOT=False, PRECISION="tf32", PDL=True)
    pointers = dict(map_ptr="*i32", mask_ptr="*i8", bounds_ptr="*i32", rows_ptr="*i8", acc_ptr="*fp32")
    pointers |= dict(ml_ptr="*fp32", scale="fp32")
    # a round's values (bench, random:qwen3-8b, batch 16, B=32): span 1505 padded to 1520 in the mask's rows
    values = dict(T=33, span=1505, SPLITS=1, ROW_BLOCKS=3, CHUNK=2048, q_sb=135168, q_sh=4224, q_st=128)
    values |= dict(k_sh=3113088, k_ss=128, v_sh=3113088, map_sb=1506, m_sb=50160, m_st=1520, m_ss=1)
    values |= dict(rows_s=0, o_sb=135168, o_st=4096, o_sh=128)
    types = {
        n: "constexpr" if n in consts else pointers.get(n, "*bf16" if n.endswith("_ptr") else "i32")
        for n in kernel.arg_names
    }
    for name, value in values.items():
        if value == 1:  # Triton specialises ints of 1 as constants
            types[name], consts[name] = "constexpr", 1
    divisible = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(kernel.arg_names)
        if types[n][0] == "*" or (types[n] == "i32" and values[n] % 16 == 0)
    }
    compiled = triton.compile(
        ASTSource(kernel, types, consts, divisible),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=4, num_stages=3),
    )
    ptx = tmp_path / "attention.ptx"
    ptx.write_text(compiled.asm["ptx"])
    report = subprocess.run(
        [str(tool("ptxas")), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", os.devnull], capture_output=True, text=True
    )
    registers = int(report.stderr.split(" registers")[0].split()[-1])  # "Used N registers, ..."
    assert registers * 128 * 3 <= 65536, registers


@pytest.mark.skipif(INTERPRETED, reason="compiles, outside the interpreter")
def test_kernels_compile_for_h200_without_a_gpu(tmp_path):
    """Ahead-of-time compilation to an sm_90 cubin (ptxas ships with triton): catches what the lenient
    interpreter lets through (types, constexpr branches), and checks bf16 stores round to nearest."""
    from ddtree.runtime import kernels as K
    from ddtree.runtime import mla_kernels as M

    def compile_(fn, dtype, ints, consts, warps, stages=3):
        return compile_sm90(fn, consts, ints, dtype, warps, stages)

    for dtype in ("bf16", "fp32"):
        for norm in (False, True):
            # n_heads 0: k and v only (the drafter's context append); whole tokens per program, or one head
            for n_heads, qh, kh, warps in ((32, 32, 8, 4), (0, 1, 8, 1), (32, 1, 1, 1)):
                compile_(
                    K._qk_norm_rope_kv_kernel,
                    dtype,
                    dict(slots_ptr="*i32", T="i32", eps="fp32"),
                    dict(N_HEADS=n_heads, N_KV=8, QH=qh, KH=kh, HALF=64, BLOCK=64, HAS_NORM=norm),
                    warps,
                )
        compile_(K._silu_mul_kernel, dtype, dict(inter="i32"), dict(BLOCK=1024), 4)
        for silu_mul in (False, True):
            for even in (False, True):
                compile_(
                    K._gemv_kernel,
                    dtype,
                    dict(N="i32", w_sn="i32"),
                    dict(K=4096, BLOCK_N=16, BLOCK_K=512, SILU_MUL=silu_mul, HAS_BIAS=not silu_mul, EVEN=even),
                    4,
                )
        for (splits, gate_up), tma in itertools.product(((1, True), (2, False)), (True, False)):
            descs = dict(w_desc=f"tensordesc<{dtype}[64, 128]>", x_desc=f"tensordesc<{dtype}[64, 128]>")
            compile_(
                K._skinny_linear_kernel,
                dtype,
                dict(out_ptr="*fp32" if splits > 1 else "*" + dtype, M="i32", up_rows="i32") | (descs if tma else {}),
                dict(
                    K_SPLIT=4096 // splits,
                    BLOCK_M=64,
                    BLOCK_N=64,
                    BLOCK_K=128,
                    STAGES=4,
                    GATE_UP=gate_up,
                    TMA=tma,
                    FP32_DOT=False,
                    PRECISION="ieee" if dtype == "fp32" else "tf32",
                )
                | ({} if tma else dict(w_desc=None, x_desc=None)),
                4,
            )
        for splits, tail in ((1, 16), (2, 64)):
            compile_(
                K._wide_linear_kernel,
                dtype,
                dict(out_ptr="*fp32" if splits > 1 else "*" + dtype, M="i32"),
                dict(
                    K_SPLIT=4096 // splits,
                    BLOCK_N=64,
                    BLOCK_K=64,
                    HEAD_M=128,
                    TAIL_M=tail,
                    FP32_DOT=False,
                    PRECISION="ieee" if dtype == "fp32" else "tf32",
                ),
                4,
            )
        compile_(K._add_rms_norm_kernel, dtype, dict(x_ptr="*fp32", N="i32", eps="fp32"), dict(BLOCK=4096, PARTS=2), 8)
        k = compile_(K._add_rms_norm_kernel, dtype, dict(N="i32", eps="fp32"), dict(BLOCK=4096, PARTS=1), 8)
        if dtype == "fp32":
            compile_(
                K._best_first_tree_kernel,
                dtype,
                dict(
                    top_tok_ptr="*i64",
                    roots_ptr="*i64",
                    tokens_ptr="*i64",
                    parents_ptr="*i64",
                    depth_ptr="*i64",
                    valid_ptr="*i8",
                    visible_ptr="*i8",
                    D="i32",
                    K="i32",
                    N="i32",
                ),
                dict(B=128, CAP=256, N_PAD=256),
                4,
            )
        compile_(K._row_logsumexp_kernel, dtype, dict(out_ptr="*fp32"), dict(N=151936, BLOCK=2048), 8)
        compile_(K._row_max_chunk_kernel, dtype, dict(max_ptr="*fp32", idx_ptr="*i32"), dict(V=151936, CHUNK=4096), 8)
        if dtype == "fp32":
            for first in (False, True):
                compile_(
                    K._row_max_merge_kernel,
                    dtype,
                    dict(idx_ptr="*i32", out_ptr="*i64", T="i32"),
                    dict(CHUNKS=38, C_PAD=64, FIRST=first),
                    1,
                )
        if dtype == "fp32":
            pointers = ("tok", "par", "dep", "dec", "path", "accepted", "bonus", "emitted")
            compile_(
                K._walk_kernel,
                dtype,
                {
                    **{f"{p}_ptr": "*i64" for p in pointers},
                    "valid_ptr": "*i8",
                    "vis_ptr": "*i8",
                    "N": "i32",
                    "D1": "i32",
                },
                dict(N_PAD=64, D_PAD=16),
                1,
            )
            for moves in (False, True):
                compile_(
                    K._commit_path_kernel,
                    dtype,
                    {
                        **{n: "*i64" for n in K._commit_path_kernel.arg_names if n.endswith("_ptr")},
                        **dict(active_ptr="*i8", slot_map_ptr="*i32", src_ptr="*i32", dst_ptr="*i32"),
                        **dict(trash="i32", D1="i32"),
                    },
                    dict(D_PAD=16, MOVES=moves, STAGED=True),
                    1,
                )
        kp = 32 if dtype == "bf16" else 64  # a usual budget's; row_top_applies' largest
        compile_(
            K._row_top_chunk_kernel,
            dtype,
            dict(keys_ptr="*i64", ml_ptr="*fp32"),
            dict(V=151936, CHUNK=4096, KP=kp, GROUP=K.row_top_group(4096, kp), KEY16=dtype == "bf16"),
            8,
        )
        if dtype == "fp32":
            compile_(
                K._row_top_merge_kernel,
                dtype,
                dict(keys_ptr="*i64", tok_ptr="*i64", K="i32"),
                dict(CHUNKS=38, C_PAD=64, KP=kp),
                8,
            )
        compile_(
            K._move_slots_kernel,
            dtype,
            dict(src_ptr="*i32", dst_ptr="*i32", n="i32"),
            dict(H=8, D=576, N_PAD=16, BLOCK_D=128),
            4,
        )
        compile_(
            K._mask_bounds_kernel,
            dtype,
            dict(mask_ptr="*i8", bounds_ptr="*i32", T="i32", span="i32"),
            dict(BLOCK_T=64, BLOCK_S=128),
            4,
        )
        for rows, direct in itertools.product((False, True), (False, True)):
            compile_(
                K._attention_partial_kernel,
                dtype,
                dict(
                    map_ptr="*i32",
                    mask_ptr="*i8",
                    bounds_ptr="*i32",
                    rows_ptr="*i64",
                    acc_ptr="*fp32",
                    ml_ptr="*fp32",
                    T="i32",
                    span="i32",
                    scale="fp32",
                    SPLITS="i32",
                    ROW_BLOCKS="i32",
                    CHUNK="i32",
                ),
                dict(
                    H=32,
                    GROUP=4,
                    D=128,
                    DIRECT=direct,
                    BLOCK_M=64,
                    BLOCK_N=64,
                    BLOCK_D=128,
                    HAS_ROWS=rows,
                    FP32_DOT=False,
                    PRECISION="ieee" if dtype == "fp32" else "tf32",
                ),
                4,
            )
        compile_(
            K._attention_combine_kernel,
            dtype,
            dict(acc_ptr="*fp32", ml_ptr="*fp32", T="i32", SPLITS="i32"),
            dict(H=32, D=128, S_PAD=16, BLOCK_D=128),
            2,
        )
        # MLA at Kimi K2's sizes (8 heads a rank under TP=8, 64 on one GPU), with latent_attention's
        # default tiles: its shared memory fits an H200's 227 KiB a block and ptxas takes it. (It spills
        # registers, as 32 keys a step on 4 warps do, and still ran 2x faster on an H200 than 16 keys on 8
        # warps, which do not: docs/engine.md, "Fused kernels".)
        tiles = inspect.signature(M.latent_attention).parameters
        block_m, block_n, warps, stages = (tiles[n].default for n in ("block_m", "block_n", "num_warps", "num_stages"))
        for heads, direct in ((8, False), (64, True)):
            latent = compile_(
                M._latent_attention_kernel,
                dtype,
                dict(
                    map_ptr="*i32",
                    mask_ptr="*i8",
                    bounds_ptr="*i32",
                    rows_ptr="*i64",
                    acc_ptr="*fp32",
                    ml_ptr="*fp32",
                    T="i32",
                    span="i32",
                    scale="fp32",
                    SPLITS="i32",
                    ROW_BLOCKS="i32",
                    CHUNK="i32",
                ),
                dict(
                    H=heads,
                    RANK=512,
                    ROPE=64,
                    DIRECT=direct,
                    BLOCK_M=block_m,
                    BLOCK_N=block_n,
                    BLOCK_R=512,
                    BLOCK_P=64,
                    HAS_ROWS=True,
                    FP32_DOT=False,
                    PRECISION="ieee" if dtype == "fp32" else "tf32",
                ),
                warps,
                stages,
            )
            assert latent.metadata.shared <= 227 * 1024, latent.metadata.shared
            ptx = tmp_path / "latent.ptx"
            ptx.write_text(latent.asm["ptx"])
            report = subprocess.run(
                [str(tool("ptxas")), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", os.devnull],
                capture_output=True,
                text=True,
            )
            assert report.returncode == 0 and "registers" in report.stderr, report.stderr
        compile_(
            K._attention_combine_kernel,
            dtype,
            dict(acc_ptr="*fp32", ml_ptr="*fp32", T="i32", SPLITS="i32"),
            dict(H=8, D=512, S_PAD=16, BLOCK_D=512),
            4,
        )
        for interleave in (False, True):
            compile_(
                M._latent_rope_cache_kernel,
                dtype,
                dict(slots_ptr="*i64", T="i32", eps="fp32"),
                dict(H=8, NOPE=128, RANK=512, HALF=32, QH=8, BLOCK_R=512, BLOCK=32, INTERLEAVE=interleave),
                4,
            )
        assert k.asm["cubin"]
        if dtype == "bf16":
            assert "cvt.rn.bf16.f32" in k.asm["ptx"]


# ---- compiled, on a GPU --------------------------------------------------------------------------


def compiled_qk_norm_rope_kv(dtype):
    for case in QK_CASES + [(17, 32, 8, 128)]:
        for norm in (False, True):
            check_qk_norm_rope_kv("cuda", dtype, norm, *case)


def compiled_elementwise(dtype):
    for inter in (20, 1500, 12288):
        check_silu_mul("cuda", dtype, inter)
    for n in (48, 300, 4096):
        check_add_rms_norm("cuda", dtype, n)


def compiled_gemv(dtype):
    for case in GEMV_CASES + [
        (6144, 4096, False, True, None),
        (4096, 12288, True, False, None),
        (1000, 700, True, False, None),
    ]:
        check_gemv("cuda", dtype, *case)


def compiled_skinny_linear(dtype):
    for case in SKINNY_CASES + [
        (33, 6144, 4096, TritonAttention.qkv_skinny, False),
        (49, 6144, 4096, TritonAttention.qkv_skinny, False),
        (33, 4096, 4096, TritonAttention.o_skinny, False),
        (17, 12288, 4096, TritonMLP.gate_up_skinny, True),
        (9, 4096, 12288, TritonMLP.down_skinny, False),
        (33, 4096, 12288, TritonMLP.down_skinny, False),
    ]:
        check_skinny_linear("cuda", torch.float16 if dtype == torch.float32 else dtype, *case)  # 16-bit only


def compiled_wide_linear(dtype):
    for case in WIDE_CASES + [(144, 4096, 12288, TritonMLP.down_wide)]:
        check_wide_linear("cuda", torch.float16 if dtype == torch.float32 else dtype, *case)  # 16-bit only


def compiled_rows_and_slots(dtype):
    check_row_logsumexp("cuda", dtype)
    check_row_top_logprobs("cuda", dtype)
    check_row_argmax("cuda", dtype)
    check_move_slots("cuda", dtype)


def compiled_latent(dtype):
    check_latent_rope_cache("cuda", dtype, LATENT_ROPE_CASES + [(64, 128, 64, 512, 33, True)])
    check_latent_attention(
        "cuda",
        dtype,
        LATENT_CASES
        + [
            (1, 8, 33, 512, 64, 1152, False, False),  # Kimi K2 over 8 ranks: a B=32 verify
            (16, 8, 1, 512, 64, 1152, True, False),  # decode steps at batch 16
            (2, 64, 9, 512, 64, 700, False, True),  # all 64 heads on one GPU
        ],
    )
    check_latent_attention("cuda", dtype, LATENT_CASES, key_growth=0.2)


def compiled_attention(dtype):
    check_attention(
        "cuda",
        dtype,
        ATTENTION_CASES
        + [
            (1, 32, 8, 33, 128, 1152, False, False),
            (16, 32, 8, 1, 128, 1152, True, False),
            (4, 9, 3, 16, 64, 300, False, True),
            (2, 9, 3, 129, 64, 1200, False, False),
        ],
    )
    check_attention("cuda", dtype, ATTENTION_CASES, key_growth=0.2)


# one case a kernel family, so that a failure names its family and a time limit keeps what passed before it
COMPILED_FAMILIES = {
    f.__name__.removeprefix("compiled_"): f
    for f in (
        compiled_qk_norm_rope_kv,
        compiled_elementwise,
        compiled_gemv,
        compiled_skinny_linear,
        compiled_wide_linear,
        compiled_rows_and_slots,
        compiled_latent,
        compiled_attention,
    )
}


@gpu
@needs_cuda
@pytest.mark.parametrize("family", list(COMPILED_FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_kernels_equal_the_reference(dtype, family):
    COMPILED_FAMILIES[family](dtype)


@gpu
@needs_cuda
def test_compiled_tree_kernels_equal_the_reference():
    check_best_first_tree("cuda")
    check_walk("cuda")
    check_commit_path("cuda")
    check_mask_bounds("cuda")


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_model_with_kernels_equals_without(dtype, monkeypatch):
    for skinny in ({}, TINY_SKINNY, {**TINY_SKINNY, "o": (16, 16, 1, 4, 2)}):  # none, o split in 3, o whole
        use_skinny(monkeypatch, skinny)
        for qk_norm in (True, False):
            check_model("cuda", dtype, qk_norm)


@gpu
@needs_cuda
def test_graph_captured_forward_with_kernels_matches_torch():
    """bf16, CUDA graph per variant (as bench --micro measures), on a random qwen3-shaped tiny model."""
    model = tiny_qwen3(layers=4).to("cuda", torch.bfloat16)
    dev = torch.device("cuda")
    ctx, T = 24, 5
    ids = torch.randint(0, model.config.vocab_size, (1, T), device=dev)
    pos = (ctx + torch.arange(T, device=dev))[None]
    mask = (torch.arange(ctx + T, device=dev)[None, :] <= pos[0, :, None])[None, None]
    outs = {}
    for kernels in (False, True):
        use_backend(model, "triton" if kernels else "torch")
        model.setup_caches(1, ctx + T)
        with torch.inference_mode():
            for _ in range(2):
                model(ids, pos, pos, mask)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits, _ = model(ids, pos, pos, mask)
            for layer in model.model.layers:  # replay must write the caches itself
                layer.self_attn.kv_cache.k.zero_()
                layer.self_attn.kv_cache.v.zero_()
            graph.replay()
            torch.cuda.synchronize()
            outs[kernels] = logits.float().clone()
    torch.testing.assert_close(outs[True], outs[False], atol=0.15, rtol=0.05)


def test_aligned_rows_pads_unaligned_mask_rows_and_keeps_broadcasts():
    """kernels.aligned_rows: a mask whose sequence or row stride is not a multiple of 16 comes back equal,
    in rows padded to 16 (broadcast dimensions still broadcast); an aligned one comes back as is."""
    from ddtree.runtime.kernels import aligned_rows

    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(3)
    full = torch.rand(3, 1, 33, 1505, generator=g) < 0.5
    one_row = (torch.rand(3, 1, 1, 1505, generator=g) < 0.5).expand(3, 1, 16, 1505)
    for mask in (full, one_row, full[:, :, :, :100]):
        out = aligned_rows(mask)
        assert torch.equal(out, mask) and out.stride(0) % 16 == 0 and out.stride(2) % 16 == 0 and out.stride(3) == 1
        assert out.stride(2) == (0 if mask.stride(2) == 0 else -(-mask.shape[-1] // 16) * 16)  # 1520, 112
    aligned = torch.rand(2, 1, 33, 2048, generator=g) < 0.5
    assert aligned_rows(aligned) is aligned
