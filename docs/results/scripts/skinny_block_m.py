# Session 8: skinny_linear's row tile (BLOCK_M) at 17-32 rows: the next power of two (32) against 64, in
# whole forwards (ctx 1024, graphs) of the 8B shape and a SmolLM2-135M-shaped model (random bf16), with
# skinny_linear off for reference, twice.
import torch
from ddtree import kernels as K
from ddtree.bench import forward_ms
from ddtree.loading import random_model

shipped = dict(K.SKINNY_CONFIGS)
pow2 = K.skinny_block_m
policies = {"off": None, "pow2": pow2, "16|64": lambda rows: 16 if rows <= 16 else 64}
for shape, kw in (("qwen3-8b", {}), ("tiny", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                  num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64))):
    t = random_model(shape, "cuda", torch.bfloat16, **kw)
    t.fuse(kernels=True)
    for rep in range(2):
        for name, policy in policies.items():
            K.SKINNY_CONFIGS = shipped if policy else {}
            K.skinny_block_m = policy or pow2
            ms = {f"T{T}": round(forward_ms(t, 1, 1024, T, graphs=True, reps=50), 4) for T in (1, 9, 17, 25, 33, 64)}
            print(f"{'smollm2' if kw else shape} {name:6s} {ms}", flush=True)
    del t
    torch.cuda.empty_cache()
