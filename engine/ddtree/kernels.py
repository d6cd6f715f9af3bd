"""Fused Triton kernels for inference: fewer, larger kernels per decoder layer.

A batch-1 decode step is bound by weight reads, so every small element-wise kernel between the GEMMs
(norms, RoPE, KV writes, SiLU, residual adds) is pure launch and round-trip cost. Three kernels
replace them:

  qk_norm_rope_kv  per-head RMSNorm of q and k (Qwen3), RoPE, k/v written into the cache, q out
  silu_mul         silu(gate) * up from the fused gate/up GEMM output
  add_rms_norm     residual add + RMSNorm of the sum

The pure-PyTorch code in model.py stays the reference and the CPU path. Arithmetic is in fp32 with
one rounding to the output dtype, so results agree with the reference to bf16 rounding, not bitwise.
Launches read no tensor values on the host: everything is CUDA-graph capturable. With
TRITON_INTERPRET=1 set before triton is imported, the same kernels run on CPU tensors (the tests).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch path is used
    triton = None


def available(device: torch.device | str) -> bool:
    """Triton can run on tensors of `device`: CUDA, or CPU under the Triton interpreter."""
    if triton is None:
        return False
    kind = torch.device(device).type
    return kind == "cuda" or (kind == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _rms_halves(x1, x2, w_ptr, d, mask, HALF: tl.constexpr, eps):
        """RMSNorm of a head held as its two rotate-half halves (masked lanes are 0)."""
        var = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF)
        r = 1.0 / tl.sqrt(var + eps)
        w1 = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=mask, other=0.0).to(tl.float32)
        return x1 * r * w1, x2 * r * w2

    @triton.jit
    def _qk_norm_rope_kv_kernel(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, kc_ptr, vc_ptr, rows_ptr, slots_ptr, out_ptr,
        T, eps,
        q_sb, q_st, q_sh, k_sb, k_st, k_sh, v_sb, v_st, v_sh,
        cos_sb, cos_st, sin_sb, sin_st,
        kc_sb, kc_sh, kc_ss, vc_sb, vc_sh, vc_ss,
        sl_sb, sl_st, rows_s,
        N_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
        HAS_NORM: tl.constexpr, HAS_ROWS: tl.constexpr,
    ):
        # one program per (token, head); heads 0..N_HEADS-1 are query heads, the rest KV heads
        tok = tl.program_id(0).to(tl.int64)  # int64: cache offsets can pass 2**31
        head = tl.program_id(1)
        b = tok // T
        t = tok % T
        d = tl.arange(0, BLOCK)
        m = d < HALF
        c1 = tl.load(cos_ptr + b * cos_sb + t * cos_st + d, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + b * cos_sb + t * cos_st + HALF + d, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + b * sin_sb + t * sin_st + d, mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + b * sin_sb + t * sin_st + HALF + d, mask=m, other=0.0).to(tl.float32)
        if head < N_HEADS:
            src = q_ptr + b * q_sb + t * q_st + head * q_sh
            x1 = tl.load(src + d, mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(src + HALF + d, mask=m, other=0.0).to(tl.float32)
            if HAS_NORM:
                x1, x2 = _rms_halves(x1, x2, qw_ptr, d, m, HALF, eps)
            # rotate-half RoPE: [x1, x2] * cos + [-x2, x1] * sin
            dst = out_ptr + ((b * N_HEADS + head) * T + t) * (2 * HALF)  # [bs, heads, T, hd]
            tl.store(dst + d, (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty), mask=m)
            tl.store(dst + HALF + d, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty), mask=m)
        else:
            h = head - N_HEADS
            src = k_ptr + b * k_sb + t * k_st + h * k_sh
            x1 = tl.load(src + d, mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(src + HALF + d, mask=m, other=0.0).to(tl.float32)
            if HAS_NORM:
                x1, x2 = _rms_halves(x1, x2, kw_ptr, d, m, HALF, eps)
            if HAS_ROWS:
                row = tl.load(rows_ptr + b * rows_s)
            else:
                row = b
            slot = tl.load(slots_ptr + b * sl_sb + t * sl_st)
            dst = kc_ptr + row * kc_sb + h * kc_sh + slot * kc_ss
            tl.store(dst + d, (x1 * c1 - x2 * s1).to(kc_ptr.dtype.element_ty), mask=m)
            tl.store(dst + HALF + d, (x2 * c2 + x1 * s2).to(kc_ptr.dtype.element_ty), mask=m)
            vsrc = v_ptr + b * v_sb + t * v_st + h * v_sh
            vdst = vc_ptr + row * vc_sb + h * vc_sh + slot * vc_ss
            tl.store(vdst + d, tl.load(vsrc + d, mask=m, other=0.0).to(vc_ptr.dtype.element_ty), mask=m)
            tl.store(vdst + HALF + d, tl.load(vsrc + HALF + d, mask=m, other=0.0).to(vc_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, inter, gu_s, out_s, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < inter
        g = tl.load(gu_ptr + row * gu_s + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * gu_s + inter + c, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_s + c, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_ptr, N, eps, x_s, r_s, out_s, res_s,
                             BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        m = c < N
        x = tl.load(x_ptr + row * x_s + c, mask=m, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * r_s + c, mask=m, other=0.0).to(tl.float32)
        # the residual stream is kept in the model dtype; normalise that rounded sum, as the unfused path does
        s = (x + r).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * res_s + c, s, mask=m)
        s = s.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / N + eps)
        w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_s + c, (s * rstd * w).to(out_ptr.dtype.element_ty), mask=m)


def qk_norm_rope_kv(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, q_norm_w: Tensor | None,
                    k_norm_w: Tensor | None, eps: float, k_cache: Tensor, v_cache: Tensor,
                    rows: Tensor | None, slots: Tensor) -> Tensor:
    """q [bs, T, heads, hd], k/v [bs, T, kv_heads, hd] (views of the fused q/k/v GEMM output are fine:
    only the last dim must be contiguous); cos/sin [bs, T, hd]; caches [max_batch, kv_heads, slots, hd];
    rows [bs] cache rows (None: 0..bs-1); slots [bs, T].

    Normalises each q/k head (when the weights are given), applies RoPE, writes k and v at
    cache[row, kv_head, slot] and returns the rotated q as [bs, heads, T, hd] (contiguous)."""
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
    _qk_norm_rope_kv_kernel[(bs * T, n_heads + n_kv)](
        q, k, v, cos, sin,
        q_norm_w if norm else q, k_norm_w if norm else k,  # unused placeholders without the norm
        k_cache, v_cache, rows if rows is not None else slots, slots, out,
        T, eps,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        slots.stride(0), slots.stride(1), rows.stride(0) if rows is not None else 0,
        N_HEADS=n_heads, HALF=half, BLOCK=triton.next_power_of_2(half),
        HAS_NORM=norm, HAS_ROWS=rows is not None,
        num_warps=1 if half <= 64 else 2,
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
            gu, out, inter, gu.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], inter)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual) * weight, x + residual), both new tensors in x's dtype."""
    n = x.shape[-1]
    x2, r2 = x.reshape(-1, n), residual.reshape(-1, n)
    assert x2.stride(-1) == r2.stride(-1) == 1 and weight.is_contiguous()
    normed, res = torch.empty_like(x2), torch.empty_like(x2)
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, normed, res, n, eps, x2.stride(0), r2.stride(0), normed.stride(0), res.stride(0),
            BLOCK=block, num_warps=min(16, max(1, block // 512)))
    return normed.view(x.shape), res.view(x.shape)
