"""Fused Triton kernels for inference: fewer, larger kernels per decoder layer.

A batch-1 decode step is bound by weight reads, so every small element-wise kernel between the GEMMs
(norms, RoPE, KV writes, SiLU, residual adds) is pure launch and round-trip cost. Three kernels
replace them:

  qk_norm_rope_kv  per-head RMSNorm of q and k (Qwen3), RoPE, k/v written into the cache, q out
  silu_mul         silu(gate) * up from the fused gate/up GEMM output
  add_rms_norm     residual add + RMSNorm of the sum

and, for a batch-1 decode step, `gemv` replaces cuBLAS's split-K GEMMs for one row (with silu_mul folded
into the down projection). `attention` (with `mask_bounds`, once per forward), `best_first_tree`
(with `row_top_logprobs` for few rows), `walk`, `commit_path` and `move_slots` replace SDPA over the tree
mask and the many small kernels of the DDTree tree, the walk and the commit. For 2-64 rows (a verify
forward), `skinny_linear` runs the q/k/v and o projections (o as K-split partial products that add_rms_norm sums) and
the gate/up projection (with silu_mul folded in) closer to the HBM bound than cuBLAS does; for 65-192
rows (a verify at batch 16), `wide_linear` runs the down projection, its K-split parts summed the same way.

The pure-PyTorch forwards of ddtree.models stay the reference and the CPU path; ddtree.runtime.fused
swaps these kernels in. Arithmetic is in fp32 with
one rounding to the output dtype, so results agree with the reference to bf16 rounding, not bitwise.
Launches read no tensor values on the host: everything is CUDA-graph capturable. On Hopper and newer
GPUs the per-layer kernels launch with programmatic dependent launch (`pdl`). With
TRITON_INTERPRET=1 set before triton is imported, the same kernels run on CPU tensors (the tests).
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU-only installs: the PyTorch path is used
    triton = None


# the attention kernels' scores are in base 2: softmax(x) = exp2(x * log2(e)) / sum, so the launchers scale the
# scores by log2(e) as well
SOFTMAX_SCALE = math.log2(math.e)


def available(device: torch.device | str) -> bool:
    """Triton can run on tensors of `device`: CUDA, or CPU under the Triton interpreter."""
    if triton is None:
        return False
    kind = torch.device(device).type
    return kind == "cuda" or (kind == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


@functools.cache
def _hopper_or_newer(device: torch.device) -> bool:
    """A CUDA device of compute capability 9 or more (asked once per device: every launch asks)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl(device: torch.device) -> dict[str, bool]:
    """A launch's programmatic-dependent-launch arguments: on Hopper and newer GPUs the kernel's programs
    are launched while the kernel before it in the stream finishes, and wait for it in-kernel
    (_after_previous_kernel), which hides the launch and the ramp-up between two kernels."""
    on = _hopper_or_newer(device)
    return {"PDL": on, "launch_pdl": on}


