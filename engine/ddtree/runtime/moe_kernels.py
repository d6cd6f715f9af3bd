"""Grouped expert GEMMs for mixture-of-experts layers: only the chosen experts' weights are read.

A round's N tokens each pick k experts: N * k (token, expert) pairs. `align_pairs` sorts the pairs by
expert into blocks of BLOCK_M rows, each block holding pairs of one expert (padding rows are -1), with
static shapes: there are at most ceil(N * k / BLOCK_M) + E non-empty blocks, so the grid is that large
and the unused blocks return at once. Nothing reads tensor values on the host, so a round with an MoE
layer stays one CUDA graph. `grouped_gemm` then runs one program per (block, BLOCK_N output columns):
the block's rows of the input against its expert's weight, so each chosen expert's weight is read once
per block rather than once per pair (a verify tree of B + 1 tokens shares most of its experts).

The first GEMM (gate/up, with silu(gate) * up in its epilogue) reads the token rows (pair // k), the
second (down) reads the pair rows it wrote. Arithmetic is fp32 (gate and up rounded to the model dtype
before silu(gate) * up, as the reference MLP has them).
On CPU the same kernels run under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kernels import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _grouped_gemm_kernel(
        a_ptr,
        w_ptr,
        out_ptr,
        rows_ptr,
        block_expert_ptr,
        N,
        a_stride,
        w_stride_e,
        w_stride_n,
        out_stride,
        K: tl.constexpr,  # the model's hidden or expert width: one compilation per model
        A_DIV: tl.constexpr,
        SILU_MUL: tl.constexpr,
        FP32_DOT: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        block = tl.program_id(0)
        expert = tl.load(block_expert_ptr + block)
        if expert < 0:  # past the blocks in use (the grid is sized for the worst case)
            return
        pair = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pair >= 0
        a_row = tl.where(valid, pair // A_DIV, 0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        w_base = w_ptr + expert.to(tl.int64) * w_stride_e
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            a = tl.load(a_ptr + a_row[:, None] * a_stride + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + n[None, :] * w_stride_n + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            if FP32_DOT:  # the interpreter computes bf16 dots wrongly
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            if SILU_MUL:  # the up rows follow the N gate rows
                w_up = tl.load(
                    w_base + (n[None, :] + N) * w_stride_n + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0
                )
                if FP32_DOT:
                    w_up = w_up.to(tl.float32)
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


def align_pairs(ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """Blocks of `block_m` pairs of one expert each, for expert ids [N, k] (ids outside 0..num_experts-1,
    e.g. another rank's experts, are left out: their pairs get no row). Returns (rows [blocks * block_m]:
    the pair index n * k + j, or -1 for padding; block_expert [blocks]: the block's expert, -1 when unused),
    blocks = ceil(N * k / block_m) + num_experts, whatever the ids."""
    flat = ids.reshape(-1).long()
    pairs, dev = flat.numel(), flat.device
    mine = (flat >= 0) & (flat < num_experts)
    bucket = torch.where(mine, flat, num_experts)  # the others go to a bucket past the last expert
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, bucket, torch.ones_like(bucket))
    counts = torch.cat([counts[:num_experts], counts.new_zeros(1)])  # no rows for the others' bucket
    padded = (counts + block_m - 1) // block_m * block_m
    padded_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    blocks = -(-pairs // block_m) + num_experts
    dest = padded_start[sorted_bucket] + torch.arange(pairs, device=dev) - start[sorted_bucket]
    dest = torch.where(sorted_bucket < num_experts, dest, blocks * block_m)  # the others: a row past the end
    rows = torch.full((blocks * block_m + 1,), -1, dtype=torch.int32, device=dev)
    rows.scatter_(0, dest, order.to(torch.int32))
    ends = torch.cumsum(padded[:num_experts], 0)
    block_expert = torch.searchsorted(ends, torch.arange(blocks, device=dev) * block_m, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return rows[:-1], block_expert


def grouped_gemm(
    a: Tensor,
    weight: Tensor,
    rows: Tensor,
    block_expert: Tensor,
    pairs: int,
    a_div: int,
    silu_mul: bool = False,
    block_m: int = 16,
    block_n: int = 64,
    block_k: int = 64,
) -> Tensor:
    """out [pairs, N]: row p = a[p // a_div] @ weight[expert of p].T, for the pairs `align_pairs` placed
    (rows of pairs it left out are zero). weight [E, N, K], or [E, 2 N, K] with silu_mul: silu(gate) * up
    of its two halves. `block_m` must be align_pairs'."""
    experts, n_rows, k = weight.shape
    n = n_rows // 2 if silu_mul else n_rows
    assert a.shape[-1] == k and a.stride(-1) == 1 and weight.stride(-1) == 1
    out = torch.zeros(pairs, n, dtype=a.dtype, device=a.device)
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        weight,
        out,
        rows,
        block_expert,
        n,
        a.stride(0),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        K=k,
        A_DIV=a_div,
        SILU_MUL=silu_mul,
        FP32_DOT=a.device.type == "cpu",
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out


def moe_experts(
    x: Tensor, weights: Tensor, ids: Tensor, w_gate_up: Tensor, w_down: Tensor, first_expert: int = 0
) -> Tensor:
    """The weighted sum of each token's chosen experts, [N, H]: x [N, H], weights and ids [N, k],
    w_gate_up [E, 2 I, H], w_down [E, H, I] (the experts first_expert .. first_expert + E - 1; pairs of
    other experts add nothing, as under expert or tensor parallelism)."""
    tokens, top_k = ids.shape
    experts = w_gate_up.shape[0]
    rows, block_expert = align_pairs(ids - first_expert, experts, block_m=16)
    act = grouped_gemm(x, w_gate_up, rows, block_expert, tokens * top_k, a_div=top_k, silu_mul=True)
    down = grouped_gemm(act, w_down, rows, block_expert, tokens * top_k, a_div=1)
    # the k products summed in fp32, rounded once
    return (down.view(tokens, top_k, -1).float() * weights[..., None].float()).sum(dim=1).to(x.dtype)
