"""The grouped expert GEMMs (ddtree.runtime.moe_kernels) against a plain per-pair computation.

The Triton kernels run on CPU under the interpreter (marker `triton_interpreter`, their own pytest run:
`make test-triton-interpreter`) and compiled on a GPU (`gpu`)."""

import os

import pytest
import torch
import torch.nn.functional as F

from ddtree.runtime.moe_kernels import align_pairs, moe_experts
from sm90 import compile_sm90

interp = pytest.mark.triton_interpreter
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton)")


def check_align_pairs(device, tokens, top_k, experts, block_m, first_expert):
    g = torch.Generator().manual_seed(tokens)
    total = first_expert + experts + 2  # some ids are other ranks' experts, before and after ours
    ids = torch.stack([torch.randperm(total, generator=g)[:top_k] for _ in range(tokens)])
    rows, block_expert = (t.cpu() for t in align_pairs(ids.to(device), experts, block_m, first_expert))
    blocks = min(-(-tokens * top_k // block_m) + experts, tokens * top_k)  # every block in use holds a pair
    assert rows.shape == (blocks * block_m,) and block_expert.shape == (blocks,)
    assert rows.dtype == block_expert.dtype == torch.int32
    local = ids.reshape(-1) - first_expert
    placed = rows[rows >= 0].long()
    ours = torch.nonzero((local >= 0) & (local < experts)).flatten()
    assert sorted(placed.tolist()) == ours.tolist()  # each of our pairs exactly once, the others never
    for b in range(blocks):
        block = rows[b * block_m : (b + 1) * block_m].long()
        if block_expert[b] < 0:
            assert (block < 0).all()
        else:
            assert (local[block[block >= 0]] == block_expert[b]).all() and (block[0] >= 0)
            assert (block >= 0).tolist() == sorted((block >= 0).tolist(), reverse=True)  # padding last
    used = block_expert[block_expert >= 0]
    # the blocks in use come first, in expert order, each expert's as few as its pairs need
    assert (block_expert[: used.numel()] >= 0).all() and (used.diff() >= 0).all()
    counts = torch.bincount(local[(local >= 0) & (local < experts)], minlength=experts)
    assert torch.bincount(used.long(), minlength=experts).tolist() == (-(-counts // block_m)).tolist()


ALIGN_CASES = [(1, 2, 4, 16, 0), (7, 3, 5, 4, 0), (33, 8, 16, 16, 0), (9, 3, 6, 4, 5), (300, 8, 24, 16, 3)]


@interp
@pytest.mark.parametrize("tokens, top_k, experts, block_m, first_expert", ALIGN_CASES)
def test_align_pairs_puts_every_pair_once_in_a_block_of_its_expert(tokens, top_k, experts, block_m, first_expert):
    check_align_pairs("cpu", tokens, top_k, experts, block_m, first_expert)


@pytest.mark.gpu
@needs_cuda
def test_align_pairs_compiled():
    for case in ALIGN_CASES + [(264, 8, 384, 16, 0), (2112, 8, 384, 16, 0), (33, 8, 48, 16, 336)]:
        check_align_pairs("cuda", *case)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles, outside the interpreter")
def test_the_moe_bookkeeping_kernels_compile_for_sm_90():
    """Ahead of time, without a GPU: the one-program alignment (atomics, barriers, a prefix sum), the
    weighted combine and the router's choice compile to sm_90a cubins at Kimi K2.6's sizes (384 experts,
    top 8, hidden 7168) and with DeepSeek-V3's groups (8, 4 kept)."""
    from ddtree.runtime.moe_kernels import _align_pairs_kernel, _combine_pairs_kernel, _router_topk_kernel

    align = dict(ids_ptr="*i64", rows_ptr="*i32", block_expert_ptr="*i32", cursor_ptr="*i32")
    combine = dict(down_ptr="*bf16", weights_ptr="*bf16", ids_ptr="*i64", out_ptr="*bf16")
    router = dict(logits_ptr="*fp32", bias_ptr="*fp32", weights_ptr="*bf16", ids_ptr="*i64", scaling="fp32")
    kernels = [
        (_align_pairs_kernel, align, dict(E=384, E_POW2=512, BLOCK_M=16, CHUNK=1024), 8),
        (_combine_pairs_kernel, combine, dict(E=384, TOP_K=8, BLOCK_H=1024), 4),
    ]
    for softmax, groups, kept in ((False, 1, 1), (False, 8, 4), (True, 1, 1)):
        choice = dict(E=384, E_POW2=512, GROUPS=groups, GROUPS_POW2=groups, TOPK_GROUP=kept, TOP_K=8, K_POW2=8)
        kernels.append((_router_topk_kernel, router, choice | dict(SOFTMAX=softmax, NORMALIZE=True), 4))
    for kernel, types, consts, warps in kernels:
        assert compile_sm90(kernel, consts, types, warps=warps).asm["cubin"], kernel.__name__


# (tokens, experts, top k, groups, groups kept, normalize, scaling): DeepSeek-V3-like groups, Kimi K2's one
# group, groups of one expert
ROUTER_CASES = [(9, 32, 4, 4, 2, True, 2.5), (5, 24, 8, 1, 1, True, 2.827), (3, 8, 2, 8, 3, False, 1.0)]


def check_router(device, dtype, tokens, experts, top_k, n_group, topk_group, normalize, scaling, hidden=64):
    """fused.TritonGroupLimitedSigmoid (its choice one kernel) against models.moe.GroupLimitedSigmoid and,
    for one group without scaling, fused.TritonSoftmaxTopK against models.moe.SoftmaxTopK."""
    from ddtree.models.moe import GroupLimitedSigmoid, SoftmaxTopK
    from ddtree.runtime.fused import TritonGroupLimitedSigmoid, TritonSoftmaxTopK

    g = torch.Generator().manual_seed(tokens + experts)
    router = GroupLimitedSigmoid(hidden, experts, top_k, n_group, topk_group, normalize, scaling)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, hidden, generator=g) / hidden**0.5)
        router.e_score_correction_bias.copy_(torch.randn(experts, generator=g) * 0.1)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    check_router_swap(router, TritonGroupLimitedSigmoid, x)
    if n_group == 1:
        softmax = SoftmaxTopK(hidden, experts, top_k, normalize)
        softmax.weight.data.copy_(router.weight.data)
        check_router_swap(softmax, TritonSoftmaxTopK, x)


def check_router_swap(router, fused, x):
    from ddtree.runtime.fused import swap

    router.weight.data = router.weight.data.to(x.dtype)
    router.to(x.device)
    want_weights, want_ids = router(x)
    swap(router, fused)
    weights, ids = router(x)
    tokens, top_k, dtype = x.shape[0], router.top_k, x.dtype
    assert ids.dtype == torch.int64 and weights.dtype == dtype and ids.shape == weights.shape == (tokens, top_k)
    if not torch.equal(ids, want_ids):  # 16-bit logits tie (SoftmaxTopK's): torch.topk orders ties either way
        assert dtype != torch.float32 and torch.equal(ids.sort(dim=-1).values, want_ids.sort(dim=-1).values)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ROUTER_CASES)
def test_the_triton_router_chooses_as_the_reference(case, dtype):
    check_router("cpu", dtype, *case)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_router_compiled(dtype):
    """On a GPU the bf16 logits come from cuBLAS with an fp32 output; Kimi K2.6's router shape too."""
    for case in ROUTER_CASES:
        check_router("cuda", dtype, *case)
    check_router("cuda", dtype, 33, 384, 8, 1, 1, True, 2.827, hidden=7168)


def reference(x, weights, ids, w_gate_up, w_down, first_expert, dtype):
    """Per (token, choice), as the reference MLP computes it in `dtype`: gate, up, silu(gate) * up and
    the down projection each rounded to it; the weighted sum in fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = w_down.shape[-1]
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - first_expert
            if not 0 <= e < w_gate_up.shape[0]:
                continue
            gate_up = (x[t].float() @ w_gate_up[e].float().T).to(dtype)
            act = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += weights[t, j].float() * (act.float() @ w_down[e].float().T).to(dtype).float()
    return out


def check_moe_experts(device, dtype, tokens, top_k, experts, hidden, inter, first_expert):
    g = torch.Generator().manual_seed(tokens * 131 + experts)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    total = experts + first_expert + 2  # the model's experts; this rank holds `experts` of them
    ids = torch.stack([torch.randperm(total, generator=g)[:top_k] for _ in range(tokens)]).to(device)
    weights = torch.rand(tokens, top_k, generator=g).to(device, dtype)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(device, dtype)
    w_down = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(device, dtype)
    got = moe_experts(x, weights, ids, w_gate_up, w_down, first_expert)
    inputs = [t.cpu() for t in (x, weights, ids, w_gate_up, w_down)]
    exact = reference(*inputs, first_expert, torch.float32)
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    err = (got.float().cpu() - exact).norm() / exact.norm()
    if dtype == torch.float32:
        assert err < 1e-5, err
    else:  # no less accurate than the reference MLP in the same dtype (to 2.5x: other rounding points)
        err_reference = (reference(*inputs, first_expert, dtype) - exact).norm() / exact.norm()
        assert err <= 2.5 * err_reference + 1e-3, (err, err_reference)


MOE_CASES = [  # (tokens, top_k, experts, hidden, inter, first expert): decode, ragged, a verify tree, a rank's share
    (1, 2, 4, 32, 16, 0),
    (5, 2, 6, 40, 24, 0),
    (17, 4, 8, 64, 48, 0),
    (9, 3, 4, 32, 16, 4),
]


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # bf16: the interpreter truncates, the GPU test
@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_experts(dtype, case):
    check_moe_experts("cpu", dtype, *case)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_compiled(dtype):
    for case in MOE_CASES + [(65, 8, 128, 2048, 768, 0), (8, 8, 32, 7168, 2048, 0)]:
        check_moe_experts("cuda", dtype, *case)


@pytest.mark.gpu
@needs_cuda
def test_moe_experts_replay_from_a_cuda_graph_with_new_routing():
    """Captured once, replayed after the routing changed in place: the same as running it eagerly."""
    g = torch.Generator().manual_seed(0)
    tokens, top_k, experts, hidden, inter = 9, 4, 16, 256, 128
    x = torch.randn(tokens, hidden, generator=g).cuda().bfloat16()
    weights = torch.rand(tokens, top_k, generator=g).cuda().bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).cuda()
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).cuda().bfloat16()
    w_down = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).cuda().bfloat16()
    moe_experts(x, weights, ids, w_gate_up, w_down)  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts(x, weights, ids, w_gate_up, w_down)
    ids.copy_(torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).cuda())
    graph.replay()
    torch.testing.assert_close(out, moe_experts(x, weights, ids, w_gate_up, w_down))
