"""The grouped expert GEMMs (ddtree.runtime.moe_kernels) against a plain per-pair computation.

The Triton kernels run on CPU under the interpreter (marker `triton_interpreter`, their own pytest run:
`make test-triton-interpreter`) and compiled on a GPU (`gpu`); `align_pairs` is plain PyTorch and runs
everywhere."""

import pytest
import torch
import torch.nn.functional as F

from ddtree.runtime.moe_kernels import align_pairs, moe_experts

interp = pytest.mark.triton_interpreter
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton)")


@pytest.mark.parametrize("tokens, top_k, experts, block_m", [(1, 2, 4, 16), (7, 3, 5, 4), (33, 8, 16, 16)])
def test_align_pairs_puts_every_pair_once_in_a_block_of_its_expert(tokens, top_k, experts, block_m):
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts + 2, generator=g)[:top_k] for _ in range(tokens)])  # some not ours
    rows, block_expert = align_pairs(ids, experts, block_m)
    blocks = -(-tokens * top_k // block_m) + experts
    assert rows.shape == (blocks * block_m,) and block_expert.shape == (blocks,)
    flat = ids.reshape(-1)
    placed = rows[rows >= 0].long()
    ours = torch.nonzero(flat < experts).flatten()
    assert sorted(placed.tolist()) == ours.tolist()  # each of our pairs exactly once, the others never
    for b in range(blocks):
        block = rows[b * block_m : (b + 1) * block_m].long()
        if block_expert[b] < 0:
            assert (block < 0).all()
        else:
            assert (flat[block[block >= 0]] == block_expert[b]).all()
    assert (block_expert[: int((block_expert >= 0).sum())] >= 0).all()  # the blocks in use come first


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
