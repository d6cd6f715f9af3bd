"""Shared by the attention sweeps here: kernels.attention configurations at bs sequences x T query tokens
over 1024 cached tokens with a verify-like mask (8B shape: 32 heads, 8 KV heads, head dim 128), 36
layers' caches per CUDA graph, us per call."""
import functools, json, torch, torch.nn.functional as F
from ddtree import kernels as K
from graph_timing import timed


def attention_case(bs, T, configs, sdpa=False, dev="cuda"):
    """Returns ({json config: [us, max abs error against fp32 SDPA] or the error raised}, plus "sdpa": us
    when asked) and [(us, json config)] fastest first."""
    ctx = 1024; span = ctx + T
    store = torch.randn(36, 2, bs, 8, span + 1, 128, device=dev, dtype=torch.bfloat16)
    q = torch.randn(bs, 32, T, 128, device=dev, dtype=torch.bfloat16)
    j = torch.arange(span, device=dev)
    mask = (j[None, :] < ctx) | (torch.rand(T, span, device=dev) < 0.3) & (j[None, :] < ctx + 1 + torch.arange(T, device=dev)[:, None])
    mask = mask[None, None].expand(bs, 1, T, span).contiguous()
    k0, v0 = store[0, 0, :bs, :, :span], store[0, 1, :bs, :, :span]
    ref = F.scaled_dot_product_attention(q.float(), k0.float(), v0.float(), attn_mask=mask, enable_gqa=True).transpose(1, 2).reshape(bs, T, -1)
    row = {}
    if sdpa:
        row["sdpa"] = timed([functools.partial(F.scaled_dot_product_attention, q, store[l, 0, :bs, :, :span],
                                               store[l, 1, :bs, :, :span], attn_mask=mask, enable_gqa=True) for l in range(36)])
    for cfg in configs:
        try:
            fns = [functools.partial(K.attention, q, store[l, 0], store[l, 1], mask, None, **cfg) for l in range(36)]
            err = (fns[0]().float() - ref).abs().max().item()
            row[json.dumps(cfg)] = [round(timed(fns), 2), round(err, 4)]
        except Exception as exc:
            row[json.dumps(cfg)] = repr(exc)[:120]
    return row, sorted((v[0], k) for k, v in row.items() if isinstance(v, list))
