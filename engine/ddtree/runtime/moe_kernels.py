"""Grouped expert GEMMs for mixture-of-experts layers: only the chosen experts' weights are read.

A round's N tokens each pick k experts (`group_limited_topk` and `softmax_topk` choose from the router's
logits): N * k (token, expert) pairs. `align_pairs` places the pairs by expert into blocks of BLOCK_M
rows, each block holding pairs of one expert (padding rows are -1), with static shapes: there are at
most min(ceil(N * k / BLOCK_M) + E, N * k) non-empty blocks (each holds a pair, and each expert adds at
most one part-filled block), so the grid is that large and the unused blocks return at once: 8 blocks
for a decode step's top 8, not 1 + 384. Nothing reads tensor values on the host, so a round with an MoE
layer stays one CUDA graph. `grouped_gemm` then runs one program per (block, BLOCK_N output columns): the
block's rows of the input against its expert's weight, so each chosen expert's weight is read once per
block rather than once per pair (a verify tree of B + 1 tokens shares most of its experts).

The first GEMM (gate/up, with silu(gate) * up in its epilogue) reads the token rows (pair // k), the
second (down) reads the pair rows it wrote, and `combine_pairs` sums each token's k rows, weighted.
Arithmetic is fp32 (gate and up rounded to the model dtype before silu(gate) * up, as the reference MLP
has them). Each step is one kernel launch: a layer's bookkeeping is replayed in every round.
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

    @triton.jit
    def _align_pairs_kernel(
        ids_ptr,
        rows_ptr,
        block_expert_ptr,
        cursor_ptr,  # [E_POW2] scratch: each expert's pair count, then its next free row
        P,
        BLOCKS,
        FIRST,
        E: tl.constexpr,
        E_POW2: tl.constexpr,
        BLOCK_M: tl.constexpr,
        CHUNK: tl.constexpr = 1024,
    ):
        # one program: the barriers order its phases (a CTA's global writes are visible after them)
        expert = tl.arange(0, E_POW2)
        tl.store(cursor_ptr + expert, tl.zeros([E_POW2], dtype=tl.int32))
        tl.debug_barrier()
        for c in range(0, P, CHUNK):
            pair = c + tl.arange(0, CHUNK)
            e = tl.load(ids_ptr + pair, mask=pair < P, other=-1).to(tl.int32) - FIRST
            tl.atomic_add(cursor_ptr + e, 1, mask=(pair < P) & (e >= 0) & (e < E))
        tl.debug_barrier()
        counts = tl.load(cursor_ptr + expert, mask=expert < E, other=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        tl.debug_barrier()  # every count read before the cursors overwrite them
        tl.store(cursor_ptr + expert, ends - padded)
        for r in range(0, BLOCKS * BLOCK_M, CHUNK):
            row = r + tl.arange(0, CHUNK)
            tl.store(rows_ptr + row, tl.full([CHUNK], -1, dtype=tl.int32), mask=row < BLOCKS * BLOCK_M)
        for b0 in range(0, BLOCKS, CHUNK):
            block = b0 + tl.arange(0, CHUNK)
            tl.store(block_expert_ptr + block, tl.full([CHUNK], -1, dtype=tl.int32), mask=block < BLOCKS)
        tl.debug_barrier()  # the unused blocks' -1 before the experts' own blocks
        # each expert writes its id into its blocks, one block of every expert a step: as many steps as the
        # largest expert has blocks (one or two at decode and verify widths)
        first_block = (ends - padded) // BLOCK_M
        expert_blocks = tl.where(expert < E, padded // BLOCK_M, 0)
        for j in range(0, tl.max(expert_blocks, axis=0)):
            tl.store(block_expert_ptr + first_block + j, expert, mask=j < expert_blocks)
        tl.debug_barrier()
        for c in range(0, P, CHUNK):
            pair = c + tl.arange(0, CHUNK)
            e = tl.load(ids_ptr + pair, mask=pair < P, other=-1).to(tl.int32) - FIRST
            mine = (pair < P) & (e >= 0) & (e < E)
            row = tl.atomic_add(cursor_ptr + e, 1, mask=mine)
            tl.store(rows_ptr + row, pair, mask=mine)

    @triton.jit
    def _combine_pairs_kernel(
        down_ptr,
        weights_ptr,
        ids_ptr,
        out_ptr,
        H,
        FIRST,
        E: tl.constexpr,
        TOP_K: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        # out[t] = sum_j weights[t, j] * down[t * k + j] over the pairs of the experts held here, in fp32
        token = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = h < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            pair = token * TOP_K + j
            e = tl.load(ids_ptr + pair).to(tl.int32) - FIRST
            mine = (e >= 0) & (e < E)  # other pairs' rows were never written
            row = tl.load(down_ptr + pair.to(tl.int64) * H + h, mask=h_ok & mine, other=0.0)
            acc += tl.where(mine, tl.load(weights_ptr + pair).to(tl.float32) * row.to(tl.float32), 0.0)
        tl.store(out_ptr + token.to(tl.int64) * H + h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)

    @triton.jit
    def _router_topk_kernel(
        logits_ptr,
        bias_ptr,
        weights_ptr,
        ids_ptr,
        scaling,
        E: tl.constexpr,
        E_POW2: tl.constexpr,
        SOFTMAX: tl.constexpr,  # softmax scores (Qwen3-MoE), else sigmoid scores and a correction bias
        GROUPS: tl.constexpr,
        GROUPS_POW2: tl.constexpr,
        TOPK_GROUP: tl.constexpr,
        TOP_K: tl.constexpr,
        K_POW2: tl.constexpr,
        NORMALIZE: tl.constexpr,
    ):
        # models.moe's routers after their GEMM, one program per token; the top k as k argmaxes
        token = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, E_POW2)
        ok = e < E
        logits = tl.load(logits_ptr + token * E + e, mask=ok, other=float("-inf")).to(tl.float32)
        if SOFTMAX:
            exp = tl.exp(logits - tl.max(logits, axis=0))
            scores = exp / tl.sum(exp, axis=0)
            choice = tl.where(ok, scores, float("-inf"))
        else:
            scores = tl.sigmoid(logits)
            choice = tl.where(ok, scores + tl.load(bias_ptr + e, mask=ok, other=0.0), float("-inf"))
        if GROUPS > 1:  # keep the TOPK_GROUP groups whose two best choices sum highest
            size: tl.constexpr = E // GROUPS
            group = e // size
            g = tl.arange(0, GROUPS_POW2)
            group_score = tl.full([GROUPS_POW2], float("-inf"), dtype=tl.float32)
            for i in tl.static_range(GROUPS):
                member = tl.where(group == i, choice, float("-inf"))
                best = tl.max(member, axis=0)
                if size > 1:
                    best += tl.max(tl.where(e == tl.argmax(member, axis=0), float("-inf"), member), axis=0)
                group_score = tl.where(g == i, best, group_score)
            keep = e < 0
            for _ in tl.static_range(TOPK_GROUP):
                i = tl.argmax(group_score, axis=0)
                keep = keep | (group == i)
                group_score = tl.where(g == i, float("-inf"), group_score)
            choice = tl.where(keep, choice, float("-inf"))
        slot = tl.arange(0, K_POW2)
        ids = tl.zeros([K_POW2], dtype=tl.int32)
        weights = tl.zeros([K_POW2], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            i = tl.argmax(choice, axis=0)
            ids = tl.where(slot == j, i, ids)
            weights = tl.where(slot == j, tl.sum(tl.where(e == i, scores, 0.0), axis=0), weights)
            choice = tl.where(e == i, float("-inf"), choice)
        if NORMALIZE:
            if SOFTMAX:
                weights = weights / tl.sum(weights, axis=0)
            else:  # with the reference's epsilon
                weights = weights / (tl.sum(weights, axis=0) + 1e-20)
        out = token * TOP_K + slot
        tl.store(weights_ptr + out, (weights * scaling).to(weights_ptr.dtype.element_ty), mask=slot < TOP_K)
        tl.store(ids_ptr + out, ids.to(tl.int64), mask=slot < TOP_K)


def align_pairs(ids: Tensor, num_experts: int, block_m: int, first_expert: int = 0) -> tuple[Tensor, Tensor]:
    """Blocks of `block_m` pairs of one expert each, for expert ids [N, k] of the experts first_expert ..
    first_expert + num_experts - 1 (other ids, e.g. another rank's experts, are left out: their pairs get no
    row). Returns (rows [blocks * block_m]: the pair index n * k + j, or -1 for padding; block_expert
    [blocks]: the block's expert counted from first_expert, -1 when unused), blocks = min(ceil(N * k /
    block_m) + num_experts, N * k) whatever the ids; the blocks in use come first, in expert order. One
    kernel launch (a round runs one per MoE layer): counts by atomic adds, padded offsets by a prefix sum,
    then each pair takes the next row of its expert by an atomic add, so the order of pairs inside an
    expert's blocks varies from run to run; every output row depends on its own pair only, so results do
    not."""
    pairs = ids.numel()
    blocks = min(-(-pairs // block_m) + num_experts, pairs)
    rows = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    experts_pow2 = triton.next_power_of_2(num_experts)
    cursor = torch.empty(experts_pow2, dtype=torch.int32, device=ids.device)
    _align_pairs_kernel[(1,)](
        ids.reshape(-1),
        rows,
        block_expert,
        cursor,
        pairs,
        blocks,
        first_expert,
        E=num_experts,
        E_POW2=experts_pow2,
        BLOCK_M=block_m,
        num_warps=8,
    )
    return rows, block_expert


def _router_topk(logits: Tensor, bias: Tensor | None, top_k: int, dtype: torch.dtype, **meta) -> tuple[Tensor, Tensor]:
    tokens, experts = logits.shape
    assert logits.is_contiguous()
    weights = torch.empty(tokens, top_k, dtype=dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    _router_topk_kernel[(tokens,)](
        logits,
        logits if bias is None else bias,
        weights,
        ids,
        E=experts,
        E_POW2=triton.next_power_of_2(experts),
        TOP_K=top_k,
        K_POW2=triton.next_power_of_2(top_k),
        **meta,
    )
    return weights, ids


def group_limited_topk(
    logits: Tensor,
    bias: Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling: float,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """models.moe.GroupLimitedSigmoid's choice from its fp32 logits [N, E] and correction bias [E], in one
    kernel launch (the reference takes about fifteen): (weights [N, k] in `dtype`, expert ids [N, k])."""
    assert logits.dtype == bias.dtype == torch.float32 and logits.shape[1] % n_group == 0
    groups = dict(GROUPS=n_group, GROUPS_POW2=triton.next_power_of_2(n_group), TOPK_GROUP=topk_group)
    return _router_topk(logits, bias, top_k, dtype, scaling=scaling, SOFTMAX=False, NORMALIZE=normalize, **groups)


def softmax_topk(logits: Tensor, top_k: int, normalize: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """models.moe.SoftmaxTopK's choice from its logits [N, E] (in the model's dtype, as its GEMM gives
    them), in one kernel launch: softmax in fp32, the top k, renormalised when `normalize`."""
    groups = dict(GROUPS=1, GROUPS_POW2=1, TOPK_GROUP=1)
    return _router_topk(logits, None, top_k, dtype, scaling=1.0, SOFTMAX=True, NORMALIZE=normalize, **groups)


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
    (rows of pairs it left out are not written: combine_pairs skips them). weight [E, N, K], or [E, 2 N, K]
    with silu_mul: silu(gate) * up of its two halves. `block_m` must be align_pairs'."""
    experts, n_rows, k = weight.shape
    n = n_rows // 2 if silu_mul else n_rows
    assert a.shape[-1] == k and a.stride(-1) == 1 and weight.stride(-1) == 1
    out = torch.empty(pairs, n, dtype=a.dtype, device=a.device)
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
    rows, block_expert = align_pairs(ids, experts, 16, first_expert)
    act = grouped_gemm(x, w_gate_up, rows, block_expert, tokens * top_k, a_div=top_k, silu_mul=True)
    down = grouped_gemm(act, w_down, rows, block_expert, tokens * top_k, a_div=1)
    return combine_pairs(down, weights, ids, experts, first_expert)


def combine_pairs(down: Tensor, weights: Tensor, ids: Tensor, num_experts: int, first_expert: int = 0) -> Tensor:
    """[N, H] in down's dtype: each token's k rows of down [N * k, H] weighted by weights [N, k] and summed
    in fp32, rounded once, skipping the pairs whose expert (ids [N, k]) is not first_expert ..
    first_expert + num_experts - 1 (their rows were never written). One kernel launch."""
    tokens, top_k = ids.shape
    hidden = down.shape[-1]
    assert down.shape == (tokens * top_k, hidden) and down.is_contiguous()
    out = torch.empty(tokens, hidden, dtype=down.dtype, device=down.device)
    block_h = min(1024, triton.next_power_of_2(hidden))
    _combine_pairs_kernel[(tokens, triton.cdiv(hidden, block_h))](
        down,
        weights.contiguous(),
        ids.contiguous(),
        out,
        hidden,
        first_expert,
        E=num_experts,
        TOP_K=top_k,
        BLOCK_H=block_h,
    )
    return out
