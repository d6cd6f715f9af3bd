"""Weight-only quantised GEMMs: the weight stays packed in memory and is dequantised tile by tile in
registers, so a decode step reads 4 (INT4) or 8 (FP8) bits per weight instead of 16.

Layouts are the checkpoints' own (ddtree.models.quant is the PyTorch reference), read as published:

  INT4 (compressed-tensors pack-quantized, symmetric): packed int32 [N, ceil(K / 8)], eight 4-bit values
       a word, low nibble first, each stored as value + 8; scale [N, K / G]. w[n, k] = (q - 8) * scale[n, k // G].
  FP8 block (DeepSeek-V3): float8_e4m3fn [N, K], scale_inv fp32 [ceil(N / BN), ceil(K / BK)].
       w[n, k] = fp8[n, k] * scale_inv[n // BN, k // BK].

Activations stay in the model dtype (W4A16, W8A16) and products are summed in fp32. An INT4 weight is
rounded to the activations' dtype before the dot, as the reference dequantises it in the scale's (the
model's) dtype; an FP8 weight is exact in bf16 and fp16, and scaled after the dot. One packed int32
word holds eight consecutive k, so an INT4 K tile is read as [BLOCK_K / 8, BLOCK_N] words and its eight
nibble planes (k = 8 i + j for plane j) go through eight tl.dot calls of inner size BLOCK_K / 8, against
the matching stride-8 columns of x: each weight word is loaded once, with no reshapes. The alternatives
in INT4_UNPACK unpack the whole [BLOCK_K, BLOCK_N] tile for one dot of inner size BLOCK_K instead. G is
a multiple of 8 (or K: per channel), so the eight k of a word share a scale.

One row (a decode step) takes a GEMV path without tl.dot (no padding to 16 rows); few rows use 16-row
dot tiles. When the output has too few column tiles to fill the GPU, K is split across programs and the
fp32 partial products summed after. The grouped INT4 GEMM for mixture-of-experts layers mirrors
ddtree.runtime.moe_kernels.grouped_gemm over align_pairs' blocks. Nothing reads tensor values on the
host (CUDA-graph capturable). On CPU the same kernels run under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .kernels import triton
from .moe_kernels import align_pairs, combine_pairs

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _nibbles(words, scale, J: tl.constexpr):
        """Plane J of a tile of packed words, dequantised to fp32 ((q - 8) * scale)."""
        return (((words >> (4 * J)) & 0xF) - 8).to(tl.float32) * scale

    def _packed_planes_asm(bf16: bool) -> str:
        """PTX for _packed_planes: inputs $8, $9 (two packed words) and $10 (their scales, two 16-bit lanes),
        outputs $0..$7 (plane j of both words, two 16-bit lanes)."""
        one, bias, magic, fma = (
            ("0x3F803F80", "0xC308C308", "0x43004300", "fma.rn.bf16x2")  # 1.0, -136.0, 128.0
            if bf16
            else ("0x3C003C00", "0xE408E408", "0x64006400", "fma.rn.f16x2")  # 1.0, -1032.0, 1024.0
        )
        asm = [
            "{ .reg .b32 lo, hi, t, one, bias, nz;",
            f"mov.b32 one, {one}; mov.b32 bias, {bias}; mov.b32 nz, 0x80008000;",
            # lo: nibbles 0-3 of $8 in the low half, of $9 in the high half; hi: nibbles 4-7
            "prmt.b32 lo, $8, $9, 0x5410; prmt.b32 hi, $8, $9, 0x7632;",
        ]
        for j in range(8):
            src, shift = ("lo", "hi")[j // 4], 4 * (j % 4)
            if shift:
                asm.append(f"shr.b32 t, {src}, {shift};")
                src = "t"
            # (src & 0x000F000F) | magic: magic + q in each lane; then (that - (magic + 8)) * scale
            asm.append(f"lop3.b32 t, {src}, 0x000F000F, {magic}, 0xEA; {fma} t, t, one, bias; {fma} ${j}, t, $10, nz;")
        return " ".join(asm) + " }"

    _PLANES_BF16 = tl.constexpr(_packed_planes_asm(True))
    _PLANES_FP16 = tl.constexpr(_packed_planes_asm(False))

    @triton.jit
    def _packed_planes(words, scale):
        """The eight nibble planes of a tile of packed words, dequantised ((q - 8) * scale) in the scale's
        16-bit dtype by packed two-lane arithmetic, two words at a time, with no integer-to-float
        conversion: a nibble OR-ed into the mantissa of 128.0 (bf16; 1024.0 in fp16) is 128 + q exactly,
        one FMA subtracts 136 (q - 8, exact) and one multiplies by the scale (one rounding, as the
        reference's (q - 8) * scale in that dtype): about 2 instructions a weight, against a shift, a
        mask, a conversion, a multiply and half a pack on the fp32 path (docs/engine.md, "Quantized weights")."""
        return tl.inline_asm_elementwise(
            _PLANES_BF16 if scale.dtype == tl.bfloat16 else _PLANES_FP16,
            "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r",
            [words, scale],
            dtype=(scale.dtype,) * 8,
            is_pure=True,
            pack=2,
        )

    @triton.jit
    def _fragment_rows(W: tl.constexpr):
        """The words of a [W, ...] tile in _fragment_order's order: row r holds word 16 c + 4 a + 2 h + b for
        r = 16 c + 8 h + 2 a + b."""
        r = tl.arange(0, W)
        return r // 16 * 16 + (r // 2) % 4 * 4 + (r // 8) % 2 * 2 + r % 2

    @triton.jit
    def _fragment_order(tile, W: tl.constexpr, BLOCK_N: tl.constexpr):
        """A [W, BLOCK_N] tile of words (or their scales or planes) with its rows in the order of an m16n8k16
        MMA's B fragment (thread t of a quad holds k 2 t, 2 t + 1, 2 t + 8, 2 t + 9): the rows a thread
        loaded as four consecutive words (16 bytes) become the rows its fragment needs, so the dot takes them
        without shuffles. Only the dot's inner index is relabelled; the activations follow (_fragment_rows)."""
        t = tl.reshape(tile, (W // 16, 4, 2, 2, BLOCK_N))  # word 16 c + 4 a + 2 h + b
        return tl.reshape(tl.permute(t, (0, 2, 1, 3, 4)), (W, BLOCK_N))

    @triton.jit
    def _fragment_columns(tile, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """An activation tile [BLOCK_M, BLOCK_K] (column 8 i + j) with its words i in _fragment_order's order."""
        t = tl.reshape(tile, (BLOCK_M, BLOCK_K // 128, 4, 2, 2, 8))
        return tl.reshape(tl.permute(t, (0, 1, 3, 2, 4, 5)), (BLOCK_M, BLOCK_K))

    @triton.jit
    def _column_planes(tile, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """The eight stride-8 column planes of a [BLOCK_M, BLOCK_K] tile (plane j: columns 8 i + j), split
        in registers from one contiguous load."""
        t = tl.reshape(tile, (BLOCK_M, BLOCK_K // 8, 2, 2, 2))  # (row, i, j // 4, j // 2 % 2, j % 2)
        e, o = tl.split(t)
        ee, eo = tl.split(e)
        oe, oo = tl.split(o)
        p0, p4 = tl.split(ee)
        p2, p6 = tl.split(eo)
        p1, p5 = tl.split(oe)
        p3, p7 = tl.split(oo)
        return p0, p1, p2, p3, p4, p5, p6, p7

    @triton.jit
    def _int4_tile(
        q_rows, s_rows, k0, K, n_ok, G: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, UNPACK: tl.constexpr
    ):
        """The [BLOCK_K, BLOCK_N] weight tile for k0 + arange(BLOCK_K), dequantised to fp32 (zero past K) for
        one dot of inner size BLOCK_K. "gather" loads each word once per k (8 times; the caches serve the
        repeats), "expand" loads the [BLOCK_K / 8, BLOCK_N] words (and their scales) once and repeats them
        in registers."""
        kk = k0 + tl.arange(0, BLOCK_K)
        if UNPACK == "expand":  # words and their scales at word granularity, each repeated 8 times along K
            word = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            word_ok = (word < (K + 7) // 8)[:, None] & n_ok[None, :]
            words = tl.load(q_rows + word[:, None], mask=word_ok, other=0)
            scale = tl.load(s_rows + (word * 8 // G)[:, None], mask=word_ok, other=0.0)
            words = tl.reshape(tl.broadcast_to(words[:, None, :], (BLOCK_K // 8, 8, BLOCK_N)), (BLOCK_K, BLOCK_N))
            scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (BLOCK_K // 8, 8, BLOCK_N)), (BLOCK_K, BLOCK_N))
        else:  # past K in the last word the scale is masked to zero (x is zero there too)
            tile_ok = (kk < K)[:, None] & n_ok[None, :]
            words = tl.load(q_rows + (kk // 8)[:, None], mask=tile_ok, other=0)
            scale = tl.load(s_rows + (kk // G)[:, None], mask=tile_ok, other=0.0)
        return (((words >> ((kk % 8) * 4)[:, None]) & 0xF) - 8).to(tl.float32) * scale.to(tl.float32)

    @triton.jit
    def _int4_linear_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        out_ptr,
        M,
        N,
        K,
        x_s,
        q_s,
        s_s,
        out_s,
        part_s,
        G: tl.constexpr,
        K_SPLIT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GEMV: tl.constexpr,
        FP32_DOT: tl.constexpr,
        PRECISION: tl.constexpr,
        UNPACK: tl.constexpr,  # "planes" (always for GEMV), "packed", "gather" or "expand": see INT4_UNPACK
    ):
        # out[m, n] = sum_k x[m, k] * w[n, k] over this program's K slice (all of K unless split)
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(2)
        i = tl.arange(0, BLOCK_K // 8)
        m_ok, n_ok = m < M, n < N
        q_rows = q_ptr + n[None, :].to(tl.int64) * q_s
        s_rows = s_ptr + n[None, :].to(tl.int64) * s_s
        x_rows = x_ptr + m[:, None].to(tl.int64) * x_s
        if GEMV:  # one row: elementwise products, summed once at the end
            acc = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K_SPLIT, BLOCK_K):
            if UNPACK == "planes" or UNPACK == "packed":
                word = (split * K_SPLIT + k0) // 8 + i
                w_ok = word < (K + 7) // 8
                tile_ok = w_ok[:, None] & n_ok[None, :]
                words = tl.load(q_rows + word[:, None], mask=tile_ok, other=0)
                scale = tl.load(s_rows + (word * 8 // G)[:, None], mask=tile_ok, other=0.0)
                if UNPACK == "packed":
                    planes = _packed_planes(words, scale.to(x_ptr.dtype.element_ty))
                for j in tl.static_range(8):
                    if UNPACK == "packed":
                        w = planes[j]
                    else:
                        w = _nibbles(words, scale.to(tl.float32), j)
                    kk = word * 8 + j
                    if GEMV:
                        a = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
                        acc += w * a[:, None]
                    else:
                        a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
                        if FP32_DOT:  # the interpreter computes bf16 dots wrongly
                            a = a.to(tl.float32)
                        else:
                            w = w.to(a.dtype)
                        acc = tl.dot(a, w, acc, input_precision=PRECISION)
            else:
                start = split * K_SPLIT + k0
                w = _int4_tile(q_rows, s_rows, start, K, n_ok, G, BLOCK_K, BLOCK_N, UNPACK)
                kk = start + tl.arange(0, BLOCK_K)
                a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
                if FP32_DOT:
                    a = a.to(tl.float32)
                else:
                    w = w.to(a.dtype)
                acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GEMV:
            tl.store(out_ptr + split * part_s + n, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=n_ok)
        else:
            tl.store(
                out_ptr + split * part_s + m[:, None].to(tl.int64) * out_s + n[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=m_ok[:, None] & n_ok[None, :],
            )

    @triton.jit
    def _fp8_block_linear_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        out_ptr,
        M,
        N,
        K,
        x_s,
        w_s,
        s_s,
        out_s,
        part_s,
        SCALE_N: tl.constexpr,
        SCALE_K: tl.constexpr,
        K_SPLIT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GEMV: tl.constexpr,
        FP32_DOT: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        # as _int4_linear_kernel; BLOCK_K divides SCALE_K, so a K tile has one scale per column, applied to
        # the tile's product (fp8 is exact in bf16 and fp16: the dot sees the stored weight unrounded)
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(2)
        m_ok, n_ok = m < M, n < N
        w_rows = w_ptr + n[None, :].to(tl.int64) * w_s
        s_row = s_ptr + (n // SCALE_N) * s_s
        x_rows = x_ptr + m[:, None].to(tl.int64) * x_s
        if GEMV:
            acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K_SPLIT, BLOCK_K):
            start = split * K_SPLIT + k0
            kk = start + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            w = tl.load(w_rows + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            scale = tl.load(s_row + start // SCALE_K, mask=n_ok & (start < K), other=0.0)
            if GEMV:
                a = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
                acc += w.to(tl.float32) * scale[None, :] * a[:, None]
            else:
                a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                if FP32_DOT:  # the interpreter computes bf16 dots wrongly
                    a, w = a.to(tl.float32), w.to(tl.float32)
                else:
                    w = w.to(a.dtype)
                acc += tl.dot(a, w, input_precision=PRECISION) * scale[None, :]
        if GEMV:
            tl.store(out_ptr + split * part_s + n, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=n_ok)
        else:
            tl.store(
                out_ptr + split * part_s + m[:, None].to(tl.int64) * out_s + n[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=m_ok[:, None] & n_ok[None, :],
            )

    @triton.jit
    def _grouped_int4_kernel(
        a_ptr,
        q_ptr,
        s_ptr,
        out_ptr,
        rows_ptr,
        block_expert_ptr,
        N,
        a_stride,
        q_stride_e,
        q_stride_n,
        s_stride_e,
        s_stride_n,
        out_stride,
        K: tl.constexpr,  # the model's hidden or expert width: one compilation per model
        G: tl.constexpr,
        A_DIV: tl.constexpr,
        SILU_MUL: tl.constexpr,
        FP32_DOT: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        UNPACK: tl.constexpr,
        SPLIT_COLUMNS: tl.constexpr,  # planes: the activations' column planes split from one load of the tile
        FRAGMENT_ORDER: tl.constexpr,  # planes: the tile's words in the MMA fragment's order (_fragment_order)
    ):
        # moe_kernels._grouped_gemm_kernel with the expert's weight dequantised from packed INT4
        block = tl.program_id(0)
        expert = tl.load(block_expert_ptr + block)
        if expert < 0:  # past the blocks in use (the grid is sized for the worst case)
            return
        pair = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pair >= 0
        a_rows = a_ptr + tl.where(valid, pair // A_DIV, 0).to(tl.int64)[:, None] * a_stride
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        i = tl.arange(0, BLOCK_K // 8)
        q_rows = q_ptr + expert.to(tl.int64) * q_stride_e + n[None, :].to(tl.int64) * q_stride_n
        s_rows = s_ptr + expert.to(tl.int64) * s_stride_e + n[None, :].to(tl.int64) * s_stride_n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if UNPACK == "planes" or UNPACK == "packed":
                word = k0 // 8 + i
                w_ok = word < (K + 7) // 8
                tile_ok = w_ok[:, None] & n_ok[None, :]
                words = tl.load(q_rows + word[:, None], mask=tile_ok, other=0)
                scale = tl.load(s_rows + (word * 8 // G)[:, None], mask=tile_ok, other=0.0)
                if SILU_MUL:  # the up rows follow the N gate rows
                    words_up = tl.load(q_rows + N * q_stride_n + word[:, None], mask=tile_ok, other=0)
                    scale_up = tl.load(s_rows + N * s_stride_n + (word * 8 // G)[:, None], mask=tile_ok, other=0.0)
                if FRAGMENT_ORDER:
                    words = _fragment_order(words, BLOCK_K // 8, BLOCK_N)
                    scale = _fragment_order(scale, BLOCK_K // 8, BLOCK_N)
                    if SILU_MUL:
                        words_up = _fragment_order(words_up, BLOCK_K // 8, BLOCK_N)
                        scale_up = _fragment_order(scale_up, BLOCK_K // 8, BLOCK_N)
                    word = k0 // 8 + _fragment_rows(BLOCK_K // 8)
                if UNPACK == "packed":
                    planes = _packed_planes(words, scale.to(a_ptr.dtype.element_ty))
                    if SILU_MUL:
                        planes_up = _packed_planes(words_up, scale_up.to(a_ptr.dtype.element_ty))
                if SPLIT_COLUMNS:
                    kt = k0 + tl.arange(0, BLOCK_K)
                    a_tile = tl.load(a_rows + kt[None, :], mask=valid[:, None] & (kt < K)[None, :], other=0.0)
                    if FRAGMENT_ORDER:
                        a_tile = _fragment_columns(a_tile, BLOCK_M, BLOCK_K)
                    a_planes = _column_planes(a_tile, BLOCK_M, BLOCK_K)
                for j in tl.static_range(8):
                    kk = word * 8 + j
                    if SPLIT_COLUMNS:
                        a = a_planes[j]
                    else:
                        a = tl.load(a_rows + kk[None, :], mask=valid[:, None] & (kk < K)[None, :], other=0.0)
                    if UNPACK == "packed":
                        w = planes[j]
                    else:
                        w = _nibbles(words, scale.to(tl.float32), j)
                    if FP32_DOT:  # the interpreter computes bf16 dots wrongly
                        a = a.to(tl.float32)
                    else:
                        w = w.to(a.dtype)
                    acc = tl.dot(a, w, acc, input_precision=PRECISION)
                    if SILU_MUL:
                        if UNPACK == "packed":
                            w_up = planes_up[j]
                        else:
                            w_up = _nibbles(words_up, scale_up.to(tl.float32), j)
                        if not FP32_DOT:
                            w_up = w_up.to(a.dtype)
                        acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
            else:
                kk = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(a_rows + kk[None, :], mask=valid[:, None] & (kk < K)[None, :], other=0.0)
                w = _int4_tile(q_rows, s_rows, k0, K, n_ok, G, BLOCK_K, BLOCK_N, UNPACK)
                if FP32_DOT:
                    a = a.to(tl.float32)
                else:
                    w = w.to(a.dtype)
                acc = tl.dot(a, w, acc, input_precision=PRECISION)
                if SILU_MUL:
                    w_up = _int4_tile(
                        q_rows + N * q_stride_n, s_rows + N * s_stride_n, k0, K, n_ok, G, BLOCK_K, BLOCK_N, UNPACK
                    )
                    if not FP32_DOT:
                        w_up = w_up.to(a.dtype)
                    acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
        if SILU_MUL:  # gate and up rounded to the model dtype first, as the reference MLP has them
            gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            acc = gate * tl.sigmoid(gate) * acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        out_row = tl.where(valid, pair, 0).to(tl.int64)
        tl.store(
            out_ptr + out_row[:, None] * out_stride + n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=valid[:, None] & n_ok[None, :],
        )


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _groups_fit(k: int, group_size: int) -> bool:
    """Whole groups, and the eight k of a packed word share a scale (a multiple of 8, or one group)."""
    return k % group_size == 0 and (group_size % 8 == 0 or group_size == k)


INT4_UNPACK = ("planes", "packed", "gather", "expand")
"""How the INT4 dot path (two rows or more) unpacks a K tile: "planes", eight dots of inner size
BLOCK_K / 8 over nibble planes, dequantised in fp32; "packed", the same planes dequantised two words at a
time in the activations' 16-bit dtype (_packed_planes; it runs as "planes" over fp32 activations and in
the interpreter); "gather" and "expand", one dot of inner size BLOCK_K over the whole tile (see
_int4_tile). The decode GEMV (one row) is the same for all. Defaults (docs/benchmarks.md, "Loading and
quantized weights"): "expand" for int4_linear (2.6x faster than "planes" at 33 rows of Kimi's expert
shapes on an H200; "packed" there: not measured), "packed" for the grouped expert GEMM (1.2-1.3x faster
than "planes" on an H100, which is 1.3-1.4x faster than "expand"); "gather" was slowest in both."""
LINEAR_UNPACK, GROUPED_UNPACK = "expand", "packed"
PLANE_UNPACKS = ("planes", "packed")  # eight dots of inner size BLOCK_K / 8; the others, one over the tile


def _kernel_unpack(unpack: str, x: Tensor) -> str:
    """The kernels' UNPACK for `unpack`: "packed" needs 16-bit activations and compiled PTX (an NVIDIA GPU;
    ROCm's "cuda" devices run "planes")."""
    packs = x.device.type == "cuda" and torch.version.hip is None and x.dtype in (torch.bfloat16, torch.float16)
    return "planes" if unpack == "packed" and not packs else unpack


def _tiles(rows: int, unpack: str = "planes") -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) for `rows` rows: untuned starting points for a memory-bound
    weight read. One row is a GEMV (BLOCK_M unused); up to 64 rows take the smallest dot tile that holds
    them, so each weight tile is read by one program or few; wider batches 64-row tiles (128 for the
    one-dot unpackings, whose dequantisation is shared by twice the rows)."""
    if rows == 1:
        return 1, 32, 4, 3
    if rows > 64 and unpack not in PLANE_UNPACKS:
        return 128, 64, 4, 3
    return (16 if rows <= 16 else 32 if rows <= 32 else 64), 64, 4, 3


def _splits(device: torch.device, tiles: int, k_steps: int) -> int:
    """K splits so that the programs fill the GPU at least twice over, keeping 4+ K steps per split."""
    splits = 1
    while tiles * splits < 2 * _sm_count(device) and k_steps >= 8 * splits:
        splits *= 2
    return splits


def _launch(
    kernel,
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    n_out: int,
    k: int,
    block_k: int,
    split_k: int | None,
    unpack: str = "planes",
    **meta,
) -> Tensor:
    """Runs a linear kernel over x [..., K]: tiles from _tiles, K split as asked (None: _splits), the
    partial products (fp32) summed after."""
    *lead, _ = x.shape
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    assert x2.stride(-1) == 1 and weight.stride(-1) == 1 and scale.stride(-1) == 1
    block_m, block_n, warps, stages = _tiles(rows, unpack)
    grid_mn = (triton.cdiv(rows, block_m), triton.cdiv(n_out, block_n))
    k_steps = triton.cdiv(k, block_k)
    splits = split_k or _splits(x.device, grid_mn[0] * grid_mn[1], k_steps)
    k_split = triton.cdiv(k_steps, splits) * block_k
    splits = triton.cdiv(k, k_split)  # no empty splits
    out = torch.empty(splits, rows, n_out, dtype=torch.float32 if splits > 1 else x.dtype, device=x.device)
    if rows:
        kernel[(grid_mn[0], grid_mn[1], splits)](
            x2,
            weight,
            scale,
            out,
            rows,
            n_out,
            k,
            x2.stride(0),
            weight.stride(0),
            scale.stride(0),
            out.stride(1),
            out.stride(0),
            K_SPLIT=k_split,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            GEMV=rows == 1,
            FP32_DOT=x.device.type == "cpu",
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=warps,
            num_stages=stages,
            **meta,
        )
    out = out.sum(0).to(x.dtype) if splits > 1 else out[0]
    return out.view(*lead, n_out)


def int4_linear(
    x: Tensor,
    packed: Tensor,
    scale: Tensor,
    group_size: int,
    block_k: int | None = None,
    split_k: int | None = None,
    unpack: str = LINEAR_UNPACK,
) -> Tensor:
    """x [..., K] @ w.T for the INT4 weight packed [N, ceil(K / 8)] (int32), scale [N, K / G] (W4A16): [..., N] in
    x.dtype. block_k: for one row, "planes" and "packed", a multiple of 128 (a nibble plane is a dot of inner size
    block_k / 8); for "gather" and "expand", a power of two from 16. None: 256 for one row, else
    _dot_block_k (256 took 200+ registers a thread on sm_90 and spilled at BLOCK_N 128). split_k: K splits
    (None: enough to fill the GPU). unpack: one of INT4_UNPACK (one row: always the GEMV)."""
    k = x.shape[-1]
    gemv = x.numel() == k
    unpack = "planes" if gemv else unpack
    block_k = block_k or (256 if gemv else _dot_block_k(x.dtype, unpack))
    n_out = packed.shape[0]
    assert packed.dtype == torch.int32 and packed.shape[1] == triton.cdiv(k, 8) and _groups_fit(k, group_size)
    assert scale.shape == (n_out, k // group_size) and unpack in INT4_UNPACK and _block_k_fits(block_k, unpack)
    return _launch(
        _int4_linear_kernel,
        x,
        packed,
        scale,
        n_out,
        k,
        block_k,
        split_k,
        unpack,
        G=group_size,
        UNPACK=_kernel_unpack(unpack, x),
    )


def _dot_block_k(dtype: torch.dtype, unpack: str) -> int:
    """128; 32 for one dot over fp32 activations (an ieee fp32 dot is FMAs: at 128 it spilled thousands of
    bytes and, at 128 rows, took more shared memory than an SM has)."""
    return 32 if dtype == torch.float32 and unpack not in PLANE_UNPACKS else 128


def _block_k_fits(block_k: int, unpack: str) -> bool:
    """Planes need 16+ k each (a dot's inner size); one dot over the tile, a power of two from 16."""
    return block_k % 128 == 0 if unpack in PLANE_UNPACKS else block_k >= 16 and block_k & (block_k - 1) == 0


def fp8_block_linear(
    x: Tensor, weight: Tensor, scale_inv: Tensor, block: tuple[int, int] = (128, 128), split_k: int | None = None
) -> Tensor:
    """x [..., K] @ w.T for the block-scaled FP8 weight [N, K] (float8_e4m3fn), scale_inv [ceil(N / BN),
    ceil(K / BK)]: [..., N] in x.dtype. Weight-only (W8A16): activations stay in their dtype, the fp8
    tile is widened in registers (exactly: e4m3 fits in bf16 and fp16) and each 128-wide K tile's
    product scaled per column, in fp32. Hopper's FP8 tensor cores (activations quantised too) are not
    used."""
    k = x.shape[-1]
    n_out = weight.shape[0]
    block_n, block_k = block
    tile_k = min(128, block_k)
    assert weight.shape[1] == k and block_k % tile_k == 0 and tile_k >= 16 and tile_k & (tile_k - 1) == 0
    assert scale_inv.shape == (triton.cdiv(n_out, block_n), triton.cdiv(k, block_k))
    return _launch(
        _fp8_block_linear_kernel, x, weight, scale_inv, n_out, k, tile_k, split_k, SCALE_N=block_n, SCALE_K=block_k
    )


def grouped_gemm_int4(
    a: Tensor,
    packed: Tensor,
    scale: Tensor,
    group_size: int,
    rows: Tensor,
    block_expert: Tensor,
    pairs: int,
    a_div: int,
    silu_mul: bool = False,
    block_m: int = 16,
    block_n: int | None = None,
    block_k: int | None = None,
    unpack: str = GROUPED_UNPACK,
    num_warps: int = 4,
    num_stages: int = 3,
    split_columns: bool = False,
    fragment_order: bool = True,
) -> Tensor:
    """moe_kernels.grouped_gemm for INT4 experts: packed [E, N, ceil(K / 8)] (int32), scale [E, N, K / G], or
    [E, 2 N, ...] with silu_mul (gate rows, then up rows). `block_m` must be align_pairs'. unpack: one of
    INT4_UNPACK. block_n None: 64, or 32 for "gather" with silu_mul (its two [128, 64] pointer tiles of
    gathered words and scales spilled on sm_90). block_k None: _dot_block_k. num_warps, num_stages and
    split_columns (planes: load the activations' [block_m, block_k] tile once and split its eight stride-8
    column planes in registers, instead of eight strided loads) and fragment_order (planes: relabel the
    dots' inner index so that the words a thread loads are those its MMA fragment holds, _fragment_order;
    1.1-1.3x faster at 9 to 264 tokens of Kimi K2.6's experts on an H200) are tuning knobs
    (bench.int4_experts_sweep)."""
    experts, n_rows, words = packed.shape
    n = n_rows // 2 if silu_mul else n_rows
    k = a.shape[-1]
    block_n = block_n or (32 if silu_mul and unpack == "gather" else 64)
    block_k = block_k or _dot_block_k(a.dtype, unpack)
    assert a.stride(-1) == 1 and packed.stride(-1) == 1 and scale.stride(-1) == 1
    assert unpack in INT4_UNPACK and _block_k_fits(block_k, unpack)
    assert packed.dtype == torch.int32 and words == triton.cdiv(k, 8) and _groups_fit(k, group_size)
    assert scale.shape == (experts, n_rows, k // group_size)
    out = torch.empty(pairs, n, dtype=a.dtype, device=a.device)  # rows of pairs left out: never read
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_int4_kernel[grid](
        a,
        packed,
        scale,
        out,
        rows,
        block_expert,
        n,
        a.stride(0),
        packed.stride(0),
        packed.stride(1),
        scale.stride(0),
        scale.stride(1),
        out.stride(0),
        K=k,
        G=group_size,
        A_DIV=a_div,
        SILU_MUL=silu_mul,
        FP32_DOT=a.device.type == "cpu",
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UNPACK=_kernel_unpack(unpack, a),
        SPLIT_COLUMNS=split_columns,
        FRAGMENT_ORDER=fragment_order,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def moe_experts_int4(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    gate_up_packed: Tensor,
    gate_up_scale: Tensor,
    down_packed: Tensor,
    down_scale: Tensor,
    group_size: int,
    first_expert: int = 0,
    unpack: str = GROUPED_UNPACK,
) -> Tensor:
    """moe_kernels.moe_experts for INT4 experts: gate_up_packed [E, 2 I, H / 8] with gate_up_scale
    [E, 2 I, H / G], down_packed [E, H, I / 8] with down_scale [E, H, I / G]. unpack: one of INT4_UNPACK."""
    tokens, top_k = ids.shape
    experts = gate_up_packed.shape[0]
    rows, block_expert = align_pairs(ids, experts, 16, first_expert)
    pairs = tokens * top_k
    act = grouped_gemm_int4(
        x,
        gate_up_packed,
        gate_up_scale,
        group_size,
        rows,
        block_expert,
        pairs,
        a_div=top_k,
        silu_mul=True,
        unpack=unpack,
    )
    down = grouped_gemm_int4(
        act, down_packed, down_scale, group_size, rows, block_expert, pairs, a_div=1, unpack=unpack
    )
    return combine_pairs(down, weights, ids, experts, first_expert)
