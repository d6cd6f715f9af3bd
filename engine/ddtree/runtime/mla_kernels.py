"""Multi-head latent attention (DeepSeek-V3, Kimi K2) over the paged latent cache: two Triton kernels.

In the absorbed form (models/deepseek_v3.py) every query head attends over one shared "KV head": per
cache slot the normed compressed kv (`rank` = kv_lora_rank values, 512 in DeepSeek-V3 and Kimi K2) and
the rotated RoPE key (`rope`, 64). A query is [q_nope @ W_uk | rotated q_rope]; the score of a key is
the dot over both parts; its value is the compressed kv alone. The reference gathers each layer's
latents through the slot map ([bs, span, rank + rope], a copy per layer) and runs SDPA with all heads
against one KV head. Here each program reads its keys' latents in place, once for all the query heads
and tokens of its row tile: the compressed kv tile is both the key's first part and the value.

The launch is kernels.attention's (flash-decoding): one program per (sequence, tile of BLOCK_M (token,
head) rows, chunk of keys; latent_chunk), the chunks merged by kernels.combine_chunks, no mask read over
the prefix every query sees (kernels.mask_bounds), nothing read past the last key any query sees. Row r is head
r % heads of token r // heads, so a tile's rows share few mask rows. The accumulator holds `rank` dims
per row (512 fp32 values), so tiles are smaller than the dense kernel's: 16 rows and 16 keys a step
with 8 warps, 2 stages. At Kimi K2's sizes ptxas fits that in 120-184 registers a thread for sm_90 in
bf16 and fp32, where 32 keys a step spill in fp32 and, with 4 warps, in bf16 too (test_kernels.py
checks the default spills nothing). Not measured on a GPU yet, nor tuned.

Before it, `latent_rope_cache` does in one launch what the reference's rotate-and-cache step does in
about fifteen small ones per layer: RMSNorm of the compressed kv, RoPE of the shared key, both written
at the token's cache slot, RoPE of each head's q_rope, and the absorbed query assembled as
[q_nope @ W_uk | rotated q_rope] (the per-head product itself stays a PyTorch batched GEMM).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..models.memory import ATTENTION_BYTES_PER_SCORE
from . import kernels
from .kernels import triton

if triton is not None:
    import triton.language as tl

    from .kernels import _attention_write, _cos_sin, _key_range, _online_softmax, _seen

    @triton.jit
    def _rope_heads(src, s_h, h, cos_sin, HEADS, HALF: tl.constexpr, BLOCK: tl.constexpr, INTERLEAVE: tl.constexpr):
        # the RoPE parts of heads h (src, s_h apart) rotated, as the two rotate-half halves in fp32:
        # DeepSeek's interleaved pairs (x[2i], x[2i + 1]) de-interleaved first, as the reference does
        c1, c2, s1, s2 = cos_sin
        d = tl.arange(0, BLOCK)
        m = (h[:, None] < HEADS) & (d[None, :] < HALF)
        at = src + h[:, None] * s_h
        if INTERLEAVE:
            x1 = tl.load(at + 2 * d[None, :], mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(at + 2 * d[None, :] + 1, mask=m, other=0.0).to(tl.float32)
        else:
            x1 = tl.load(at + d[None, :], mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(at + HALF + d[None, :], mask=m, other=0.0).to(tl.float32)
        return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, d, m

    @triton.jit
    def _latent_rope_cache_kernel(
        q_ptr,
        kv_ptr,
        ql_ptr,
        cos_ptr,
        sin_ptr,
        w_ptr,
        cache_ptr,
        slots_ptr,
        out_ptr,
        T,
        eps,
        q_sb,
        q_st,
        q_sh,
        kv_sb,
        kv_st,
        ql_sb,
        ql_sh,
        ql_st,
        cos_sb,
        cos_st,
        sin_sb,
        sin_st,
        c_ss,
        sl_sb,
        sl_st,
        H: tl.constexpr,
        NOPE: tl.constexpr,
        RANK: tl.constexpr,
        HALF: tl.constexpr,
        QH: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK: tl.constexpr,
        INTERLEAVE: tl.constexpr,
    ):
        # program (token, part): part 0 writes the token's latent at its slot, part p > 0 the absorbed
        # query of heads (p - 1) * QH .. p * QH - 1
        tok = tl.program_id(0).to(tl.int64)  # int64: cache offsets can pass 2**31
        b = tok // T
        t = tok % T
        cos_sin = _cos_sin(cos_ptr + b * cos_sb + t * cos_st, sin_ptr + b * sin_sb + t * sin_st, HALF, BLOCK)
        r = tl.arange(0, BLOCK_R)
        part = tl.program_id(1)
        if part == 0:
            src = kv_ptr + b * kv_sb + t * kv_st
            c = tl.load(src + r, mask=r < RANK, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + r, mask=r < RANK, other=0.0).to(tl.float32)
            c = c / tl.sqrt(tl.sum(c * c, axis=0) / RANK + eps) * w
            k1, k2, kd, km = _rope_heads(
                src + RANK, 0, tl.zeros([1], dtype=tl.int32), cos_sin, 1, HALF, BLOCK, INTERLEAVE
            )
            slot_at = cache_ptr + tl.load(slots_ptr + b * sl_sb + t * sl_st).to(tl.int64) * c_ss
            tl.store(slot_at + r, c.to(cache_ptr.dtype.element_ty), mask=r < RANK)
            tl.store(slot_at + RANK + kd[None, :], k1.to(cache_ptr.dtype.element_ty), mask=km)
            tl.store(slot_at + RANK + HALF + kd[None, :], k2.to(cache_ptr.dtype.element_ty), mask=km)
        else:
            h = (part - 1) * QH + tl.arange(0, QH)
            q1, q2, qd, qm = _rope_heads(
                q_ptr + b * q_sb + t * q_st + NOPE, q_sh, h, cos_sin, H, HALF, BLOCK, INTERLEAVE
            )
            out_at = out_ptr + ((b * H + h[:, None]) * T + t) * (RANK + 2 * HALF)  # [bs, heads, T, rank + rope]
            tl.store(out_at + RANK + qd[None, :], q1.to(out_ptr.dtype.element_ty), mask=qm)
            tl.store(out_at + RANK + HALF + qd[None, :], q2.to(out_ptr.dtype.element_ty), mask=qm)
            hm = (h[:, None] < H) & (r[None, :] < RANK)
            q_latent = tl.load(ql_ptr + b * ql_sb + h[:, None] * ql_sh + t * ql_st + r[None, :], mask=hm, other=0.0)
            tl.store(out_at + r[None, :], q_latent.to(out_ptr.dtype.element_ty), mask=hm)

    @triton.jit
    def _latent_step(
        q_kv,
        q_pe,
        c,
        pe,
        seen,
        m_i,
        l_i,
        acc,
        scale,
        MASKED: tl.constexpr,
        FP32_DOT: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        # one block of keys: scores over the compressed kv and the RoPE key, the compressed kv as values
        if FP32_DOT:  # the interpreter computes bf16 dots wrongly
            c, pe = c.to(tl.float32), pe.to(tl.float32)
        scores = tl.dot(q_kv, tl.trans(c), input_precision=PRECISION)
        scores = (scores + tl.dot(q_pe, tl.trans(pe), input_precision=PRECISION)) * scale
        return _online_softmax(scores, c, seen, m_i, l_i, acc, MASKED, PRECISION, 1.0)  # scaled above

    @triton.jit
    def _latent_attention_kernel(
        q_ptr,
        c_ptr,
        map_ptr,
        mask_ptr,
        bounds_ptr,
        rows_ptr,
        acc_ptr,
        ml_ptr,
        out_ptr,
        T,
        span,
        scale,
        SPLITS,
        ROW_BLOCKS,
        CHUNK,
        q_sb,
        q_sh,
        q_st,
        c_ss,
        map_sb,
        m_sb,
        m_st,
        m_ss,
        rows_s,
        o_sb,
        o_st,
        o_sh,
        H: tl.constexpr,
        RANK: tl.constexpr,
        ROPE: tl.constexpr,
        DIRECT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_P: tl.constexpr,
        HAS_ROWS: tl.constexpr,
        FP32_DOT: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        # program (sequence b, a block of its (token, head) rows, key chunk `split`)
        pid = tl.program_id(0)
        split = tl.program_id(1)
        block = pid % ROW_BLOCKS
        b = (pid // ROW_BLOCKS).to(tl.int64)
        if HAS_ROWS:
            row = tl.load(rows_ptr + b * rows_s)
        else:
            row = b
        r = block * BLOCK_M + tl.arange(0, BLOCK_M)
        head = r % H
        t = r // H
        used = r < H * T
        dr = tl.arange(0, BLOCK_R)
        dp = tl.arange(0, BLOCK_P)
        j0 = tl.arange(0, BLOCK_N)
        q_row = q_ptr + b * q_sb + head[:, None] * q_sh + t[:, None] * q_st
        q_kv = tl.load(q_row + dr[None, :], mask=used[:, None] & (dr[None, :] < RANK), other=0.0)
        q_pe = tl.load(q_row + RANK + dp[None, :], mask=used[:, None] & (dp[None, :] < ROPE), other=0.0)
        if FP32_DOT:
            q_kv, q_pe = q_kv.to(tl.float32), q_pe.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        slot_map = map_ptr + row * map_sb  # the row's logical slot j is at physical slot slot_map[j]
        # as kernels._attention_partial_kernel: nothing past the last key any query sees, no mask over
        # the prefix every query sees, each step's slots loaded a step ahead
        lo, mid, hi = _key_range(bounds_ptr, b, span, split, CHUNK, BLOCK_N)
        slot_next = tl.load(slot_map + lo + j0, mask=lo + j0 < hi, other=0)
        for n0 in range(lo, mid, BLOCK_N):  # keys every query sees: no mask
            key = c_ptr + slot_next.to(tl.int64)[:, None] * c_ss
            slot_next = tl.load(slot_map + n0 + BLOCK_N + j0, mask=n0 + BLOCK_N + j0 < hi, other=0)
            c = tl.load(key + dr[None, :], mask=dr[None, :] < RANK, other=0.0)
            pe = tl.load(key + RANK + dp[None, :], mask=dp[None, :] < ROPE, other=0.0)
            m_i, l_i, acc = _latent_step(q_kv, q_pe, c, pe, None, m_i, l_i, acc, scale, False, FP32_DOT, PRECISION)
        for n0 in range(mid, hi, BLOCK_N):
            j = n0 + j0
            live = j < hi
            key = c_ptr + slot_next.to(tl.int64)[:, None] * c_ss
            slot_next = tl.load(slot_map + j + BLOCK_N, mask=j + BLOCK_N < hi, other=0)
            seen = _seen(mask_ptr + b * m_sb, t, j, used, live, m_st, m_ss)
            c = tl.load(key + dr[None, :], mask=live[:, None] & (dr[None, :] < RANK), other=0.0)
            pe = tl.load(key + RANK + dp[None, :], mask=live[:, None] & (dp[None, :] < ROPE), other=0.0)
            m_i, l_i, acc = _latent_step(q_kv, q_pe, c, pe, seen, m_i, l_i, acc, scale, True, FP32_DOT, PRECISION)
        _attention_write(
            acc,
            m_i,
            l_i,
            b,
            split,
            head,
            t,
            used,
            acc_ptr,
            ml_ptr,
            out_ptr,
            T,
            SPLITS,
            o_sb,
            o_st,
            o_sh,
            H,
            RANK,
            DIRECT,
            BLOCK_R,
        )


def latent_chunk(T: int, row_programs: int, span: int, rank: int) -> int:
    """Key slots per program of `latent_attention`: kernels.attention_launch's, but no shorter than what
    keeps the partial sums (`rank` fp32 values per row and chunk) within the memory plan's workspace for
    attention, ATTENTION_BYTES_PER_SCORE per key and row: 256 slots for a rank of 512, where the dense
    kernel's 128 dims already meet that at its shortest chunk of 64."""
    floor = -(-triton.next_power_of_2(rank) * 4 // ATTENTION_BYTES_PER_SCORE)
    return max(kernels.attention_launch(T, row_programs, span)[0], triton.next_power_of_2(floor))


def latent_attention(
    q: Tensor,
    latent: Tensor,
    slot_map: Tensor,
    mask: Tensor,
    rows: Tensor | None,
    rank: int,
    scale: float,
    bounds: Tensor | None = None,
    chunk: int | None = None,
    block_m: int = 16,
    block_n: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
) -> Tensor:
    """Masked attention of a few query tokens over the latent cache (a decode step, a verify tree).

    q [bs, heads, T, rank + rope]: the absorbed queries; latent [physical slots, rank + rope]: one layer's
    cache, per slot the compressed kv then the RoPE key; slot_map [max_batch, logical slots] int32; mask
    [bs, 1, T, span] bool (broadcast strides are fine) over the first `span` logical slots; rows [bs]
    cache rows (None: 0..bs-1); bounds: kernels.mask_bounds(mask) (computed here when None). Returns
    softmax(q k^T * scale) @ compressed kv as [bs, T, heads, rank], for W_uv to map per head.
    `chunk` (default: latent_chunk), block_m, block_n, num_warps and num_stages are tuning
    knobs."""
    bs, heads, T, dim = q.shape
    span = mask.shape[-1]
    rope = dim - rank
    assert latent.shape[-1] == dim and 0 < rope and span <= slot_map.shape[1] and slot_map.stride(1) == 1
    assert q.stride(-1) == latent.stride(-1) == 1
    mask = mask.expand(bs, 1, T, span)
    out = torch.empty(bs, T, heads, rank, dtype=q.dtype, device=q.device)
    if bs * T == 0:
        return out
    block_m = min(block_m, max(16, triton.next_power_of_2(heads * T)))
    block_r = max(16, triton.next_power_of_2(rank))
    row_blocks = triton.cdiv(heads * T, block_m)
    chunk = chunk or latent_chunk(T, bs * row_blocks, span, rank)
    splits = triton.cdiv(span, chunk)
    direct = splits == 1
    # the chunks' partial softmaxes (unused when one chunk holds every key)
    acc = torch.empty(0 if direct else bs * heads * splits * T, block_r, dtype=torch.float32, device=q.device)
    ml = torch.empty(0 if direct else bs * heads * splits * T, 2, dtype=torch.float32, device=q.device)
    m8 = mask.view(torch.int8)
    bounds = kernels.mask_bounds(mask) if bounds is None else bounds
    _latent_attention_kernel[(bs * row_blocks, splits)](
        q,
        latent,
        slot_map,
        m8,
        bounds,
        rows if rows is not None else m8,
        acc,
        ml,
        out,
        T,
        span,
        scale * kernels.SOFTMAX_SCALE,
        splits,
        row_blocks,
        chunk,  # runtime values: new prompt lengths and spans compile nothing new
        q.stride(0),
        q.stride(1),
        q.stride(2),
        latent.stride(0),
        slot_map.stride(0),
        m8.stride(0),
        m8.stride(2),
        m8.stride(3),
        rows.stride(0) if rows is not None else 0,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        H=heads,
        RANK=rank,
        ROPE=rope,
        DIRECT=direct,
        BLOCK_M=block_m,
        BLOCK_N=min(block_n, chunk),
        BLOCK_R=block_r,
        BLOCK_P=max(16, triton.next_power_of_2(rope)),
        HAS_ROWS=rows is not None,
        FP32_DOT=q.device.type == "cpu",
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if not direct:
        kernels.combine_chunks(acc, ml, out, splits)
    return out


def latent_rope_cache(
    q: Tensor,
    kv: Tensor,
    q_latent: Tensor,
    cos: Tensor,
    sin: Tensor,
    norm_weight: Tensor,
    eps: float,
    latent: Tensor,
    slots: Tensor,
    interleave: bool,
) -> Tensor:
    """MLA's rotate-and-cache step (models/deepseek_v3.Attention.rotate_and_cache) in one launch.

    q [bs, T, heads, nope + rope]: the query projection (only its RoPE part is read); kv [bs, T, rank +
    rope]: kv_a_proj_with_mqa's output; q_latent [bs, heads, T, rank]: q_nope @ W_uk; cos/sin [bs, T,
    rope]; norm_weight [rank]: kv_a_layernorm's; latent [physical slots, rank + rope]: one layer's cache;
    slots [bs, T] physical; interleave: DeepSeek's interleaved RoPE pairs. Writes [RMSNorm(c_kv) |
    RoPE(k_rope)] at each token's slot and returns [q_latent | RoPE(q_rope)] as [bs, heads, T, rank +
    rope] (contiguous)."""
    bs, T, heads, _ = q.shape
    rank, dim = q_latent.shape[-1], latent.shape[-1]
    rope = dim - rank
    nope = q.shape[-1] - rope
    assert rope % 2 == 0 and kv.shape[-1] == dim and q.stride(-1) == kv.stride(-1) == 1
    assert cos.stride(-1) == sin.stride(-1) == 1 and latent.stride(-1) == 1
    if q_latent.stride(-1) != 1:
        q_latent = q_latent.contiguous()
    out = torch.empty(bs, heads, T, dim, dtype=q.dtype, device=q.device)
    if bs * T == 0:
        return out
    qh = min(16, triton.next_power_of_2(heads))  # heads a program: 16 x 512 values of the query at most
    _latent_rope_cache_kernel[(bs * T, 1 + triton.cdiv(heads, qh))](
        q,
        kv,
        q_latent,
        cos,
        sin,
        norm_weight,
        latent,
        slots,
        out,
        T,
        eps,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        kv.stride(0),
        kv.stride(1),
        q_latent.stride(0),
        q_latent.stride(1),
        q_latent.stride(2),
        cos.stride(0),
        cos.stride(1),
        sin.stride(0),
        sin.stride(1),
        latent.stride(0),
        slots.stride(0),
        slots.stride(1),
        H=heads,
        NOPE=nope,
        RANK=rank,
        HALF=rope // 2,
        QH=qh,
        BLOCK_R=triton.next_power_of_2(rank),
        BLOCK=triton.next_power_of_2(rope // 2),
        INTERLEAVE=interleave,
        num_warps=4,
    )
    return out
