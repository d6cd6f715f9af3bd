# Session 8: whole forwards of a SmolLM2-135M-shaped model with random bf16 weights (hidden 576, MLP 1536,
# 30 layers, 9 / 3 heads of 64; ctx 1024, graphs) with skinny_linear as shipped and off: at this size only
# gate/up fits its configuration (576 is not a multiple of the o configuration's K splits x BLOCK_K).
import torch
from ddtree import kernels as K
from ddtree.bench import forward_ms
from ddtree.loading import random_model

t = random_model("tiny", "cuda", torch.bfloat16, vocab_size=49152, hidden_size=576, intermediate_size=1536,
                 num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
t.fuse(kernels=True)
shipped = dict(K.SKINNY_CONFIGS)
for rep in range(2):
    for name, table in (("shipped", shipped), ("off", {})):
        K.SKINNY_CONFIGS = table
        ms = {f"b{bs} T{T}": round(forward_ms(t, bs, 1024, T, graphs=True, reps=100), 4)
              for bs, T in ((1, 1), (1, 9), (1, 16), (1, 17), (1, 33), (1, 64), (4, 16), (4, 9))}
        print(f"{name:8s} {ms}", flush=True)
