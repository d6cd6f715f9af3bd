"""Tensor parallelism of the target over N ranks (torch.distributed: gloo on CPU, NCCL on GPUs).

Megatron-style split: q/k/v and gate/up are column-parallel (each rank keeps its attention heads and
MLP columns), o_proj and down_proj row-parallel with one all-reduce each, the embedding and LM head
vocabulary-parallel (masked lookup + all-reduce, all-gather of the logits). The KV cache is sharded by
KV heads. The residual stream, and so every tapped hidden state, is the same on every rank: the drafter
is replicated and the tree build and walk run identically everywhere, with no extra communication.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .model import Transformer


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    world: int

    def all_reduce(self, x: Tensor) -> Tensor:
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: Tensor) -> Tensor:
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def check_divisible(cfg, world: int) -> None:
    """Refuse a split that does not divide the model evenly, naming every offending size."""
    sizes = {"attention heads": cfg.num_attention_heads, "KV heads": cfg.num_key_value_heads,
             "MLP width": cfg.intermediate_size, "vocabulary": cfg.vocab_size}
    bad = [f"{n} {name}" for name, n in sizes.items() if n % world]
    if bad:
        raise ValueError(f"tensor parallel {world} does not divide the model: " + ", ".join(bad)
                         + f" (each must be a multiple of {world})")


@torch.no_grad()
def shard(model: Transformer, rank: int, world: int) -> Transformer:
    """Keep this rank's slice of every split weight (in place) and switch on the collectives."""
    cfg = model.config
    check_divisible(cfg, world)
    hd = cfg.head_dim
    hq, hkv = cfg.num_attention_heads // world, cfg.num_key_value_heads // world
    inter, vocab = cfg.intermediate_size // world, cfg.vocab_size // world

    def rows(p, n):
        p.data = p.data[rank * n : (rank + 1) * n].clone()

    def cols(p, n):
        p.data = p.data[:, rank * n : (rank + 1) * n].clone()

    model.fuse_off()
    for layer in model.model.layers:
        a = layer.self_attn
        for proj, heads in ((a.q_proj, hq), (a.k_proj, hkv), (a.v_proj, hkv)):
            rows(proj.weight, heads * hd)
            if proj.bias is not None:
                rows(proj.bias, heads * hd)
        cols(a.o_proj.weight, hq * hd)
        if a.o_proj.bias is not None and rank > 0:
            a.o_proj.bias.zero_()  # added once, by rank 0, before the all-reduce sums the ranks
        a.n_heads, a.n_kv = hq, hkv
        rows(layer.mlp.gate_proj.weight, inter)
        rows(layer.mlp.up_proj.weight, inter)
        cols(layer.mlp.down_proj.weight, inter)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    rows(model.model.embed_tokens.weight, vocab)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    else:
        rows(model.lm_head.weight, vocab)
    model.tp = TensorParallel(rank, world)
    for layer in model.model.layers:
        layer.self_attn.tp = layer.mlp.tp = model.tp
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env(device_type: str) -> tuple[int, int]:
    """Join the process group described by torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world)
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    return rank, world


def launch(world: int, fn, *args, device_type: str = "cpu"):
    """Run fn(rank, world, *args) in `world` fresh processes joined in one group; return rank 0's result."""
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank_main, args=(world, free_port(), device_type, fn, args, queue), nprocs=world, join=True)
    return queue.get()


def _rank_main(rank: int, world: int, port: int, device_type: str, fn, args, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_from_env(device_type)
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()