if triton is not None:

    @triton.jit
    def _after_previous_kernel(PDL: tl.constexpr):
        # launched with pdl(), a kernel may start before the one ahead of it has finished: it waits for it
        # before reading or writing memory, then lets the next kernel's programs be launched
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def _rms_halves(x1, x2, w_ptr, d, mask, HALF: tl.constexpr, eps):
        """RMSNorm of heads [H, BLOCK] held as their two rotate-half halves (masked lanes are 0)."""
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        r = (1.0 / tl.sqrt(var + eps))[:, None]
        w1 = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + d, mask=mask, other=0.0).to(tl.float32)[None, :]
        return x1 * r * w1, x2 * r * w2

    @triton.jit
    def _cos_sin(cos, sin, HALF: tl.constexpr, BLOCK: tl.constexpr):
        # a token's cos and sin (rotate-half layout) as their two halves in fp32, each [1, BLOCK]
        d = tl.arange(0, BLOCK)
        m = d < HALF
        c1 = tl.load(cos + d, mask=m, other=0.0).to(tl.float32)[None, :]
        c2 = tl.load(cos + HALF + d, mask=m, other=0.0).to(tl.float32)[None, :]
        s1 = tl.load(sin + d, mask=m, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(sin + HALF + d, mask=m, other=0.0).to(tl.float32)[None, :]
        return c1, c2, s1, s2

    @triton.jit
    def _norm_rope_heads(
        src,
        s_h,
        w_ptr,
        cos_sin,
        eps,
        h0,
        HEADS: tl.constexpr,
        H_PAD: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_NORM: tl.constexpr,
    ):
        # a token's heads h0 .. h0 + H_PAD - 1 of HEADS (src, s_h apart) normalised and rotated: the two
        # rotate-half halves in fp32
        c1, c2, s1, s2 = cos_sin
        h = h0 + tl.arange(0, H_PAD)
        d = tl.arange(0, BLOCK)
        m = (h[:, None] < HEADS) & (d[None, :] < HALF)
        at = src + h[:, None] * s_h + d[None, :]
        x1 = tl.load(at, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(at + HALF, mask=m, other=0.0).to(tl.float32)
        if HAS_NORM:
            x1, x2 = _rms_halves(x1, x2, w_ptr, d, d < HALF, HALF, eps)
        # rotate-half RoPE: [x1, x2] * cos + [-x2, x1] * sin
        return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, h, d, m

    @triton.jit
    def _qk_norm_rope_kv_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        cos_ptr,
        sin_ptr,
        qw_ptr,
        kw_ptr,
        kc_ptr,
        vc_ptr,
        slots_ptr,
        out_ptr,
        T,
        eps,
        q_sb,
        q_st,
        q_sh,
        k_sb,
        k_st,
        k_sh,
        v_sb,
        v_st,
        v_sh,
        cos_sb,
        cos_st,
        sin_sb,
        sin_st,
        kc_sh,
        kc_ss,
        vc_sh,
        vc_ss,
        sl_sb,
        sl_st,
        N_HEADS: tl.constexpr,
        N_KV: tl.constexpr,
        QH: tl.constexpr,
        KH: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_NORM: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _after_previous_kernel(PDL)
        # one program per token and block of QH query heads or KH KV heads (the v copy with them): the
        # query blocks first, then the KV blocks. qk_norm_rope_kv picks all of a token's heads per program
        # (cos/sin and the slot read once per token, whole rows of q/k/v moved) or one head per program
        tok = tl.program_id(0).to(tl.int64)  # int64: cache offsets can pass 2**31
        b = tok // T
        t = tok % T
        cos_sin = _cos_sin(cos_ptr + b * cos_sb + t * cos_st, sin_ptr + b * sin_sb + t * sin_st, HALF, BLOCK)
        part = tl.program_id(1)
        Q_BLOCKS: tl.constexpr = (N_HEADS + QH - 1) // QH
        if part < Q_BLOCKS:
            qy1, qy2, qh, qd, qm = _norm_rope_heads(
                q_ptr + b * q_sb + t * q_st, q_sh, qw_ptr, cos_sin, eps, part * QH, N_HEADS, QH, HALF, BLOCK, HAS_NORM
            )
            dst = out_ptr + ((b * N_HEADS + qh[:, None]) * T + t) * (2 * HALF) + qd[None, :]  # [bs, heads, T, hd]
            tl.store(dst, qy1.to(out_ptr.dtype.element_ty), mask=qm)
            tl.store(dst + HALF, qy2.to(out_ptr.dtype.element_ty), mask=qm)
        else:
            ky1, ky2, kh, kd, km = _norm_rope_heads(
                k_ptr + b * k_sb + t * k_st,
                k_sh,
                kw_ptr,
                cos_sin,
                eps,
                (part - Q_BLOCKS) * KH,
                N_KV,
                KH,
                HALF,
                BLOCK,
                HAS_NORM,
            )
            slot = tl.load(slots_ptr + b * sl_sb + t * sl_st).to(tl.int64)
            kdst = kc_ptr + kh[:, None] * kc_sh + slot * kc_ss + kd[None, :]
            tl.store(kdst, ky1.to(kc_ptr.dtype.element_ty), mask=km)
            tl.store(kdst + HALF, ky2.to(kc_ptr.dtype.element_ty), mask=km)
            vsrc = v_ptr + b * v_sb + t * v_st + kh[:, None] * v_sh + kd[None, :]
            vdst = vc_ptr + kh[:, None] * vc_sh + slot * vc_ss + kd[None, :]
            tl.store(vdst, tl.load(vsrc, mask=km, other=0.0).to(vc_ptr.dtype.element_ty), mask=km)
            tl.store(vdst + HALF, tl.load(vsrc + HALF, mask=km, other=0.0).to(vc_ptr.dtype.element_ty), mask=km)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, inter, gu_s, out_s, BLOCK: tl.constexpr, PDL: tl.constexpr):
        _after_previous_kernel(PDL)
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < inter
        g = tl.load(gu_ptr + row * gu_s + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * gu_s + inter + c, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_s + c, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _gemv_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        out_ptr,
        N,
        w_sn,
        K: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SILU_MUL: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        EVEN: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _after_previous_kernel(PDL)
        # out[n] = sum_k w[n, k] * x[k] for BLOCK_N rows of w; with SILU_MUL, x = silu(gate) * up is
        # made here from the gate/up GEMV output [gate | up] (each program redoes its slice; it is tiny)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            if EVEN:
                w = tl.load(w_ptr + n[:, None].to(tl.int64) * w_sn + k[None, :])
                x = tl.load(x_ptr + k).to(tl.float32)
                if SILU_MUL:
                    up = tl.load(x_ptr + K + k).to(tl.float32)
            else:
                live = k < K
                w = tl.load(
                    w_ptr + n[:, None].to(tl.int64) * w_sn + k[None, :],
                    mask=(n[:, None] < N) & live[None, :],
                    other=0.0,
                )
                x = tl.load(x_ptr + k, mask=live, other=0.0).to(tl.float32)
                if SILU_MUL:
                    up = tl.load(x_ptr + K + k, mask=live, other=0.0).to(tl.float32)
            if SILU_MUL:  # rounded to the model dtype, as silu_mul's output would be
                x = (x * tl.sigmoid(x) * up).to(w.dtype).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n < N)

    @triton.jit
    def _skinny_linear_kernel(
        w_desc,
        x_desc,
        w_ptr,
        x_ptr,
        out_ptr,
        M,
        x_s,
        w_sn,
        out_s,
        part_s,
        up_rows,
        K_SPLIT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        STAGES: tl.constexpr,
        GATE_UP: tl.constexpr,
        TMA: tl.constexpr,
        FP32_DOT: tl.constexpr,
        PRECISION: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _after_previous_kernel(PDL)
        # out[m, n] = sum_k w[n, k] * x[m, k] over this program's K slice, for BLOCK_N rows of w and all
        # M (<= BLOCK_M) rows of x, computed transposed: the weight's rows are the dot's M side (the tensor
        # cores' 64-row unit) and x's rows its N side, so that few rows cost few MMA columns. Each weight
        # tile is read once, through TMA where the tensors allow it (w_desc, x_desc; x's rows past M read
        # as zeros), else through pointers. With GATE_UP, w is [gate | up] (up_rows rows apart) and the
        # program writes silu(gate) * up for its columns
        n0 = tl.program_id(0) * BLOCK_N
        split = tl.program_id(1)
        n = n0 + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in tl.range(split * K_SPLIT, (split + 1) * K_SPLIT, BLOCK_K, num_stages=STAGES):
            if TMA:
                w = w_desc.load([n0, k0])
                x = x_desc.load([0, k0])
            else:
                w = tl.load(w_ptr + n[:, None].to(tl.int64) * w_sn + (k0 + kk)[None, :])
                x = tl.load(x_ptr + m[:, None] * x_s + (k0 + kk)[None, :], mask=m[:, None] < M, other=0.0)
            if FP32_DOT:  # the interpreter computes bf16 dots wrongly
                w, x = w.to(tl.float32), x.to(tl.float32)
            acc = tl.dot(w, x.T, acc, input_precision=PRECISION)
            if GATE_UP:
                if TMA:
                    up = w_desc.load([up_rows + n0, k0])
                else:
                    up = tl.load(w_ptr + (up_rows + n[:, None]).to(tl.int64) * w_sn + (k0 + kk)[None, :])
                if FP32_DOT:
                    up = up.to(tl.float32)
                acc_up = tl.dot(up, x.T, acc_up, input_precision=PRECISION)
        if GATE_UP:  # gate and up rounded to the model dtype first, as the unfused path has them
            gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            acc = gate * tl.sigmoid(gate) * acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        out = out_ptr + split * part_s + m[None, :] * out_s + n[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m[None, :] < M)

    @triton.jit
    def _wide_linear_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        M,
        x_s,
        w_sn,
        out_s,
        part_s,
        K_SPLIT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        HEAD_M: tl.constexpr,
        TAIL_M: tl.constexpr,
        FP32_DOT: tl.constexpr,
        PRECISION: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _after_previous_kernel(PDL)
        # out[m, n] = sum_k w[n, k] * x[m, k] over this program's K slice, computed transposed: BLOCK_N
        # rows of w are the dot's M side (the tensor cores' 64-row unit) and x's rows its N side, which
        # takes any multiple of 8. The rows are two tiles of powers of two, HEAD_M then TAIL_M, so that
        # 144 rows cost 128 + 16 columns of MMA rather than 256; each weight tile is read once for both
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(1)
        kk = split * K_SPLIT + tl.arange(0, BLOCK_K)
        w_tile = w_ptr + n[:, None].to(tl.int64) * w_sn + kk[None, :]  # [BLOCK_N, BLOCK_K]
        mh = tl.arange(0, HEAD_M)
        mt = HEAD_M + tl.arange(0, TAIL_M)
        xh_tile = x_ptr + mh[None, :] * x_s + kk[:, None]  # [BLOCK_K, HEAD_M], x transposed
        xt_tile = x_ptr + mt[None, :] * x_s + kk[:, None]
        live_h, live_t = mh[None, :] < M, mt[None, :] < M
        acc_h = tl.zeros([BLOCK_N, HEAD_M], dtype=tl.float32)
        acc_t = tl.zeros([BLOCK_N, TAIL_M], dtype=tl.float32)
        for k0 in range(0, K_SPLIT, BLOCK_K):
            w = tl.load(w_tile + k0)
            xh = tl.load(xh_tile + k0, mask=live_h, other=0.0)
            xt = tl.load(xt_tile + k0, mask=live_t, other=0.0)
            if FP32_DOT:  # the interpreter computes bf16 dots wrongly
                w, xh, xt = w.to(tl.float32), xh.to(tl.float32), xt.to(tl.float32)
            acc_h = tl.dot(w, xh, acc_h, input_precision=PRECISION)
            acc_t = tl.dot(w, xt, acc_t, input_precision=PRECISION)
        out = out_ptr + split * part_s + n[:, None]
        tl.store(out + mh[None, :] * out_s, acc_h.to(out_ptr.dtype.element_ty), mask=live_h)
        tl.store(out + mt[None, :] * out_s, acc_t.to(out_ptr.dtype.element_ty), mask=live_t)

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr,
        r_ptr,
        w_ptr,
        out_ptr,
        res_ptr,
        N,
        eps,
        x_s,
        r_s,
        out_s,
        res_s,
        part_s,
        BLOCK: tl.constexpr,
        PARTS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _after_previous_kernel(PDL)
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        m = c < N
        x = tl.load(x_ptr + row * x_s + c, mask=m, other=0.0).to(tl.float32)
        for p in tl.static_range(1, PARTS):  # K-split partial products of skinny_linear
            x += tl.load(x_ptr + p * part_s + row * x_s + c, mask=m, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * r_s + c, mask=m, other=0.0).to(tl.float32)
        # the residual stream is kept in the model dtype; normalise that rounded sum, as the unfused path does
        s = (x + r).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * res_s + c, s, mask=m)
        s = s.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / N + eps)
        w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_s + c, (s * rstd * w).to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _best_first_tree_kernel(
        top_lp_ptr,
        top_tok_ptr,
        roots_ptr,
        tokens_ptr,
        parents_ptr,
        depth_ptr,
        valid_ptr,
        visible_ptr,
        scores_ptr,
        D,
        K,
        N,
        B: tl.constexpr,
        CAP: tl.constexpr,
        N_PAD: tl.constexpr,
    ):
        # one program per sequence. Candidate c = the rank-r child at depth d of node `par`, whose
        # path score is `pscore`; popping node i pushes its next sibling into slot 2i - 1 and its
        # first child into slot 2i, so slots never collide and the frontier needs no counter.
        b = tl.program_id(0).to(tl.int64)
        lp = top_lp_ptr + b * D * K
        tok = top_tok_ptr + b * D * K
        c = tl.arange(0, CAP)
        score = tl.where(c == 0, tl.load(lp), float("-inf"))
        pscore = tl.zeros([CAP], dtype=tl.float32)
        par = tl.zeros([CAP], dtype=tl.int32)
        dep = tl.full([CAP], 1, dtype=tl.int32)
        rank = tl.zeros([CAP], dtype=tl.int32)
        cols = tl.arange(0, N_PAD)
        vis = visible_ptr + b * N * N
        out = b * N
        tl.store(tokens_ptr + out, tl.load(roots_ptr + b))
        tl.store(parents_ptr + out, -1)
        tl.store(depth_ptr + out, 0)
        tl.store(valid_ptr + out, 1)
        tl.store(scores_ptr + out, 0.0)
        tl.store(vis + cols, (cols == 0).to(tl.int8), mask=cols < N)
        for j in range(B):
            i = j + 1  # node i; node 0 is the root
            tl.debug_barrier()  # the parent's visible row, stored by other threads, is read below
            s, best = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
            pick = c == best
            # the pop is serial: three reductions per node (max, the packed integers, the parent's score)
            packed = tl.sum(tl.where(pick, par | (dep << 10) | (rank << 20), 0), axis=0)
            p_i, d_i, r_i = packed & 1023, (packed >> 10) & 1023, packed >> 20
            ps_i = tl.sum(tl.where(pick, pscore, 0.0), axis=0)
            ok = s > float("-inf")  # false once fewer prefixes exist than the budget: padding
            score = tl.where(pick, float("-inf"), score)
            row = tl.load(vis + p_i * N + cols, mask=cols < N, other=0) != 0
            tl.store(vis + i * N + cols, (tl.where(ok, row, cols < 0) | (cols == i)).to(tl.int8), mask=cols < N)
            tl.store(tokens_ptr + out + i, tl.load(tok + (d_i - 1) * K + r_i, mask=ok, other=0))
            tl.store(parents_ptr + out + i, tl.where(ok, p_i, 0))
            tl.store(depth_ptr + out + i, tl.where(ok, d_i, 1))
            tl.store(valid_ptr + out + i, ok.to(tl.int8))
            tl.store(scores_ptr + out + i, s)  # -inf for padding
            # next sibling: same parent, next rank at this depth
            sib_ok = ok & (r_i + 1 < K)
            sib = tl.load(lp + (d_i - 1) * K + r_i + 1, mask=sib_ok, other=0.0)
            at = c == 2 * i - 1
            score = tl.where(at, tl.where(sib_ok, ps_i + sib, float("-inf")), score)
            pscore = tl.where(at, ps_i, pscore)
            par = tl.where(at, p_i, par)
            dep = tl.where(at, d_i, dep)
            rank = tl.where(at, r_i + 1, rank)
            # first child: one level deeper, rank 0
            kid_ok = ok & (d_i < D)
            kid = tl.load(lp + d_i * K, mask=kid_ok, other=0.0)
            at = c == 2 * i
            score = tl.where(at, tl.where(kid_ok, s + kid, float("-inf")), score)
            pscore = tl.where(at, s, pscore)
            par = tl.where(at, i, par)
            dep = tl.where(at, d_i + 1, dep)
            rank = tl.where(at, 0, rank)

    @triton.jit
    def _attention_step(
        q, k, v, seen, m_i, l_i, acc, scale, MASKED: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr
    ):
        # one block of keys into the running softmax of a block of query rows (flash attention)
        if FP32_DOT:  # the interpreter computes bf16 dots wrongly
            k, v = k.to(tl.float32), v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        return _online_softmax(scores, v, seen, m_i, l_i, acc, MASKED, PRECISION, scale)

    @triton.jit
    def _online_softmax(scores, v, seen, m_i, l_i, acc, MASKED: tl.constexpr, PRECISION: tl.constexpr, scale):
        # a block of raw scores [rows, keys] and their values [keys, dims] into the running softmax. `scale`
        # includes log2(e) (SOFTMAX_SCALE) and goes into the exponent's fused multiply-add: exp2(s * scale -
        # m) is one FMA and ex2 a score, where exp of a scaled score costs two multiplies, a subtraction and
        # ex2; the row maxima (scaled: the max of raw scores times a positive scale) are base 2 too, for
        # _attention_combine_kernel
        if MASKED:
            scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1) * scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp2(scores * scale - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _key_range(bounds_ptr, b, span, split, CHUNK, BLOCK_N: tl.constexpr):
        # the keys [lo, hi) of chunk `split` that some query of sequence b sees (mask_bounds), and mid:
        # where the whole key blocks inside the prefix every query sees end (no mask read before it)
        extent = tl.minimum(tl.load(bounds_ptr + b * 2), span)
        shared = tl.minimum(tl.load(bounds_ptr + b * 2 + 1), extent)
        lo = split * CHUNK
        hi = tl.minimum(lo + CHUNK, extent)
        return lo, tl.maximum(lo, lo + (tl.minimum(hi, shared) - lo) // BLOCK_N * BLOCK_N), hi

    @triton.jit
    def _seen(mask, t, j, used, live, m_st, m_ss):
        # [rows, keys]: whether the query token t of each row sees key j (one sequence's mask at `mask`)
        return tl.load(mask + t[:, None] * m_st + j[None, :] * m_ss, mask=used[:, None] & live[None, :], other=0) != 0

    @triton.jit
    def _attention_write(
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
        H: tl.constexpr,
        D: tl.constexpr,
        DIRECT: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # a program's rows (query head `head` of token `t`) after its chunk of keys: the output, when one
        # chunk holds every key, or the chunk's unnormalised softmax for _attention_combine_kernel
        d = tl.arange(0, BLOCK_D)
        if DIRECT:  # one chunk holds every key: this is the softmax, written as the output
            o = acc / tl.where(used, l_i, 1.0)[:, None]  # padding rows: no 0 / 0
            out = out_ptr + b * o_sb + t[:, None] * o_st + head[:, None] * o_sh + d[None, :]
            tl.store(out, o.to(out_ptr.dtype.element_ty), mask=used[:, None] & (d[None, :] < D))
        else:
            part = ((b * H + head) * SPLITS + split) * T + t  # [bs, heads, splits, T]
            # a row that saw no key of this chunk (every row, in chunks past the extent) leaves its acc
            # unwritten: the combine kernel does not read it
            seen_any = used & (m_i != float("-inf"))
            tl.store(acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=seen_any[:, None])
            tl.store(ml_ptr + part * 2, m_i, mask=used)
            tl.store(ml_ptr + part * 2 + 1, l_i, mask=used)

    @triton.jit
    def _attention_partial_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
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
        k_sh,
        k_ss,
        v_sh,
        map_sb,
        m_sb,
        m_st,
        m_ss,
        rows_s,
        o_sb,
        o_st,
        o_sh,
        H: tl.constexpr,
        GROUP: tl.constexpr,
        D: tl.constexpr,
        DIRECT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HAS_ROWS: tl.constexpr,
        FP32_DOT: tl.constexpr,
        PRECISION: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _after_previous_kernel(PDL)
        # program (sequence b, the GROUP query heads of KV head kvh, a block of their rows, key chunk s):
        # a softmax over that chunk's keys, kept unnormalised with its row max and row sum for the combine
        # kernel (flash-decoding). Row r is query head kvh * GROUP + r % GROUP of token r // GROUP: the
        # heads that share a KV head read its keys once, and a token's heads, in consecutive rows, share
        # its mask row. (One head's tokens per row block spilled registers and measured slower on an H200:
        # docs/engine.md, "Fused kernels")
        pid = tl.program_id(0)
        split = tl.program_id(1)
        block = pid % ROW_BLOCKS
        pid = pid // ROW_BLOCKS
        b = (pid // (H // GROUP)).to(tl.int64)
        kvh = pid % (H // GROUP)
        if HAS_ROWS:
            row = tl.load(rows_ptr + b * rows_s)
        else:
            row = b
        r = block * BLOCK_M + tl.arange(0, BLOCK_M)
        head = kvh * GROUP + r % GROUP
        t = r // GROUP
        used = r < GROUP * T
        d = tl.arange(0, BLOCK_D)
        j0 = tl.arange(0, BLOCK_N)
        q = tl.load(
            q_ptr + b * q_sb + head[:, None] * q_sh + t[:, None] * q_st + d[None, :],
            mask=used[:, None] & (d[None, :] < D),
            other=0.0,
        )
        if FP32_DOT:  # the interpreter computes bf16 dots wrongly
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        kbase = k_ptr + kvh * k_sh
        vbase = v_ptr + kvh * v_sh
        slot_map = map_ptr + row * map_sb  # the row's logical slot j is at physical slot slot_map[j]
        # keys from the last one any query of the sequence sees on are not read (a graph's span bucket
        # is often far longer than the live text): a scalar bound, where a test of the mask tile took a
        # reduction over the tile and kept the key loads waiting for the mask (measured slower on an
        # H200: docs/engine.md, "Fused kernels"). Key blocks inside the prefix every query sees (the
        # committed text of a verify or a draft) skip the mask: its loads and selects took a third of
        # the kernel's time at 33 tokens and batch 16.
        lo, mid, hi = _key_range(bounds_ptr, b, span, split, CHUNK, BLOCK_N)
        # each step loads the next step's physical slots, so that its key and value loads wait on no
        # index load of their own
        slot_next = tl.load(slot_map + lo + j0, mask=lo + j0 < hi, other=0)
        # a key's offset in its head's plane is an int32 (attention checks the caches fit), the same for k
        # and v: fewer instructions a step than each load's own 64-bit address
        for n0 in range(lo, mid, BLOCK_N):  # keys every query sees: no mask
            off = slot_next[:, None] * k_ss + d[None, :]
            slot_next = tl.load(slot_map + n0 + BLOCK_N + j0, mask=n0 + BLOCK_N + j0 < hi, other=0)
            k = tl.load(kbase + off, mask=d[None, :] < D, other=0.0)
            v = tl.load(vbase + off, mask=d[None, :] < D, other=0.0)
            m_i, l_i, acc = _attention_step(q, k, v, None, m_i, l_i, acc, scale, False, FP32_DOT, PRECISION)
        for n0 in range(mid, hi, BLOCK_N):
            j = n0 + j0
            live = j < hi
            off = slot_next[:, None] * k_ss + d[None, :]
            slot_next = tl.load(slot_map + j + BLOCK_N, mask=j + BLOCK_N < hi, other=0)
            seen = _seen(mask_ptr + b * m_sb, t, j, used, live, m_st, m_ss)
            k = tl.load(kbase + off, mask=live[:, None] & (d[None, :] < D), other=0.0)
            v = tl.load(vbase + off, mask=live[:, None] & (d[None, :] < D), other=0.0)
            m_i, l_i, acc = _attention_step(q, k, v, seen, m_i, l_i, acc, scale, True, FP32_DOT, PRECISION)
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
            D,
            DIRECT,
            BLOCK_D,
        )

    @triton.jit
    def _mask_bounds_kernel(
        mask_ptr, bounds_ptr, T, span, m_sb, m_st, m_ss, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr
    ):
        # program (sequence b, BLOCK_S slots): bounds[b, 0] = max(itself, 1 + the last of these slots a
        # query sees), bounds[b, 1] = min(itself, the first of them some query does not see)
        b = tl.program_id(0).to(tl.int64)
        t = tl.arange(0, BLOCK_T)
        s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
        inside = (t < T)[:, None] & (s < span)[None, :]
        seen = tl.load(mask_ptr + b * m_sb + t[:, None] * m_st + s[None, :] * m_ss, mask=inside, other=0) != 0
        last = tl.max(tl.max(tl.where(seen, s[None, :] + 1, 0), axis=1), axis=0)
        tl.atomic_max(bounds_ptr + b * 2, last)
        first_unseen = tl.min(tl.min(tl.where(inside & ~seen, s[None, :], span), axis=1), axis=0)
        tl.atomic_min(bounds_ptr + b * 2 + 1, first_unseen)

    @triton.jit
    def _attention_combine_kernel(
        acc_ptr,
        ml_ptr,
        out_ptr,
        T,
        SPLITS,
        o_sb,
        o_st,
        o_sh,
        H: tl.constexpr,
        D: tl.constexpr,
        S_PAD: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _after_previous_kernel(PDL)
        bh = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1)
        b = bh // H
        h = bh % H
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, BLOCK_D)
        part = (bh * SPLITS + s) * T + t
        m = tl.load(ml_ptr + part * 2, mask=s < SPLITS, other=float("-inf"))
        l = tl.load(ml_ptr + part * 2 + 1, mask=s < SPLITS, other=0.0)
        top = tl.max(m, axis=0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - top))  # base-2 row maxima (_online_softmax)
        seen = (s < SPLITS) & (m != float("-inf"))
        acc = tl.load(acc_ptr + part[:, None] * BLOCK_D + d[None, :], mask=seen[:, None], other=0.0)
        o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
        tl.store(out_ptr + b * o_sb + t * o_st + h * o_sh + d, o.to(out_ptr.dtype.element_ty), mask=d < D)

    @triton.jit
    def _move_slots_kernel(
        s_ptr,
        src_ptr,
        dst_ptr,
        n,
        s_sp,
        s_sh,
        s_ss,
        H: tl.constexpr,
        D: tl.constexpr,
        N_PAD: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # program (plane p, row b, head h): physical slots src[b, :n] -> dst[b, :n], BLOCK_D columns at a
        # time; the barrier keeps every read of a column block before any write to it (threads share slots).
        # Rows hold disjoint slots (but the trash slot, whose contents nobody reads)
        p = tl.program_id(0).to(tl.int64)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = bh % H
        j = tl.arange(0, N_PAD)
        live = j < n
        src = tl.load(src_ptr + b * n + j, mask=live, other=0).to(tl.int64)
        dst = tl.load(dst_ptr + b * n + j, mask=live, other=0).to(tl.int64)
        base = s_ptr + p * s_sp + h * s_sh
        for d0 in tl.static_range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            m = live[:, None] & (d[None, :] < D)
            x = tl.load(base + src[:, None] * s_ss + d[None, :], mask=m)
            tl.debug_barrier()
            tl.store(base + dst[:, None] * s_ss + d[None, :], x, mask=m)

    @triton.jit
    def _row_logsumexp_kernel(x_ptr, out_ptr, x_s, N: tl.constexpr, BLOCK: tl.constexpr):
        # program (row): log sum exp of the row's N values in fp32, one pass (an online max per lane); N, the
        # vocabulary, is a model's constant
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        s = tl.zeros([BLOCK], dtype=tl.float32)
        for n0 in range(0, N, BLOCK):
            x = tl.load(x_ptr + row * x_s + n0 + i, mask=n0 + i < N, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
            m = m_new
        top = tl.max(m, axis=0)
        total = tl.sum(s * tl.exp(m - top), axis=0)
        tl.store(out_ptr + row, top + tl.log(total))

    # packed key of a position past the row's end: below every value's, -inf's too (64 and 32 bits)
    _KEY_PAD = tl.constexpr(-(2**63))
    _KEY16_PAD = tl.constexpr(-(2**31))

    @triton.constexpr_function
    def _log2(n):
        return n.bit_length() - 1

    @triton.jit
    def _swap_pairs(h, flip, i: tl.constexpr, DIMS: tl.constexpr):
        # compare-and-swap of the pairs along the i-th innermost axis of the hypercube h, ascending where
        # flip ^ (right of the pair) is 0: tl.topk's, but the partner is the pair's sum less itself where
        # tl.topk reduces with xor, a custom combine that the interpreter runs element by element in Python
        # (minutes for two rows of 151936); compiled for sm_90, both give the same PTX
        ax: tl.constexpr = DIMS - 1 - i
        y = tl.sum(h, axis=ax, keep_dims=True) - h
        right = tl.reshape(tl.arange(0, 2), [1] * ax + [2] + [1] * i)
        return tl.where((h > y) != (flip ^ right), y, h)

    @triton.jit
    def _bitonic_merge(h, stage: tl.constexpr, order: tl.constexpr, DIMS: tl.constexpr):
        # runs of 2**stage merged descending (order 1) or alternately ascending and descending (order 2)
        if order == 2:
            flip = tl.reshape(tl.arange(0, 2), [1] * (DIMS - 1 - stage) + [2] + [1] * stage)
        else:
            flip = order
        for i in tl.static_range(stage):
            h = _swap_pairs(h, flip, stage - 1 - i, DIMS)
        return h

    @triton.jit
    def _top(x, K: tl.constexpr):
        # tl.topk(x, K) (bitonic, sorted descending) of a 1-D x of a power of two entries, K a power of two
        LOG_N: tl.constexpr = _log2(x.shape[0])
        LOG_K: tl.constexpr = _log2(K)
        h = tl.reshape(x, [2] * LOG_N)
        for i in tl.static_range(1, LOG_K + 1):
            h = _bitonic_merge(h, i, 2 if i < LOG_N else 1, LOG_N)
        for i in tl.static_range(LOG_K + 1, LOG_N + 1):
            h = tl.max(h, axis=LOG_N - i)  # each run of K against its neighbour's: the larger K stay
            h = _bitonic_merge(h, LOG_K, 2 if i < LOG_N else 1, LOG_N - i + LOG_K)
        return tl.reshape(h, [K])

    @triton.jit
    def _order_keys(x, n, live):
        # int64 keys that order like (value, -index): the value's fp32 bits made order-preserving as a
        # signed int above, 2**32 - 1 - index below, so one integer top-k puts equal values lower index first
        bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)  # -0.0 ties +0.0
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
        return tl.where(live, (ordered << 32) | (4294967295 - n.to(tl.int64)), _KEY_PAD)

    @triton.jit
    def _order_keys16(x, i, live):
        # int32 keys of 16-bit values that order like (value, -i) for indices i < 65536 inside a chunk: the
        # value's 16 bits made order-preserving above, 65535 - i below. Half the width of _order_keys, for
        # the sorts of bf16 and fp16 logits
        bits = tl.where(x == 0.0, tl.zeros_like(x), x).to(tl.int16, bitcast=True).to(tl.int32)  # -0.0 ties +0.0
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFF)
        return tl.where(live, (ordered << 16) | (65535 - i), _KEY16_PAD)

    @triton.jit
    def _row_top_chunk_kernel(
        x_ptr,
        keys_ptr,
        ml_ptr,
        x_s,
        V: tl.constexpr,
        CHUNK: tl.constexpr,
        KP: tl.constexpr,
        GROUP: tl.constexpr,
        KEY16: tl.constexpr,
    ):
        # program (row, chunk): the chunk's max, sum of exp(x - max) and top KP entries as _order_keys. With
        # GROUP > 1 the sort is of the maxima of the chunk's runs of GROUP entries, then of the entries of
        # the KP runs with the largest: the top KP lie in those (keys are distinct: an entry of another run
        # would have KP runs' maxima above it). KEY16 (16-bit logits): the sorts are of _order_keys16 over
        # indices in the chunk, and only the top KP become _order_keys. V, the vocabulary, is a model's
        # constant
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        out = row * tl.num_programs(1) + chunk
        i = tl.arange(0, CHUNK)
        n = chunk * CHUNK + i
        live = n < V
        raw = tl.load(x_ptr + row * x_s + n, mask=live, other=float("-inf"))
        x = raw.to(tl.float32)
        m = tl.max(x, axis=0)
        s = tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), axis=0)
        if KEY16:
            key = _order_keys16(raw, i, live)
        else:
            key = _order_keys(x, n, live)
        if GROUP > 1:
            best = _top(tl.max(tl.reshape(key, [CHUNK // GROUP, GROUP]), axis=1), KP)
            if KEY16:
                first = ((65535 - (best & 65535)) // GROUP) * GROUP  # past the chunk for a run of padding
            else:
                first = ((4294967295 - (best & 4294967295)) // GROUP) * GROUP - chunk * CHUNK  # past V: padding
            i = tl.reshape(first[:, None] + tl.arange(0, GROUP)[None, :], [KP * GROUP])
            n = chunk * CHUNK + i
            live = (i < CHUNK) & (n < V)
            raw = tl.load(x_ptr + row * x_s + n, mask=live, other=float("-inf"))
            if KEY16:
                key = _order_keys16(raw, i, live)
            else:
                key = _order_keys(raw.to(tl.float32), n, live)
        top = _top(key, KP)
        if KEY16:  # back to the merge's int64 keys: the same order
            ordered = top >> 16
            bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFF).to(tl.int16)
            value = bits.to(raw.dtype, bitcast=True).to(tl.float32)
            top = _order_keys(value, chunk * CHUNK + 65535 - (top & 65535), top != _KEY16_PAD)
        tl.store(keys_ptr + out * KP + tl.arange(0, KP), top)
        tl.store(ml_ptr + 2 * out, m)
        tl.store(ml_ptr + 2 * out + 1, s)

    @triton.jit
    def _row_top_merge_kernel(
        keys_ptr, ml_ptr, lp_ptr, tok_ptr, K, CHUNKS: tl.constexpr, C_PAD: tl.constexpr, KP: tl.constexpr
    ):
        # program (row): the top KP of the chunks' candidates, the chunks' (max, sum) combined into the
        # row's logsumexp, and the first K keys unpacked to (value - logsumexp, index)
        row = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, C_PAD * KP)
        live = j < CHUNKS * KP
        top = tl.load(keys_ptr + row * CHUNKS * KP + j, mask=live, other=0)
        if CHUNKS > 1:  # one chunk's are sorted already
            top = _top(tl.where(live, top, _KEY_PAD), KP)
        c = tl.arange(0, C_PAD)
        m = tl.load(ml_ptr + 2 * (row * CHUNKS + c), mask=c < CHUNKS, other=float("-inf"))
        s = tl.load(ml_ptr + 2 * (row * CHUNKS + c) + 1, mask=c < CHUNKS, other=0.0)
        top_m = tl.max(m, axis=0)
        top_m = tl.where(top_m == float("-inf"), 0.0, top_m)
        lse = top_m + tl.log(tl.sum(s * tl.exp(m - top_m), axis=0))
        ordered = (top >> 32).to(tl.int32)
        value = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
        i = tl.arange(0, KP)
        tl.store(lp_ptr + row * K + i, value - lse, mask=i < K)
        tl.store(tok_ptr + row * K + i, 4294967295 - (top & 4294967295), mask=i < K)

    @triton.jit
    def _walk_kernel(
        tok_ptr,
        par_ptr,
        dep_ptr,
        valid_ptr,
        vis_ptr,
        dec_ptr,
        path_ptr,
        accepted_ptr,
        bonus_ptr,
        emitted_ptr,
        N,
        D1,
        tok_s,
        par_s,
        dep_s,
        valid_s,
        vis_sb,
        vis_si,
        dec_s,
        path_s,
        emitted_s,
        N_PAD: tl.constexpr,
        D_PAD: tl.constexpr,
    ):
        # program (row): verify.walk over the row's tree. A node agrees when its token is the target's
        # decision at its parent; the deepest node whose ancestors all agree ends the path
        b = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, N_PAD)
        live = j < N
        tok = tl.load(tok_ptr + b * tok_s + j, mask=live, other=-1)
        par = tl.maximum(tl.load(par_ptr + b * par_s + j, mask=live, other=0), 0)
        dep = tl.load(dep_ptr + b * dep_s + j, mask=live, other=0)
        valid = tl.load(valid_ptr + b * valid_s + j, mask=live, other=0) != 0
        parent_decision = tl.load(dec_ptr + b * dec_s + par, mask=live, other=-1)
        agree = ((tok == parent_decision) & valid) | (j == 0)
        vis = tl.load(
            vis_ptr + b * vis_sb + j[:, None] * vis_si + j[None, :], mask=live[:, None] & live[None, :], other=0
        )
        refused = tl.sum(((vis != 0) & ~agree[None, :]).to(tl.int32), axis=1)
        cur = tl.argmax(tl.where(live & (refused == 0), dep, -1), axis=0)  # the deepest accepted node
        accepted = tl.sum(tl.where(j == cur, dep, 0), axis=0) + 1
        on_path = tl.load(vis_ptr + b * vis_sb + cur * vis_si + j, mask=live, other=0) != 0  # cur's ancestors
        d = tl.arange(0, D_PAD)
        # path[d]: the path's node at depth d, then cur repeated; emitted[d]: the token of path[d + 1]
        # (path[D] at the last step), the bonus (the target's decision at cur) at d = accepted - 1
        node = tl.sum(tl.where(on_path[None, :] & (dep[None, :] == d[:, None]), j[None, :], 0), axis=1)
        path = tl.where(d < accepted, node, cur)
        d_next = tl.minimum(d + 1, D1 - 1)
        next_on_path = tl.sum(tl.where(on_path[None, :] & (dep[None, :] == d_next[:, None]), tok[None, :], 0), axis=1)
        next_tok = tl.where(d_next < accepted, next_on_path, tl.sum(tl.where(j == cur, tok, 0), axis=0))
        bonus = tl.load(dec_ptr + b * dec_s + cur)
        emitted = tl.where(d == accepted - 1, bonus, next_tok)
        tl.store(path_ptr + b * path_s + d, path, mask=d < D1)
        tl.store(emitted_ptr + b * emitted_s + d, emitted, mask=d < D1)
        tl.store(accepted_ptr + b, accepted)
        tl.store(bonus_ptr + b, bonus)

    @triton.jit
    def _row_max_chunk_kernel(x_ptr, max_ptr, idx_ptr, x_s, V: tl.constexpr, CHUNK: tl.constexpr):
        # program (row, chunk): the chunk's largest value and the index of its first occurrence
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        n = chunk * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * x_s + n, mask=n < V, other=float("-inf")).to(tl.float32)
        m, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        out = row * tl.num_programs(1) + chunk
        tl.store(max_ptr + out, m)
        tl.store(idx_ptr + out, chunk * CHUNK + i)

    @triton.jit
    def _row_max_merge_kernel(
        max_ptr, idx_ptr, out_ptr, first_max_ptr, T, CHUNKS: tl.constexpr, C_PAD: tl.constexpr, FIRST: tl.constexpr
    ):
        # program (row): the first chunk holding the row's largest value gives its index; with FIRST, the
        # first row of each group of T rows writes its largest value
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, C_PAD)
        m = tl.load(max_ptr + row * CHUNKS + c, mask=c < CHUNKS, other=float("-inf"))
        best, first = tl.max(m, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(out_ptr + row, tl.load(idx_ptr + row * CHUNKS + first).to(tl.int64))
        if FIRST:
            if row % T == 0:
                tl.store(first_max_ptr + row // T, best)

    @triton.jit
    def _commit_path_kernel(
        path_ptr,
        accepted_ptr,
        bonus_ptr,
        emitted_ptr,
        lengths_ptr,
        active_ptr,
        slot_map_ptr,
        bonus_out_ptr,
        readout_ptr,
        ctx_count_ptr,
        src_ptr,
        dst_ptr,
        trash,
        D1,
        path_s,
        emitted_s,
        readout_s,
        map_s,
        D_PAD: tl.constexpr,
        MOVES: tl.constexpr,
        STAGED: tl.constexpr,
    ):
        # program (row): the round's bookkeeping of the row's walk. With MOVES, the physical slots of the
        # path's nodes (src) and of the committed positions they move to (dst), both the trash slot for an
        # inactive row, read at the row's length before this program advances it
        b = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, D_PAD)
        live = d < D1
        accepted = tl.load(accepted_ptr + b)
        length = tl.load(lengths_ptr + b)
        active = tl.load(active_ptr + b) != 0
        if MOVES:
            path = tl.load(path_ptr + b * path_s + d, mask=live, other=0)
            src = tl.where(active, length + path, trash)
            dst = tl.where(active, length + d, trash)
            tl.store(src_ptr + b * D1 + d, tl.load(slot_map_ptr + b * map_s + src, mask=live), mask=live)
            tl.store(dst_ptr + b * D1 + d, tl.load(slot_map_ptr + b * map_s + dst, mask=live), mask=live)
        if STAGED:
            tl.store(ctx_count_ptr + b, accepted)
        tl.store(lengths_ptr + b, tl.where(active, length + accepted, length))
        tl.store(bonus_out_ptr + b, tl.load(bonus_ptr + b))
        tl.store(readout_ptr + b * readout_s, accepted)
        emitted = tl.load(emitted_ptr + b * emitted_s + d, mask=live)
        tl.store(readout_ptr + b * readout_s + 1 + d, emitted, mask=live)


def move_slots(storage: Tensor, src: Tensor, dst: Tensor, block_d: int = 128) -> None:
    """A model's `compact` in one launch: in every plane (layer, k/v) and head of storage [planes, heads,
    physical slots, width], copy physical slots src [bs, n] to dst [bs, n] (row b's path in row b). Each
    program reads all n slots of its (plane, row, head) before it writes any, since a path's slots and
    their destinations overlap. Where the gather and scatter of advanced indexing took two kernels that
    read the index tensors per element."""
    planes, heads, _, width = storage.shape
    bs, n = src.shape
    assert storage.stride(-1) == 1 and src.shape == dst.shape
    if not bs * n:
        return
    src, dst = src.contiguous(), dst.contiguous()
    _move_slots_kernel[(planes, bs * heads)](
        storage,
        src,
        dst,
        n,
        storage.stride(0),
        storage.stride(1),
        storage.stride(2),
        H=heads,
        D=width,
        N_PAD=max(2, triton.next_power_of_2(n)),
        BLOCK_D=min(block_d, triton.next_power_of_2(width)),
        num_warps=4,
    )


def walk(
    tokens: Tensor, parents: Tensor, depth: Tensor, valid: Tensor, visible: Tensor, decisions: Tensor, max_depth: int
):
    """verify.walk in one launch, one program per row: (path [bs, D + 1], accepted [bs], bonus [bs],
    emitted [bs, D + 1]) for a tree (Tree's fields) and the target's decisions [bs, N]. Where the
    tensorised walk took about 30 small kernels per round."""
    bs, n = tokens.shape
    d1 = max_depth + 1
    assert all(t.stride(-1) == 1 for t in (tokens, parents, depth, valid, visible, decisions))
    path = torch.empty(bs, d1, dtype=torch.long, device=tokens.device)
    emitted = torch.empty_like(path)
    accepted = torch.empty(bs, dtype=torch.long, device=tokens.device)
    bonus = torch.empty_like(accepted)
    if bs:
        valid8, visible8 = valid.view(torch.int8), visible.view(torch.int8)
        n_pad = max(2, triton.next_power_of_2(n))
        _walk_kernel[(bs,)](
            tokens,
            parents,
            depth,
            valid8,
            visible8,
            decisions,
            path,
            accepted,
            bonus,
            emitted,
            n,
            d1,
            tokens.stride(0),
            parents.stride(0),
            depth.stride(0),
            valid8.stride(0),
            visible8.stride(0),
            visible8.stride(1),
            decisions.stride(0),
            path.stride(0),
            emitted.stride(0),
            N_PAD=n_pad,
            D_PAD=max(2, triton.next_power_of_2(d1)),
            num_warps=1 if n_pad <= 64 else 4,
        )
    return path, accepted, bonus, emitted


def commit_path(
    path: Tensor,
    accepted: Tensor,
    bonus: Tensor,
    emitted: Tensor,
    lengths: Tensor,
    active: Tensor,
    slot_map: Tensor,
    trash: int,
    bonus_out: Tensor,
    readout: Tensor,
    ctx_count: Tensor | None,
    moves: bool,
) -> tuple[Tensor, Tensor] | None:
    """A round's bookkeeping of its walk (path [bs, D + 1], accepted [bs], bonus [bs], emitted [bs, D + 1])
    in one launch, one program per row: lengths [bs] advance by the accepted count where active [bs]
    (bool); bonus_out [bs] takes the bonus; readout [bs, >= D + 2] takes accepted, then emitted;
    ctx_count [bs], when given, takes accepted. With `moves`, returns the physical slots (int32 [bs, D + 1],
    through slot_map [>= bs, slots]) of the path's nodes and of the committed positions they move to, at
    the lengths before the advance, the logical `trash` slot for inactive rows: move_slots' src and dst.
    Where the tensor ops took about 15 small kernels per round."""
    bs, d1 = path.shape
    assert all(t.stride(-1) == 1 for t in (path, emitted, readout, slot_map)) and readout.shape[1] >= d1 + 1
    src = dst = None
    if moves:
        src = torch.empty(bs, d1, dtype=torch.int32, device=path.device)
        dst = torch.empty_like(src)
    if bs:
        _commit_path_kernel[(bs,)](
            path,
            accepted,
            bonus,
            emitted,
            lengths,
            active.view(torch.int8),
            slot_map,
            bonus_out,
            readout,
            ctx_count if ctx_count is not None else accepted,  # not written unless STAGED
            src if src is not None else path,  # not written unless MOVES
            dst if dst is not None else path,
            trash,
            d1,
            path.stride(0),
            emitted.stride(0),
            readout.stride(0),
            slot_map.stride(0),
            D_PAD=max(2, triton.next_power_of_2(d1)),
            MOVES=moves,
            STAGED=ctx_count is not None,
            num_warps=1,
        )
    return (src, dst) if moves else None


def row_argmax(x: Tensor, first_max: Tensor | None = None, chunk: int = 4096) -> Tensor:
    """x.argmax(-1) of x [..., T, V] (any float dtype; the first of equal largest values, as torch's), int64
    [..., T], in one read of x: programs of `chunk` entries keep their largest value and its index, and
    one program per row takes the first chunk of the largest. first_max [...], when given, takes
    x[..., 0, :].amax(-1) in fp32 (the verify's root logit that the smoke test compares). Where torch's
    reduction read a verify's logits at about a third of the copy bandwidth, plus a second reduction and a
    copy for the root."""
    vocab, T = x.shape[-1], x.shape[-2]
    rows = x.reshape(-1, vocab)
    assert rows.stride(-1) == 1
    chunk = min(chunk, triton.next_power_of_2(vocab))
    chunks = triton.cdiv(vocab, chunk)
    out = torch.empty(rows.shape[0], dtype=torch.long, device=x.device)
    if rows.shape[0]:
        maxima = torch.empty(rows.shape[0], chunks, dtype=torch.float32, device=x.device)
        index = torch.empty(rows.shape[0], chunks, dtype=torch.int32, device=x.device)
        _row_max_chunk_kernel[(rows.shape[0], chunks)](
            rows, maxima, index, rows.stride(0), V=vocab, CHUNK=chunk, num_warps=min(8, max(1, chunk // 512))
        )
        if first_max is not None:
            assert first_max.numel() * T == rows.shape[0] and first_max.is_contiguous()
        _row_max_merge_kernel[(rows.shape[0],)](
            maxima,
            index,
            out,
            first_max if first_max is not None else maxima,  # not written unless FIRST
            T,
            CHUNKS=chunks,
            C_PAD=max(2, triton.next_power_of_2(chunks)),
            FIRST=first_max is not None,
            num_warps=1,
        )
    return out.view(x.shape[:-1])


def row_logsumexp(x: Tensor, block: int = 2048) -> Tensor:
    """log(sum(exp(x))) over the last dimension in fp32, [...] for x [..., N] of any float dtype, in one
    read of x: the DDTree candidates take top-k of the draft logits as they are and this for their
    log-probabilities, where log_softmax wrote and read an fp32 copy of every logit."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        _row_logsumexp_kernel[(rows.shape[0],)](rows, out, rows.stride(0), N=rows.shape[1], BLOCK=block, num_warps=8)
    return out.view(x.shape[:-1])


def row_top_applies(k: int) -> bool:
    """Whether row_top_logprobs serves k candidates per row, in place of torch's top-k + row_logsumexp: up
    to k = 64 (a k past it would compile a merge of up to 64 x 256 keys), at any row count. On an H200
    (`bench.tree_candidates_micro`, 151936-wide bf16 logits, 2026-12-04) it took 0.013 ms for 15 rows of k
    8 (torch 0.093), 0.022 for 15 of k 32 (0.098), 0.116 for 240 of k 8 (0.422) and 0.162 for 240 of k 32
    (0.424). Sorting whole chunks (group 1), 240 rows of k 32 took 0.683 ms, slower than torch."""
    return k <= 64


def row_top_group(chunk: int, kp: int) -> int:
    """row_top_logprobs' run length: the power of two at or below sqrt(chunk / kp), so that the sort of
    the runs' maxima is no smaller than the sort of the best runs' entries (at chunk 4096: 16 for kp 8, 8
    for kp 32, the fastest or within 2 % of it on an H200, `bench.tree_candidates_micro`)."""
    return 1 << (math.isqrt(max(1, chunk // kp)).bit_length() - 1)


def row_top_logprobs(x: Tensor, k: int, chunk: int = 4096, group: int | None = None) -> tuple[Tensor, Tensor]:
    """The k largest log-softmax values of each row of x [..., V] (any float dtype) and their indices,
    ([..., k] float32 descending, [..., k] int64), equal values lower index first: each value in fp32
    less the row's fp32 logsumexp. Two launches, one read of x: programs of `chunk` entries each keep
    their top k and (max, sum of exp), and one program per row merges them. A chunk's top k is a bitonic
    sort of the maxima of its runs of `group` entries (row_top_group's by default), then of the entries
    of the k best runs (group 1: of the whole chunk). Faster than torch's top-k (a multi-block radix
    select) and row_logsumexp: see row_top_applies."""
    vocab = x.shape[-1]
    assert 1 <= k <= vocab and x.stride(-1) == 1
    rows = x.reshape(-1, vocab)
    kp = max(2, triton.next_power_of_2(k))  # a hypercube of at least one axis
    chunk = max(kp, min(chunk, triton.next_power_of_2(vocab)))
    chunks = triton.cdiv(vocab, chunk)
    group = row_top_group(chunk, kp) if group is None else group
    assert group >= 1 and group & (group - 1) == 0 and chunk // group >= kp, (chunk, kp, group)
    lp = torch.empty(rows.shape[0], k, dtype=torch.float32, device=x.device)
    tok = torch.empty(rows.shape[0], k, dtype=torch.int64, device=x.device)
    if rows.shape[0]:
        keys = torch.empty(rows.shape[0], chunks, kp, dtype=torch.int64, device=x.device)
        ml = torch.empty(rows.shape[0], chunks, 2, dtype=torch.float32, device=x.device)
        _row_top_chunk_kernel[(rows.shape[0], chunks)](
            rows,
            keys,
            ml,
            rows.stride(0),
            V=vocab,
            CHUNK=chunk,
            KP=kp,
            GROUP=group,
            KEY16=x.dtype.itemsize == 2 and chunk <= 32768,
            num_warps=min(8, max(1, chunk // 256)),
        )
        c_pad = triton.next_power_of_2(chunks)
        _row_top_merge_kernel[(rows.shape[0],)](
            keys, ml, lp, tok, k, CHUNKS=chunks, C_PAD=c_pad, KP=kp, num_warps=min(8, max(1, c_pad * kp // 256))
        )
    return lp.view(*x.shape[:-1], k), tok.view(*x.shape[:-1], k)


def qk_norm_rope_kv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    q_norm_w: Tensor | None,
    k_norm_w: Tensor | None,
    eps: float,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
) -> Tensor:
    """q [bs, T, heads, hd], k/v [bs, T, kv_heads, hd] (views of the fused q/k/v GEMM output are fine:
    only the last dim must be contiguous); cos/sin [bs, T, hd]; caches [kv_heads, physical slots, hd];
    slots [bs, T] physical.

    Normalises each q/k head (when the weights are given), applies RoPE, writes k and v at
    cache[kv_head, slot] and returns the rotated q as [bs, heads, T, hd] (contiguous)."""
    bs, T, n_heads, hd = q.shape
    n_kv = k.shape[2]
    assert hd % 2 == 0 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert cos.stride(-1) == sin.stride(-1) == 1 and k_cache.stride(-1) == v_cache.stride(-1) == 1
    assert (q_norm_w is None) == (k_norm_w is None)
    out = torch.empty(bs, n_heads, T, hd, dtype=q.dtype, device=q.device)
    if bs * T == 0:
        return out
    half = hd // 2
    norm = q_norm_w is not None
    # all of a token's heads per program from 8 tokens on; below, one head per program, which spreads
    # them over more SMs. On an H200 (8B shape, 36 layers, 2026-12-04): whole tokens 0.519 -> 0.164 ms at
    # 528 tokens, 0.182 -> 0.100 at 144, 0.094 -> 0.085 at 33 and 0.089 -> 0.084 at 9, but 0.074 -> 0.084
    # at one token (the batch-1 decode step)
    whole = bs * T >= 8
    qh = triton.next_power_of_2(max(n_heads, 1)) if whole else 1
    kh = triton.next_power_of_2(n_kv) if whole else 1
    _qk_norm_rope_kv_kernel[(bs * T, triton.cdiv(n_heads, qh) + triton.cdiv(n_kv, kh))](
        q,
        k,
        v,
        cos,
        sin,
        q_norm_w if norm else q,
        k_norm_w if norm else k,  # unused placeholders without the norm
        k_cache,
        v_cache,
        slots,
        out,
        T,
        eps,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        cos.stride(0),
        cos.stride(1),
        sin.stride(0),
        sin.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        slots.stride(0),
        slots.stride(1),
        N_HEADS=n_heads,
        N_KV=n_kv,
        QH=qh,
        KH=kh,
        HALF=half,
        BLOCK=triton.next_power_of_2(half),
        HAS_NORM=norm,
        **pdl(q.device),
        num_warps=min(8, max(1, max(qh, kh) * half // 512)) if whole else (1 if half <= 64 else 2),
    )
    return out


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up for gate_up [..., 2 * inter] = [gate | up] -> [..., inter]."""
    inter = gate_up.shape[-1] // 2
    gu = gate_up.reshape(-1, 2 * inter)
    assert gu.stride(-1) == 1
    out = torch.empty(gu.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if gu.shape[0]:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(gu.shape[0], triton.cdiv(inter, block))](
            gu, out, inter, gu.stride(0), out.stride(0), BLOCK=block, **pdl(gu.device), num_warps=4
        )
    return out.view(*gate_up.shape[:-1], inter)


def gemv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    silu_mul: bool = False,
    config: tuple[int, int, int, int] | None = None,
) -> Tensor:
    """F.linear(x, weight, bias) for a single row x [..., K] (a batch-1 decode step), as one kernel.

    cuBLAS serves one row with small tiles, and split-K plus a separate reduction kernel, which keeps
    the q/k/v, o and down projections of the 8B shape well above their copy-bandwidth time; here each
    program streams BLOCK_N whole rows of the weight, closer to it (measured on an H200:
    docs/engine.md, "Fused kernels"). silu_mul=True takes
    x = [gate | up] (2 K) and applies silu(gate) * up on the fly, which saves the silu_mul kernel
    before the down projection."""
    n_out, k = weight.shape
    assert x.shape[-1] == (2 * k if silu_mul else k) and x.numel() == x.shape[-1], "gemv takes one row"
    assert weight.stride(-1) == 1 and x.is_contiguous()
    block_n, block_k, warps, stages = config or (16, 1024, 8, 3)  # fused.TritonAttention.o_gemv's
    out = torch.empty(*x.shape[:-1], n_out, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n_out, block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        n_out,
        weight.stride(0),
        K=k,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SILU_MUL=silu_mul,
        HAS_BIAS=bias is not None,
        EVEN=n_out % block_n == 0 and k % block_k == 0,
        **pdl(x.device),
        num_warps=warps,
        num_stages=stages,
    )
    return out


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual) * weight, x + residual), both new tensors in the residual's dtype. x may
    have a leading dim of partial products to sum first (skinny_linear with K splits)."""
    n = residual.shape[-1]
    parts = x.shape[0] if x.dim() == residual.dim() + 1 else 1
    x3, r2 = x.reshape(parts, -1, n), residual.reshape(-1, n)
    assert x3.stride(-1) == r2.stride(-1) == 1 and weight.is_contiguous() and x3.shape[1] == r2.shape[0]
    normed, res = torch.empty_like(r2), torch.empty_like(r2)
    if r2.shape[0]:
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(r2.shape[0],)](
            x3,
            r2,
            weight,
            normed,
            res,
            n,
            eps,
            x3.stride(1),
            r2.stride(0),
            normed.stride(0),
            res.stride(0),
            x3.stride(0),
            BLOCK=block,
            PARTS=parts,
            **pdl(r2.device),
            num_warps=min(16, max(1, block // 512)),
        )
    return normed.view(residual.shape), res.view(residual.shape)


# rows skinny_linear serves (fused.TritonAttention / TritonMLP hold its configurations per projection)
SKINNY_MIN_ROWS, SKINNY_MAX_ROWS = 2, 64


def _config_fits(n: int, k: int, config: tuple[int, int, int, int, int] | None, dtype: torch.dtype) -> bool:
    """A GEMM configuration (BLOCK_N, BLOCK_K, K splits, warps, stages) divides an [n, k] weight of `dtype`
    (None: a projection the kernel does not serve). The configurations are for 16-bit weights: fp32 tiles
    would not fit in shared memory."""
    if config is None or dtype.itemsize != 2:
        return False
    block_n, block_k, splits, _, _ = config
    return n % block_n == 0 and k % (block_k * splits) == 0


def skinny_applies(
    rows: int, n: int, k: int, config: tuple[int, int, int, int, int] | None, dtype: torch.dtype
) -> bool:
    """skinny_linear serves an [n, k] weight of `dtype` at `rows` rows with `config`."""
    return SKINNY_MIN_ROWS <= rows <= SKINNY_MAX_ROWS and _config_fits(n, k, config, dtype)


def skinny_block_m(rows: int) -> int:
    """skinny_linear's row tile (the MMA's N side): the smallest power of two of 16 or more that holds the
    rows."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def _tma_loads(t: Tensor) -> bool:
    """A 2-D tensor TMA can read: 16-byte aligned start and row stride, contiguous rows."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0


def _has_tma(device: torch.device) -> bool:
    """Hopper and newer GPUs; older ones take the pointer loads, which Triton would otherwise emulate. The
    interpreter runs either."""
    return device.type != "cuda" or _hopper_or_newer(device)


def skinny_linear(
    x: Tensor,
    weight: Tensor,
    config: tuple[int, int, int, int, int],
    gate_up: bool = False,
    tma: bool | None = None,
) -> Tensor:
    """F.linear(x, weight) for a few rows (a verify forward at batch 1, a drafter's block), as one kernel.

    Each program streams BLOCK_N rows of the weight through tl.dot against all the rows of x, computed
    transposed so that the weight's rows fill the tensor cores' 64-row side and x's rows (on a row tile of
    skinny_block_m) the other, and loads both through TMA where their layout allows (`tma`: None, where
    it does; False, pointer loads), with no reduction kernel. At 33 rows of the 8B shape it reads o,
    gate/up and down closer to their copy-bandwidth time than cuBLAS (docs/engine.md, "Fused kernels").
    With K splits > 1 it returns the unsummed partial products [splits, *x.shape[:-1], N] in fp32, for
    add_rms_norm to add up. gate_up=True takes the fused [gate | up] weight and returns silu(gate) * up
    [..., N / 2], which saves the silu_mul kernel."""
    block_n, block_k, splits, warps, stages = config
    *lead, k = x.shape
    n_out = weight.shape[0] // 2 if gate_up else weight.shape[0]
    x2 = x.reshape(-1, k)
    rows, block_m = x2.shape[0], skinny_block_m(x2.shape[0])
    assert weight.shape[1] == k and weight.stride(-1) == 1 and x2.stride(-1) == 1
    assert skinny_applies(rows, n_out, k, config, weight.dtype) and not (gate_up and splits > 1), (
        rows,
        n_out,
        k,
        config,
    )
    if tma is None:
        tma = _has_tma(x.device) and _tma_loads(x2) and _tma_loads(weight)
    w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k]) if tma else None
    x_desc = TensorDescriptor.from_tensor(x2, [block_m, block_k]) if tma else None
    out = torch.empty(splits, rows, n_out, dtype=torch.float32 if splits > 1 else x.dtype, device=x.device)
    _skinny_linear_kernel[(n_out // block_n, splits)](
        w_desc,
        x_desc,
        weight,
        x2,
        out,
        rows,
        x2.stride(0),
        weight.stride(0),
        out.stride(1),
        out.stride(0),
        n_out,
        K_SPLIT=k // splits,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        STAGES=stages,
        GATE_UP=gate_up,
        TMA=tma,
        FP32_DOT=x.device.type == "cpu",
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        **pdl(x.device),
        num_warps=warps,
    )
    return out.view(splits, *lead, n_out) if splits > 1 else out.view(*lead, n_out)


# rows wide_linear serves: past skinny_linear's, up to a verify of 16 sequences of 12 tokens (at 256 rows
# cuBLAS was faster: fused.TritonMLP)
WIDE_MIN_ROWS, WIDE_MAX_ROWS = SKINNY_MAX_ROWS + 1, 192


def wide_row_tiles(rows: int) -> tuple[int, int]:
    """wide_linear's two row tiles (powers of two, 16 at least) for `rows` rows: the head as large as the
    rows allow, up to 128, and the smallest tail that covers the rest."""
    head = 128 if rows > 128 else 64
    return head, max(16, triton.next_power_of_2(max(rows - head, 1)))


def wide_applies(rows: int, n: int, k: int, config: tuple[int, int, int, int, int] | None, dtype: torch.dtype) -> bool:
    """wide_linear serves an [n, k] weight of `dtype` at `rows` rows with `config`."""
    return WIDE_MIN_ROWS <= rows <= WIDE_MAX_ROWS and _config_fits(n, k, config, dtype)


def wide_linear(x: Tensor, weight: Tensor, config: tuple[int, int, int, int, int]) -> Tensor:
    """F.linear(x, weight) for 65-192 rows (a verify forward at batch 16), as one kernel.

    cuBLAS runs these shapes at 1.3-1.4 x the weight's copy time, the K-split ones with a reduction kernel
    after (H100, docs/engine.md, "Known performance gaps"). Each program streams BLOCK_N rows of the
    weight through tl.dot against all the rows of x, transposed so that the rows cost no more MMA columns
    than two power-of-two tiles hold (wide_row_tiles). With K splits > 1 it returns the unsummed partial
    products [splits, *x.shape[:-1], N] in fp32, for add_rms_norm to add up, as skinny_linear does."""
    block_n, block_k, splits, warps, stages = config
    *lead, k = x.shape
    n_out = weight.shape[0]
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    assert weight.shape[1] == k and weight.stride(-1) == 1 and x2.stride(-1) == 1
    assert wide_applies(rows, n_out, k, config, weight.dtype), (rows, n_out, k, config)
    head, tail = wide_row_tiles(rows)
    out = torch.empty(splits, rows, n_out, dtype=torch.float32 if splits > 1 else x.dtype, device=x.device)
    _wide_linear_kernel[(n_out // block_n, splits)](
        x2,
        weight,
        out,
        rows,
        x2.stride(0),
        weight.stride(0),
        out.stride(1),
        out.stride(0),
        K_SPLIT=k // splits,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        HEAD_M=head,
        TAIL_M=tail,
        FP32_DOT=x.device.type == "cpu",
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        **pdl(x.device),
        num_warps=warps,
        num_stages=stages,
    )
    return out.view(splits, *lead, n_out) if splits > 1 else out.view(*lead, n_out)


def best_first_tree(roots: Tensor, top_lp: Tensor, top_tok: Tensor, budget: int):
    """DDTree's top-`budget` prefixes by the paper's best-first expansion, one program per sequence.

    top_lp / top_tok [bs, D, K]: each draft row's K most probable log-probabilities (descending) and
    tokens. Returns tokens, parents, depth [bs, N] (int64), valid [bs, N] and visible [bs, N, N]
    (bool) and scores [bs, N] (float32 path log-probabilities), N = budget + 1, nodes in pop order (best
    first, so a parent precedes its children); padded nodes (fewer prefixes than the budget) are invalid,
    score -inf and see only themselves.

    The pops are serial, so each one's reductions are its latency: one warp (shuffles, no shared-memory
    round trips) up to budget 32, where it took 0.017 ms for B=32 at batch 1 against 0.021
    with four warps on an H200 (2026-12-04; 0.033 before the reductions were packed)."""
    bs, depth, k = top_lp.shape
    n, dev = budget + 1, top_lp.device
    assert n <= 1024 and depth < 1024 and k <= 2048, "node, depth and rank are packed in 10, 10 and 11 bits"
    top_lp, top_tok = top_lp.float().contiguous(), top_tok.contiguous()
    tokens = torch.empty(bs, n, dtype=torch.long, device=dev)
    parents, node_depth = torch.empty_like(tokens), torch.empty_like(tokens)
    valid = torch.empty(bs, n, dtype=torch.int8, device=dev)
    visible = torch.empty(bs, n, n, dtype=torch.bool, device=dev)
    scores = torch.empty(bs, n, dtype=torch.float32, device=dev)
    _best_first_tree_kernel[(bs,)](
        top_lp,
        top_tok,
        roots.contiguous(),
        tokens,
        parents,
        node_depth,
        valid,
        visible.view(torch.int8),
        scores,
        depth,
        k,
        n,
        B=budget,
        CAP=triton.next_power_of_2(2 * budget + 1),
        N_PAD=triton.next_power_of_2(n),
        num_warps=1 if budget <= 32 else 4,
    )
    return tokens, parents, node_depth, valid.bool(), visible, scores


def attention_launch(T: int, row_programs: int, span: int) -> tuple[int, int, int]:
    """(key slots per program, pipeline stages, keys per step) of `attention`. Few programs along the rows
    (bs * KV heads * row blocks) need short chunks to fill the GPU; many take long ones, which cut the
    partial results to write and merge, down to one chunk for the whole span (no merge). Within 8 % of the
    fastest of 64..4096 slots and two or three stages on the 8B shape at 1200 of 2048 and 3000 of 4096
    slots on an H200 (2026-12-04, `bench.attention_sweep`; docs/engine.md, "Fused kernels"): 64 slots for
    a one-token step at batch 1 and 128 for 9 and 16 tokens (8 row programs), 256 for 33 tokens at batch 1
    (24), 512 for batch 4 at 33 tokens and batch 16 at one token (96-128), the whole span in three stages
    for 9 and 16 tokens at batch 16 (128: 0.031 and 0.029 against 0.039 and 0.045 ms per layer in chunks
    of 512), the whole span from batch 64 (512). Batch 16 at 33 tokens (384) takes the whole span in three
    stages with 32 keys a step, where 64 spill registers: 0.061 against 0.087 ms a layer for 1024 slots in
    two stages with 64 keys (H200 and H100, 2026-12-05 and 06, the same sweep with `block_ns`; in rounds
    too once the mask's rows are aligned: aligned_rows)."""
    if row_programs >= 512:
        return triton.next_power_of_2(span), 2, 64
    if row_programs >= 256:
        return (triton.next_power_of_2(span), 3, 32) if T > 16 else (1024, 2, 64)
    if row_programs >= 128 and 1 < T <= 16:
        return triton.next_power_of_2(span), 3, 64
    if row_programs >= 64:
        return 512, 2, 64
    if row_programs >= 24:
        return 256, 2, 64
    return (64 if T == 1 else 128), 2, 64


class MaskMeta(NamedTuple):
    """What the attention layers of one forward share about its [bs, 1, T, span] mask: mask_bounds, and the
    mask itself in aligned_rows."""

    bounds: Tensor
    mask: Tensor


def mask_meta(mask: Tensor) -> MaskMeta:
    return MaskMeta(mask_bounds(mask), aligned_rows(mask))


def mask_and_bounds(mask: Tensor, meta: MaskMeta | None) -> tuple[Tensor, Tensor | None]:
    """The mask and bounds an attention kernel takes: the forward's shared ones, else the mask as given
    (the kernel computes its bounds)."""
    return (meta.mask, meta.bounds) if meta is not None else (mask, None)


def aligned_rows(mask: Tensor) -> Tensor:
    """`mask` [bs, 1, T, span] bool with its sequence and row strides multiples of 16 bytes: itself when they
    are, else a copy in rows padded to 16 (broadcast dimensions stay broadcast). Triton specialises the
    attention kernels on those strides' divisibility: at 33 tokens, 32 keys a step, a span of 1505 compiled
    to 220 registers where a span of 2048 took 164 (sm_90a), two programs an SM instead of three, and the
    batch-16 verify's attention ran 0.092 ms a layer instead of 0.060 (H100). One copy a forward, shared
    by its layers (bs x T x span bytes, within the memory plan's count of one layer's attention scores);
    a span bucket that is a multiple of 16 needs none."""
    bs, _, T, span = mask.shape
    if mask.stride(0) % 16 == 0 and mask.stride(2) % 16 == 0 and mask.stride(3) == 1:
        return mask
    batch, rows = (bs if mask.stride(0) else 1), (T if mask.stride(2) else 1)
    padded = torch.empty(batch, 1, rows, -(-span // 16) * 16, dtype=mask.dtype, device=mask.device)
    padded = padded[..., :span]
    padded.copy_(mask[:batch, :, :rows])
    return padded.expand(bs, 1, T, span)


def mask_bounds(mask: Tensor) -> Tensor:
    """[bs, 2] int32 for a [bs, 1, T, span] bool mask (broadcast strides are fine): per sequence, one past
    the last slot any query sees, and the number of leading slots every query sees. `attention` reads no
    key past the first and no mask before the second. The layers of a forward share one mask, so the
    model computes this once per forward (fused.TritonAttention.metadata)."""
    bs, _, T, span = mask.shape
    bounds = torch.zeros(bs, 2, dtype=torch.int32, device=mask.device)
    bounds[:, 1] = span
    if bs * T * span:
        m8 = mask.view(torch.int8)
        block_t = triton.next_power_of_2(T)
        block_s = max(128, 8192 // block_t)
        _mask_bounds_kernel[(bs, triton.cdiv(span, block_s))](
            m8, bounds, T, span, m8.stride(0), m8.stride(2), m8.stride(3), BLOCK_T=block_t, BLOCK_S=block_s, num_warps=4
        )
    return bounds


def combine_chunks(acc: Tensor, ml: Tensor, out: Tensor, splits: int) -> None:
    """Write out [bs, T, heads, D] from the chunks' unnormalised softmaxes: acc [bs * heads * splits * T,
    BLOCK_D] and their row max and sum ml [.., 2], in _attention_write's layout (flash-decoding's merge)."""
    bs, T, heads, hd = out.shape
    block_d = acc.shape[1]
    _attention_combine_kernel[(bs * heads, T)](
        acc,
        ml,
        out,
        T,
        splits,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        H=heads,
        D=hd,
        S_PAD=triton.next_power_of_2(splits),
        BLOCK_D=block_d,
        **pdl(out.device),
        num_warps=1 if block_d <= 64 else 2 if block_d <= 128 else 4,
    )


def attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_map: Tensor,
    mask: Tensor,
    rows: Tensor | None,
    bounds: Tensor | None = None,
    chunk: int | None = None,
    max_rows: int = 64,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> Tensor:
    """Masked attention of a few query tokens over the cache (a verify, the drafter's block).

    q [bs, heads, T, hd]; caches [kv_heads, physical slots, hd] (GQA: heads a multiple of kv_heads);
    slot_map [max_batch, logical slots] int32: each cache row's physical slot of each logical slot;
    mask [bs, 1, T, span] bool (broadcast strides are fine) says which of the first `span` logical slots
    each query sees; rows [bs] cache rows (None: 0..bs-1); bounds: mask_bounds(mask) (computed here when None).
    Returns [bs, T, heads * hd], the layout o_proj takes.

    SDPA runs a verify with one program per head streaming every key (most SMs idle), and turns the
    boolean mask into an additive one in every layer. Here the keys are split into chunks of `chunk`
    slots (default: attention_launch), one program per (sequence, KV head, block of max_rows rows of its
    query heads, chunk), and a second kernel merges the chunks' softmaxes (flash-decoding); with one
    chunk for the whole span the programs write the output themselves. The mask is read as is, and only
    past the prefix every query sees (its rows best aligned: aligned_rows). max_rows, block_n (keys per
    step), num_warps and num_stages are tuning knobs (default: attention_launch), kept as arguments for
    configuration sweeps."""
    bs, heads, T, hd = q.shape
    kv_heads, span = k_cache.shape[0], mask.shape[-1]
    assert heads % kv_heads == 0 and span <= slot_map.shape[1] and slot_map.stride(1) == 1
    mask = mask.expand(bs, 1, T, span)
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    # the kernel addresses a key's k and v by one int32 offset in its head's plane
    assert k_cache.stride(1) == v_cache.stride(1) and k_cache.shape[1] * k_cache.stride(1) < 2**31
    out = torch.empty(bs, T, heads, hd, dtype=q.dtype, device=q.device)
    if bs * T == 0:
        return out.view(bs, T, heads * hd)
    group = heads // kv_heads
    # the rows of a KV head's query heads (group x T) in tiles of up to max_rows
    block_m = min(max_rows, max(16, triton.next_power_of_2(group * T)))
    block_d = max(16, triton.next_power_of_2(hd))
    row_blocks = triton.cdiv(group * T, block_m)
    default_chunk, default_stages, default_block_n = attention_launch(T, bs * kv_heads * row_blocks, span)
    chunk, num_stages = chunk or default_chunk, num_stages or default_stages
    block_n = block_n or default_block_n
    splits = triton.cdiv(span, chunk)
    direct = splits == 1
    # the chunks' partial softmaxes (unused when one chunk holds every key)
    acc = torch.empty(0 if direct else bs * heads * splits * T, block_d, dtype=torch.float32, device=q.device)
    ml = torch.empty(0 if direct else bs * heads * splits * T, 2, dtype=torch.float32, device=q.device)
    m8 = mask.view(torch.int8)
    bounds = mask_bounds(mask) if bounds is None else bounds
    _attention_partial_kernel[(bs * kv_heads * row_blocks, splits)](
        q,
        k_cache,
        v_cache,
        slot_map,
        m8,
        bounds,
        rows if rows is not None else m8,
        acc,
        ml,
        out,
        T,
        span,
        hd**-0.5 * SOFTMAX_SCALE,
        splits,
        row_blocks,
        chunk,  # runtime values: new prompt lengths and spans compile nothing new
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        slot_map.stride(0),
        m8.stride(0),
        m8.stride(2),
        m8.stride(3),
        rows.stride(0) if rows is not None else 0,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        H=heads,
        GROUP=group,
        D=hd,
        DIRECT=direct,
        BLOCK_M=block_m,
        BLOCK_N=min(block_n, chunk),
        BLOCK_D=block_d,
        HAS_ROWS=rows is not None,
        FP32_DOT=q.device.type == "cpu",
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **pdl(q.device),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if not direct:
        combine_chunks(acc, ml, out, splits)
    return out.view(bs, T, heads * hd)
